"""The record stream's types: ``ModuleCall`` (one traced call as a sink reads it), ``CallBatch`` (a forward's calls
as columns, each ``ModuleCall`` made only when read) and ``Calls`` (the batches of one delivery).

The hot path (``recorder``) leaves each forward's columns; ``dispatcher`` resolves them into a ``CallBatch`` (ids
assigned, timestamps on the epoch clock, statistics as attributes) and hands it to every sink: span builder, OTLP
encoders, in-memory records, summary, metrics.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from torchtrace.attributes import MODULE_PATH, MODULE_TYPE

try:
    from torchtrace._native import untracked
except ImportError:  # not built: CPython untracks such a tuple itself, at the first young collection it survives

    def untracked(t: Any) -> Any:
        return t


AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


def error_message(error: BaseException) -> str:
    """``str(error)``, or a placeholder when the exception's ``__str__`` itself raises (a user's class may)."""
    try:
        return str(error)
    except Exception:
        return f"<unprintable {type(error).__name__} object>"


def error_text(error: BaseException) -> str:
    """How an error reads in a span's status, a ``stats_error`` attribute or a log line: "ValueError: message"."""
    return f"{type(error).__name__}: {error_message(error)}"


def exception_event_attributes(error: BaseException) -> dict[str, str]:
    """The attributes of the SDK's ``record_exception`` event, without the deprecated ``exception.escaped`` (and
    without calling ``str(error)`` unguarded, as the SDK does)."""
    etype = type(error)
    module, qualname = etype.__module__, etype.__qualname__
    return {
        "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
        "exception.message": error_message(error),
        "exception.stacktrace": "".join(traceback.format_exception(error)),
    }


def call_name(path: str, type_name: str, kind: str) -> str:
    """A span's name, bounded by the model's size: the module path (its class name for the model itself),
    "<path> backward" for a module's backward, and the step / phase name (``type_name``) for the others."""
    if kind == "forward":
        return path or type_name
    if kind == "backward":
        return f"{path or type_name} backward"
    return type_name


# the phase span from a training step's start (the previous step's end) to its first forward
DATA_WAIT = "data wait"


@dataclass(slots=True, eq=False)
class ModuleCall:
    """One finished call of one module: what a span and a record are made of."""

    path: str  # module path inside the instrumented model ("" is shown as the model's class name)
    type_name: str  # e.g. "torch.nn.modules.linear.Linear" shortened to "Linear"
    depth: int  # 0 for the outermost traced call of a forward
    trace_id: int  # 128-bit
    span_id: int  # 64-bit, never 0
    parent_span_id: int  # 64-bit; 0 only for a root with no parent context
    start_ns: int  # epoch nanoseconds (time.time_ns clock)
    end_ns: int
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    error: BaseException | None = None  # the exception the call raised, if it did
    thread_id: int = 0
    parent_is_remote: bool = False  # the parent is the caller's OTel span, not one of ours
    trace_flags: int = 1  # W3C flags of the trace (sampled bit set)
    trace_state: Any = None  # opentelemetry.trace.TraceState of the parent context, if any
    output_value: Any = None  # result of the user's function_on_output, if given
    input_value: Any = None  # result of the user's function_on_input, if given
    tensors: dict[str, Any] | None = None  # opt-in captured tensors (see capture_tensors)
    module_attributes: dict[str, Any] | None = None  # values of the module_attributes option after the call
    kind: str = "forward"  # "forward" | "backward" (a module's backward) | "step" | "phase" (backward, optimizer)

    @property
    def name(self) -> str:
        """Span name (``call_name``)."""
        return call_name(self.path, self.type_name, self.kind)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class NonFiniteError(ArithmeticError):
    """A module produced NaN or Inf: marks the first such call of a forward / backward (span status ERROR with an
    ``exception`` event naming the tensor); raised by ``TraceHandle.step()`` with ``Stats(on_nonfinite="raise")``."""

    def __init__(self, message: str, call: ModuleCall | None = None) -> None:
        super().__init__(message)
        self.call = call


# A sink receives each batch of finished calls, in start order per forward, off the hot path.
Sink = Callable[[Sequence[ModuleCall]], None]


