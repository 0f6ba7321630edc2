"""Sink: the in-memory records API (spikingjelly monitor style), bounded: it keeps statistics, not tensors.

Records live long (the latest ``max_records`` calls), so they are kept in a form Python's garbage collector stops
tracking: one flat tuple of atomic values (the fields, the interned attribute keys, the attribute values) is
untracked by the first young collections it survives, where a ``ModuleCall`` and its attribute dict stay tracked
(a tuple holding a tuple, such as a shape, goes one collection after it: hence flat). Tracked records would be
promoted to the oldest generation by the thousand per second and trigger a full collection of the whole heap every
second or two (hundreds of milliseconds each in a torch process). ``ModuleCall`` objects are rebuilt on reading.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any

from torchtrace._calls import NO_EXTRAS, CallBatch, Calls, ModuleCall

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
_MAX_KEY_TUPLES = 10_000  # attribute layouts kept interned (ever-new output structures: start over)
_key_tuples: dict[tuple, tuple] = {}


def pack(call: ModuleCall) -> tuple:
    """``call`` as one tuple: GC-untracked once it survives a collection, when all its values are atomic."""
    attributes = call.attributes
    # flat: a tuple inside a tuple is untracked one collection later than it (the inner one is visited last)
    return (*_HEAD(call), *_TAIL(call), _interned(tuple(attributes)), *attributes.values())


_TIMING_KEYS = ("torchtrace.module.path", "torchtrace.module.type")


def pack_columns(batch: CallBatch) -> Iterator[tuple]:
    """The calls of a forward's columns, packed as ``pack`` packs them, without making ``ModuleCall`` objects."""
    modules, ids, sparse = batch.modules, batch.span_id, batch.sparse
    trace_id, root_parent, remote = batch.trace_id, batch.root_parent_id, batch.parent_is_remote
    flags, trace_state, thread_id = batch.trace_flags, batch.trace_state, batch.thread_id
    lo, hi = batch.lo, batch.hi
    for position, index, depth, parent, start, end, attributes in zip(
        range(lo, hi),
        batch.module[lo:hi],
        batch.depth[lo:hi],
        batch.parent[lo:hi],
        batch.start_ns[lo:hi],
        batch.end_ns[lo:hi],
        batch.attributes[lo:hi],
    ):
        info = modules[index]
        error, output_value, input_value, tensors, module_attributes = sparse.get(position) or NO_EXTRAS
        head = (info.path, info.type_name, depth, trace_id, ids[position], ids[parent] if parent >= 0 else root_parent,
                start, end, error, thread_id, parent < 0 and remote, flags, trace_state, output_value, input_value,
                tensors, module_attributes, "forward")  # fmt: skip
        if attributes is None:
            yield (*head, _TIMING_KEYS, info.path, info.type_name)
        else:
            yield (*head, _interned(tuple(attributes)), *attributes.values())


def _interned(keys: tuple) -> tuple:
    interned = _key_tuples.get(keys)
    if interned is None:
        if len(_key_tuples) >= _MAX_KEY_TUPLES:
            _key_tuples.clear()
        interned = _key_tuples[keys] = keys
    return interned


def unpack(packed: tuple) -> ModuleCall:
    """A new ``ModuleCall`` equal, field by field, to the one packed."""
    keys = packed[_KEYS]
    return ModuleCall(*packed[:_HEAD_SIZE], dict(zip(keys, packed[_KEYS + 1 :])), *packed[_HEAD_SIZE:_KEYS])


class RecordStore:
    """The latest ``max_records`` calls, in call order, also indexed by module path (oldest dropped first)."""

    def __init__(self, max_records: int, on_drop: Callable[[ModuleCall], None] | None = None) -> None:
        self.max_records = max_records
        self.dropped = 0
        self._on_drop = on_drop  # e.g. gives a dropped call's captured tensors back to the capture budget
        self._records: collections.deque[tuple] = collections.deque()  # packed calls
        self._by_path: dict[tuple[str, str], collections.deque[tuple]] = {}  # (kind, path) -> packed calls

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        records, by_path = self._records, self._by_path
        for segment in calls.segments if isinstance(calls, Calls) else [calls]:
            if isinstance(segment, CallBatch) and not segment.made:
                packed_calls: Iterable[tuple] = pack_columns(segment)
            else:
                packed_calls = map(pack, segment)
            for packed in packed_calls:
                records.append(packed)
                path_records = by_path.get((packed[_KIND], packed[0]))
                if path_records is None:
                    path_records = by_path[(packed[_KIND], packed[0])] = collections.deque()
                path_records.append(packed)
        while len(records) > self.max_records:
            oldest = records.popleft()
            by_path[(oldest[_KIND], oldest[0])].popleft()  # the oldest of its path too: both are in call order
            if not self.dropped:
                _logger.info(
                    "torchtrace: more than max_records=%d calls: the oldest leave the records (handle.dropped_records);"
                    " exporters still get every call",
                    self.max_records,
                )
            self.dropped += 1
            if self._on_drop is not None and _holds_objects(oldest):
                self._on_drop(unpack(oldest))

    def all(self) -> list[ModuleCall]:
        return [unpack(packed) for packed in list(self._records)]  # a C-level copy: the worker may append meanwhile

    def at(self, key: int | slice) -> Any:
        """``all()[key]``, rebuilding only the calls asked for."""
        if isinstance(key, slice):
            return [unpack(packed) for packed in list(self._records)[key]]
        return unpack(self._records[key])

    def for_path(self, path: str, kind: str = "forward") -> list[ModuleCall]:
        return [unpack(packed) for packed in list(self._by_path.get((kind, path), ()))]

    def clear(self) -> None:
        self._records.clear()
        self._by_path.clear()


def _holds_objects(packed: tuple) -> bool:
    """Whether a packed call holds captured tensors or module attribute values (what ``on_drop`` is for)."""
    return packed[_TENSORS] is not None or packed[_TENSORS + 1] is not None
