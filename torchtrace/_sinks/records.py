"""Sink: the in-memory records API (spikingjelly monitor style), bounded: it keeps statistics, not tensors.

Records live long (the latest ``max_records`` calls), so they are kept in a form Python's garbage collector stops
tracking: tuples of atomic values (the fields, the interned attribute keys, the attribute values), untracked as they
are made where the compiled module is built (``untracked``), else by the first young collections they survive (a
tuple holding a tuple goes one collection after it), where a ``ModuleCall`` and its attribute dict stay tracked.
Tracked records would be promoted to the oldest generation by the thousand per second and trigger a full collection
of the whole heap every second or two (hundreds of milliseconds each in a torch process). ``ModuleCall`` objects are
rebuilt on reading.
"""

from __future__ import annotations

import collections
import logging
from array import array
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any

from torchtrace._core.calls import NO_EXTRAS, CallBatch, Calls, ModuleCall, interned, untracked
from torchtrace.attributes import MODULE_PATH, MODULE_TYPE

_logger = logging.getLogger(__name__)

# Every field of ModuleCall but its attributes, in declaration order: (path, ..., end_ns) precede attributes.
_HEAD = attrgetter("path", "type_name", "depth", "trace_id", "span_id", "parent_span_id", "start_ns", "end_ns")
_TAIL = attrgetter(
    "error",
    "thread_id",
    "parent_is_remote",
    "trace_flags",
    "trace_state",
    "output_value",
    "input_value",
    "tensors",
    "module_attributes",
    "kind",
)
_HEAD_SIZE = 8
_KEYS = _HEAD_SIZE + 10  # the attribute keys follow the fields, the attribute values follow them
_KIND = _KEYS - 1
_TENSORS = _KEYS - 3  # "tensors", then "module_attributes"


def pack(call: ModuleCall) -> tuple:
    """``call`` as one tuple: GC-untracked once it survives a collection, when all its values are atomic."""
    attributes = call.attributes
    # flat: a tuple inside a tuple is untracked one collection later than it (the inner one is visited last)
    return untracked((*_HEAD(call), *_TAIL(call), interned(tuple(attributes)), *attributes.values()))


_TIMING_KEYS = (MODULE_PATH, MODULE_TYPE)


def pack_columns(batch: CallBatch) -> Iterator[tuple]:
    """The calls of a forward's columns, packed as ``pack`` packs them, without making ``ModuleCall`` objects."""
    modules, ids, sparse = batch.modules, batch.span_id, batch.sparse
    trace_id, root_parent, remote = batch.trace_id, batch.root_parent_id, batch.parent_is_remote
    flags, trace_state, thread_id = batch.trace_flags, batch.trace_state, batch.thread_id
    for position, index, depth, parent, attributes, start, end in batch.rows():
        info = modules[index]
        error, output_value, input_value, tensors, module_attributes = sparse.get(position) or NO_EXTRAS
        head = (info.path, info.type_name, depth, trace_id, ids[position], ids[parent] if parent >= 0 else root_parent,
                start, end, error, thread_id, parent < 0 and remote, flags, trace_state, output_value, input_value,
                tensors, module_attributes, batch.kind)  # fmt: skip
        if attributes is None:
            yield untracked((*head, _TIMING_KEYS, info.path, info.type_name))
        else:
            yield untracked((*head, interned(tuple(attributes)), *attributes.values()))


def _native_bytes(column: Sequence[int], code: str, hi: int) -> bytes:
    """The first ``hi`` values of a 64-bit column as native bytes (a column made in Python may be a list)."""
    return column[:hi].tobytes() if isinstance(column, array) else array(code, column[:hi]).tobytes()


def unpack(packed: tuple) -> ModuleCall:
    """A new ``ModuleCall`` equal, field by field, to the one packed."""
    keys = packed[_KEYS]
    return ModuleCall(*packed[:_HEAD_SIZE], dict(zip(keys, packed[_KEYS + 1 :])), *packed[_HEAD_SIZE:_KEYS])