class CallBatch(Sequence[ModuleCall]):
    """The calls of one traced forward as columns, as the worker resolved them: ``ModuleCall`` objects are made
    only when something reads them (records, metrics, a sink of your own). Exporters and the summary read the
    columns. A slice is a view of the same columns.

    Columns, one entry per call in start order: ``module`` (index into ``modules``), ``start_ns`` / ``end_ns``
    (epoch ns), ``parent`` (position of the parent call, -1 for the root), ``depth``, ``span_id``;
    ``attributes[i]`` is None for a call with only the module path and type; ``sparse`` holds what few calls have
    (position -> (error, output value, input value, tensors, module attributes)). A forward whose every call carries
    statistics is resolved straight to ``flat_attributes()`` (what the records and the encoders' blocks read): its
    ``attributes`` dicts are then made only if something asks for them.

    ``kind`` is that of every call: "forward", or "backward" for the module backward spans of one forward in a
    training step (nested like its calls, their roots under the step's backward span).
    """

    __slots__ = (
        "modules", "module", "start_ns", "end_ns", "parent", "depth", "span_id", "sparse", "trace_id", "root_parent_id",
        "parent_is_remote", "trace_flags", "trace_state", "thread_id", "lo", "hi", "durations", "_attributes", "_made",
        "_flat", "kind",
    )  # fmt: skip

    def __init__(self, modules: Sequence[Any], trace_id: int, root_parent_id: int, parent_is_remote: bool,
                 trace_flags: int, trace_state: Any, thread_id: int, kind: str = "forward") -> None:  # fmt: skip
        self.modules = modules
        self.kind = kind
        self.module: list[int] = []
        # the 64-bit columns: native arrays ("q", "Q") once resolved, read as ints item by item
        self.start_ns: Sequence[int] = []
        self.end_ns: Sequence[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.span_id: Sequence[int] = []
        self.sparse: dict[int, list] = {}
        self.trace_id = trace_id
        self.root_parent_id = root_parent_id
        self.parent_is_remote = parent_is_remote
        self.trace_flags = trace_flags
        self.trace_state = trace_state
        self.thread_id = thread_id
        self.lo, self.hi = 0, 0
        self.durations: bytes | None = None  # each call's end_ns - start_ns, native int64s (when resolution made them)
        self._attributes: list = [[]]  # the attributes column (None: to be made from _flat), shared likewise
        self._made: list = [None]  # the ModuleCall objects once made, shared by every view of these columns
        self._flat: list = [None]  # flat_attributes() once made, shared likewise

    @property
    def attributes(self) -> list[dict | None]:
        """Each call's own attributes, None for a call with only its module path and type (every call, not only
        this view's)."""
        column = self._attributes[0]
        if column is None:
            counts, keys, values = self._flat[0]
            column, at = [], 0
            for count in counts:
                column.append(dict(zip(keys[at : at + count], values[at : at + count])))
                at += count
            if self._attributes[0] is None:  # another thread may have made them meanwhile: one column for all
                self._attributes[0] = column
        return self._attributes[0]

    @attributes.setter
    def attributes(self, column: list[dict | None]) -> None:
        self._attributes[0] = column

    def set_flat_attributes(self, counts: tuple, keys: tuple, values: tuple) -> None:
        """Every call's attributes as ``flat_attributes()`` gives them (each call has some): the dicts are made
        only if ``attributes`` is read."""
        self._flat[0] = (counts, keys, values)
        self._attributes[0] = None

    def every_call_attributed(self) -> bool:
        """Whether every call (of the columns) has attributes of its own, without making them."""
        column = self._attributes[0]
        return column is None or None not in column

    def any_call_attributed(self, hi: int) -> bool:
        """Whether any of the first ``hi`` calls has attributes of its own, without making them."""
        column = self._attributes[0]
        if column is None:
            return hi > 0
        return column.count(None) < hi if hi == len(column) else any(column[:hi])

    @property
    def made(self) -> bool:
        """Whether ModuleCall objects exist: they are then the truth (a sink may have changed them)."""
        return self._made[0] is not None

    def calls(self) -> list[ModuleCall]:
        """Every call of the columns (not only of this view), made once."""
        if self._made[0] is None:
            made = [self._make(i) for i in range(len(self.module))]
            if self._made[0] is None:  # another thread (a records reader, the worker) may have made them meanwhile
                self._made[0] = made
        return self._made[0]

    def _make(self, i: int) -> ModuleCall:
        info = self.modules[self.module[i]]
        parent = self.parent[i]
        sparse = self.sparse.get(i)
        error, output_value, input_value, tensors, module_attributes = sparse if sparse is not None else NO_EXTRAS
        attributes = self.span_attributes(i)
        return ModuleCall(
            info.path,
            info.type_name,
            self.depth[i],
            self.trace_id,
            self.span_id[i],
            self.span_id[parent] if parent >= 0 else self.root_parent_id,
            self.start_ns[i],
            self.end_ns[i],
            attributes,
            error,
            self.thread_id,
            parent < 0 and self.parent_is_remote,
            self.trace_flags,
            self.trace_state,
            output_value,
            input_value,
            tensors,
            module_attributes,
            self.kind,
        )

    def span_name(self, i: int) -> str:
        """The span name of call ``i`` (``call_name``)."""
        info = self.modules[self.module[i]]
        return call_name(info.path, info.type_name, self.kind)

    def span_attributes(self, i: int) -> dict[str, Any]:
        """The attributes of call ``i``'s span: its own, or only its module path and type."""
        attributes = self.attributes[i]
        if attributes is None:
            info = self.modules[self.module[i]]
            return {MODULE_PATH: info.path, MODULE_TYPE: info.type_name}
        return attributes

    def rows(self) -> Iterator[tuple[int, int, int, int, dict | None, int, int]]:
        """(position, module index, depth, parent position, attributes or None, start ns, end ns) of each call of
        this view: what the encoders, the records and the span builder read per call."""
        lo, hi = self.lo, self.hi
        return zip(
            range(lo, hi),
            self.module[lo:hi],
            self.depth[lo:hi],
            self.parent[lo:hi],
            self.attributes[lo:hi],
            self.start_ns[lo:hi],
            self.end_ns[lo:hi],
        )

    def flat_attributes(self) -> tuple[tuple, tuple, tuple]:
        """(each call's number of attributes, all their keys, all their values) of every call of the columns (not
        only of this view), in call order; made once. What the records keep of a forward and what its encoded block
        is matched by; the counts and keys are interned (the forwards of a model repeat them)."""
        flat = self._flat[0]
        if flat is None:
            attributes = self.attributes
            if None in attributes:
                attributes = [attrs or _NO_ATTRIBUTES for attrs in attributes]
            flat = self._flat[0] = (
                interned(tuple(map(len, attributes))),
                interned(tuple(chain.from_iterable(attributes))),
                tuple(chain.from_iterable(map(dict.values, attributes))),
            )
        return flat

    def error(self, i: int) -> BaseException | None:
        sparse = self.sparse.get(i)
        return sparse[0] if sparse is not None else None

    def add_attributes(self, i: int, extra: dict[str, Any]) -> None:
        """Adds attributes to call ``i``: for a sink that annotates calls (drift), before the exporters read them."""
        column = self.attributes  # made from the flat form if need be
        own = dict(self.span_attributes(i))
        own.update(extra)
        column[i] = own
        self._flat[0] = None
        if self.made:
            self._made[0][i].attributes = own

    def set_error(self, i: int, error: BaseException) -> None:
        sparse = self.sparse.get(i)
        if sparse is None:
            sparse = self.sparse[i] = list(NO_EXTRAS)
        sparse[0] = error
        if self.made:
            self._made[0][i].error = error

    def __len__(self) -> int:
        return self.hi - self.lo

    def __iter__(self):
        return iter(self.calls()[self.lo : self.hi])

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                return self.calls()[self.lo : self.hi][key]
            view = object.__new__(CallBatch)
            for name in CallBatch.__slots__:
                setattr(view, name, getattr(self, name))
            view.lo, view.hi = self.lo + lo, self.lo + max(lo, hi)
            return view
        return self.calls()[self.lo : self.hi][key]


NO_EXTRAS = (None, None, None, None, None)  # a call with no error, no user values, no captures
_NO_ATTRIBUTES: dict = {}  # in flat_attributes(): a call with only its module path and type
_MAX_INTERNED = 10_000  # attribute layouts kept interned (ever-new output structures: start over)
_interned_tuples: dict[tuple, tuple] = {}


def interned(values: tuple) -> tuple:
    """The one tuple kept equal to ``values`` (bounded): repeated layouts share one object, compared by identity."""
    kept = _interned_tuples.get(values)
    if kept is None:
        if len(_interned_tuples) >= _MAX_INTERNED:
            _interned_tuples.clear()
        kept = _interned_tuples[values] = untracked(values)
    return kept


class Calls(Sequence[ModuleCall]):
    """A batch handed to the sinks: segments (``CallBatch`` columns of one forward, or lists of ``ModuleCall``:
    training steps) read as one sequence. Sinks that know columns read ``segments``."""

    __slots__ = ("segments", "_length")

    def __init__(self, segments: Sequence[Sequence[ModuleCall]]) -> None:
        self.segments = [segment for segment in segments if len(segment)]
        self._length = sum(len(segment) for segment in self.segments)

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        for segment in self.segments:
            yield from segment

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(self._length)
            if step != 1:
                return list(self)[key]
            segments = []
            offset = 0
            for segment in self.segments:
                end = offset + len(segment)
                if end > lo and offset < hi:
                    segments.append(segment[max(lo - offset, 0) : min(hi, end) - offset])
                offset = end
            return Calls(segments)
        if key < 0:
            key += self._length
        if not 0 <= key < self._length:
            raise IndexError("call index out of range")
        for segment in self.segments:
            if key < len(segment):
                return segment[key]
            key -= len(segment)
        raise IndexError("call index out of range")