class RecordStore:
    """The latest ``max_records`` calls, in call order (oldest dropped first).

    A whole forward (or one forward's backward spans) with no error, user value or capture is kept as one tuple of its
    columns and its calls' attribute keys and values (tuples themselves: the values the worker made, shared); any
    other call as its own packed tuple. Both are untracked by the garbage collector; ``ModuleCall`` objects are made
    when the records are read.
    """

    def __init__(self, max_records: int, on_drop: Callable[[ModuleCall], None] | None = None) -> None:
        self.max_records = max_records
        self.dropped = 0
        self._on_drop = on_drop  # e.g. gives a dropped call's captured tensors back to the capture budget
        self._records: collections.deque[tuple] = collections.deque()  # packed calls and packed forwards
        self._count = 0  # calls in _records
        self._modules: dict[int, Sequence[Any]] = {}  # id -> the module list a packed forward's indices refer to

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        records = self._records
        for segment in calls.segments if isinstance(calls, Calls) else [calls]:
            if _whole_forward(segment):
                records.append(self._pack_forward(segment))
            elif isinstance(segment, CallBatch) and not segment.made:
                records.extend(pack_columns(segment))
            else:
                records.extend(map(pack, segment))
            self._count += len(segment)
        if self._count > self.max_records:
            self._drop_oldest(self._count - self.max_records)

    def _pack_forward(self, batch: CallBatch) -> tuple:
        """A forward's calls as one tuple: its fields, its columns (a tuple each), then (when a call has attributes)
        the number of attributes of each call, all their keys (interned: forwards of one model repeat them) and all
        their values (the tuple the worker made: a flat copy of it cost ~10 us a forward of 129 calls)."""
        self._modules.setdefault(id(batch.modules), batch.modules)
        hi = batch.hi
        whole = hi == len(batch.module)
        head = (
            batch.trace_id,
            batch.root_parent_id,
            batch.parent_is_remote,
            batch.trace_flags,
            batch.thread_id,
            batch.kind,
        )
        columns = [untracked(tuple(column if whole else column[:hi])) for column in
                   (batch.module, batch.depth, batch.parent)]  # fmt: skip
        # the 64-bit columns (times, span ids) as their bytes: no Python int per call, and untracked (an array is not)
        columns += [_native_bytes(batch.start_ns, "q", hi), _native_bytes(batch.end_ns, "q", hi),
                    _native_bytes(batch.span_id, "Q", hi)]  # fmt: skip
        if not batch.any_call_attributed(hi):
            return untracked((_FORWARD, hi, id(batch.modules), *head, *columns))
        counts, keys, values = batch.flat_attributes()
        return untracked((_FORWARD_WITH_ATTRIBUTES, hi, id(batch.modules), *head, *columns, counts, keys,
                          untracked(values)))  # fmt: skip

    def _calls_of(self, packed: tuple) -> list[tuple]:
        """A packed forward as packed calls (a packed call as itself)."""
        if type(packed[0]) is not int:  # a packed call starts with its path
            return [packed]
        if packed[0] == _PARTIAL:
            return self._calls_of(packed[3])[packed[2] :]
        _, n, modules_id, trace_id, root_parent, remote, flags, thread_id, kind = packed[:_FORWARD_HEAD]
        modules = self._modules[modules_id]
        module, depth, parent, start_ns, end_ns, span_id = packed[_FORWARD_HEAD : _FORWARD_HEAD + 6]
        columns = (module, depth, parent, array("q", start_ns), array("q", end_ns), array("Q", span_id))
        # a forward without attributes ends with its columns: no call has any
        counts, keys, values = packed[_FORWARD_HEAD + 6 :] or ((0,) * n, (), ())
        calls = []
        span_ids = columns[5]
        at = 0
        for index, depth, parent, start, end, span_id, count in zip(*columns, counts):
            info = modules[index]
            parent_id = span_ids[parent] if parent >= 0 else root_parent
            head = (info.path, info.type_name, depth, trace_id, span_id, parent_id, start, end, None, thread_id,
                    parent < 0 and remote, flags, None, None, None, None, None, kind)  # fmt: skip
            if count:
                calls.append((*head, keys[at : at + count], *values[at : at + count]))
                at += count
            else:
                calls.append((*head, _TIMING_KEYS, info.path, info.type_name))
        return calls

    def _drop_oldest(self, excess: int) -> None:
        """Drops the ``excess`` oldest calls: once the records are full, as many as each batch brings."""
        records, on_drop = self._records, self._on_drop
        if not self.dropped:
            _logger.info(
                "torchtrace: more than Records(max_records=%d) calls: the oldest leave the records "
                "(handle.dropped_records); exporters still get every call",
                self.max_records,
            )
        left = excess
        while left:
            oldest = records.popleft()
            if type(oldest[0]) is not int:  # one packed call
                left -= 1
                if on_drop is not None and _holds_objects(oldest):
                    on_drop(unpack(oldest))
            elif oldest[1] <= left:  # a (rest of a) packed forward: nothing in it to give back, only counted
                left -= oldest[1]
            else:  # part of a forward: the rest stays, its first calls skipped when read (O(1): a full store
                # drops part of a forward at every batch; unpacking the rest call by call cost ~0.3 us a call)
                skipped = left + (oldest[2] if oldest[0] == _PARTIAL else 0)
                records.appendleft(
                    (_PARTIAL, oldest[1] - left, skipped, oldest[3] if oldest[0] == _PARTIAL else oldest)
                )
                left = 0
        self.dropped += excess
        self._count -= excess

    def _packed_calls(self) -> list[tuple]:
        records = list(self._records)  # a C-level copy: the worker may append meanwhile
        return [call for packed in records for call in self._calls_of(packed)]

    def all(self) -> list[ModuleCall]:
        return [unpack(packed) for packed in self._packed_calls()]

    def at(self, key: int | slice) -> Any:
        """``all()[key]``, rebuilding only the calls asked for."""
        if isinstance(key, slice):
            return [unpack(packed) for packed in self._packed_calls()[key]]
        return unpack(self._packed_calls()[key])

    def for_path(self, path: str, kind: str = "forward") -> list[ModuleCall]:
        return [unpack(packed) for packed in self._packed_calls() if packed[0] == path and packed[_KIND] == kind]

    def clear(self) -> None:
        self._records.clear()
        self._count = 0
        self._modules.clear()


_FORWARD = 0  # first value of a packed forward (an int: a packed call starts with its path, a str)
_FORWARD_WITH_ATTRIBUTES = 1  # the same, followed by its calls' attributes
# (_FORWARD or _FORWARD_WITH_ATTRIBUTES, calls, id(modules), trace id, root parent id, remote, flags, thread id, the
# calls' kind: "forward", or "backward" for a forward's backward spans), then six columns
_FORWARD_HEAD = 9
_PARTIAL = 2  # (_PARTIAL, calls left, calls skipped, a packed forward): the rest of a forward whose first calls left


def _whole_forward(segment: Sequence[ModuleCall]) -> bool:
    """Columns of a whole forward (or of one forward's backward spans) with nothing but attributes (or the first calls
    of one with none): no error, user value, capture or trace state (what a packed forward leaves out)."""
    if not isinstance(segment, CallBatch) or segment.made or segment.trace_state is not None or segment.lo:
        return False  # (a view from the first call on: parent positions stay inside the packed columns)
    hi = segment.hi
    if hi < len(segment.module) and segment.any_call_attributed(hi):
        return False
    return not any(position < hi for position in segment.sparse)


def _holds_objects(packed: tuple) -> bool:
    """Whether a packed call holds captured tensors or module attribute values (what ``on_drop`` is for)."""
    return packed[_TENSORS] is not None or packed[_TENSORS + 1] is not None
