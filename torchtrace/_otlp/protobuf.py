"""Fast OTLP encoding: ``ModuleCall`` batches straight to ``ExportTraceServiceRequest`` bytes.

Building a protobuf object (or an SDK span) per call costs ~7 us/span of Python work under the GIL. Almost all
of a span's bytes are static per module: the name, the attribute keys, and usually the non-float attribute
values (dtype, shape). Only ids, timestamps and float statistics change from call to call, and those are all
fixed-width in protobuf (bytes of known length, fixed64, double). So:

1. per span, a cheap key picks a cached *template row*: the complete encoded ``Span`` (with its ScopeSpans field
   tag and length) with zeros where the fixed-width values go, plus the offsets of those slots;
2. the batch is the concatenation of its template rows (one C-level ``b"".join``);
3. numpy writes every id, timestamp and double of the whole batch into its slot at once (fancy indexing).

Spans that do not fit (a recorded exception, attribute values marshal cannot key, e.g. numpy scalars) go through
``_encode_span_row``, the same builder used to make templates, so both paths produce identical bytes.

The output decodes to exactly what opentelemetry-exporter-otlp's ``encode_spans`` produces for the same spans
(tests/test_otlp_encoding.py compares them), spans in input order, with two deliberate choices: flags are what the
SDK 1.45 encoder writes (0x100, | 0x200 for a remote parent; no W3C trace-flag bits), and the exception event has
no ``exception.escaped`` attribute (deprecated in the semantic conventions; the SDK still adds it).

Span limits are the SDK's (``SpanLimits`` from ``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`` / ``OTEL_ATTRIBUTE_COUNT_LIMIT``,
default 128; ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`` / ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, default unlimited;
the exception event's attributes by ``OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT`` and ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``),
applied with the SDK's own ``BoundedAttributes``: past the count limit the earliest attributes are dropped and
``dropped_attributes_count`` says how many; longer strings are truncated. Spans within the limits (nearly all) pay
one length check.
"""

from __future__ import annotations

import logging
import marshal
import struct
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits

from torchtrace._core.calls import CallBatch, Calls, ModuleCall, error_text, exception_event_attributes
from torchtrace.attributes import MODULE_PATH, MODULE_TYPE

try:
    from torchtrace._native import put_span_fields as _put_span_fields
    from torchtrace._native import put_values as _put_values
    from torchtrace._native import same_values as _same_values
except ImportError:  # not built (no C compiler at install): numpy writes the same bytes, Python compares
    _put_values = _put_span_fields = _same_values = None

_logger = logging.getLogger(__name__)

__all__ = ["encode_export_request", "clear_template_cache"]

_MAX_TEMPLATES = 4096  # (name, parent kind, keys, value types) entries; cleared wholesale when exceeded
_MAX_VARIANTS = 64  # distinct non-float value sets (e.g. shapes) per entry
_U64 = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_PACK_D = struct.Struct("<d").pack
_PACK_Q = struct.Struct("<Q").pack
_PACK_D_INTO = struct.Struct("<d").pack_into
_PACK_Q_INTO = struct.Struct("<Q").pack_into
_SPAN_KIND_INTERNAL = b"\x30\x01"  # Span.kind = SPAN_KIND_INTERNAL
_FLAGS_TAG = b"\x85\x01"  # Span.flags, field 16, fixed32
_FLAG_HAS_IS_REMOTE, _FLAG_IS_REMOTE = 0x100, 0x200
_STATUS_UNSET = b"\x7a\x00"  # the SDK always sets Status, so an empty one is present
_AR8 = np.arange(8, dtype=np.intp)
_AR5 = np.arange(5, dtype=np.intp)
_SHIFTS7 = np.arange(0, 35, 7, dtype=np.uint64)
_CONTINUE = np.array([0x80, 0x80, 0x80, 0x80, 0], dtype=np.uint8)
_AR16 = np.arange(16, dtype=np.intp)


# --- protobuf wire primitives -------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0:  # int64 two's complement: always 10 bytes
        n &= _U64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """Length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes | None:
    """AnyValue body as the SDK's ``_encode_value`` (after attribute cleaning) makes it; None = dropped."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"  # AnyValue.value is a oneof: defaults are written too
    if isinstance(value, str):
        return _ld(b"\x0a", value.encode("utf-8"))
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            return None  # the SDK encoder fails on it and drops the attribute
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _PACK_D(value)
    if isinstance(value, bytes):
        return _ld(b"\x3a", value)
    if isinstance(value, Sequence):
        items = [_any_value(v) for v in value]
        if any(i is None for i in items):
            return None
        return _ld(b"\x2a", b"".join(_ld(b"\x0a", i) for i in items))
    if isinstance(value, Mapping):
        kvs = [_key_value(str(k), v) for k, v in value.items()]
        if any(kv is None for kv in kvs):
            return None
        return _ld(b"\x32", b"".join(_ld(b"\x0a", kv) for kv in kvs))
    # The SDK's attribute cleaning turns other types (numpy scalars, enums...) into str when they have one.
    if type(value).__str__ is not object.__str__ or type(value).__repr__ is not object.__repr__:
        return _any_value(str(value))
    return b""


def _key_value(key: str, value: Any) -> bytes | None:
    body = _any_value(value)
    if body is None:
        return None
    return _ld(b"\x0a", key.encode("utf-8")) + _ld(b"\x12", body)


def _attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    return b"".join(_ld(tag, kv) for k, v in attributes.items() if (kv := _key_value(k, v)) is not None)


def _trace_state_str(trace_state: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in trace_state.items())


class _Limits:
    """The SDK's span limits, read from the environment once per request."""

    __slots__ = ("attributes", "value_length", "events", "event_attributes", "event_value_length")

    def __init__(self) -> None:
        limits = SpanLimits()
        self.attributes = limits.max_span_attributes
        self.events = limits.max_events  # 0 (OTEL_SPAN_EVENT_COUNT_LIMIT=0): the exception event is dropped, counted
        self.value_length = limits.max_span_attribute_length
        self.event_attributes = limits.max_event_attributes
        self.event_value_length = limits.max_attribute_length


def _too_long(value: Any, length: int) -> bool:
    if isinstance(value, str):
        return len(value) > length
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, str) and len(item) > length for item in value)
    return False


def _over_limits(attributes: Mapping[str, Any], limits: _Limits) -> bool:
    if limits.attributes is not None and len(attributes) > limits.attributes:
        return True
    length = limits.value_length
    return length is not None and any(_too_long(value, length) for value in attributes.values())


_warned_dropping = False


def _bounded(attributes: Mapping[str, Any], count: int | None, length: int | None) -> tuple[dict[str, Any], int]:
    """Attributes as the SDK keeps them under these limits (values cleaned and cut to ``length``, the oldest
    dropped past ``count``), and how many were dropped: counted on the span, logged once per process (the SDK's
    BoundedAttributes would log each dropped attribute of each span)."""
    global _warned_dropping
    items = list(BoundedAttributes(None, attributes, immutable=False, max_value_len=length).items())
    dropped = max(0, len(items) - count) if count is not None else 0
    if dropped and not _warned_dropping:
        _warned_dropping = True
        _logger.warning(
            "torchtrace: a span has %d attributes, over the limit of %d (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT); the "
            "oldest are dropped and counted in dropped_attributes_count (logged once)",
            len(items),
            count,
        )
    return dict(items[dropped:]), dropped


def exception_attributes(error: BaseException, limits: _Limits | None = None) -> tuple[dict[str, str], int]:
    """The attributes of SDK ``record_exception``'s event (without the deprecated ``exception.escaped``), bounded
    by the event limits, and how many were dropped."""
    attrs = exception_event_attributes(error)
    if limits is None:
        return attrs, 0
    return _bounded(attrs, limits.event_attributes, limits.event_value_length)


def _exception_event(error: BaseException, time_ns: int, limits: _Limits | None = None) -> bytes:
    """Span.events entry like SDK ``record_exception``."""
    attrs, dropped = exception_attributes(error, limits)
    body = b"\x09" + _PACK_Q(time_ns) + _ld(b"\x12", b"exception") + _attributes(b"\x1a", attrs)
    if dropped:
        body += b"\x20" + _varint(dropped)  # Event.dropped_attributes_count
    return _ld(b"\x5a", body)


# --- templates ----------------------------------------------------------------------------------------------


class _Template:
    """One encoded ScopeSpans.spans entry with zeroed fixed-width slots, and where the slots are."""

    __slots__ = ("row", "tid", "sid", "pid", "start", "doubles", "n_doubles", "dims", "n_dims")

    def __init__(
        self, row: bytes, tid: int, sid: int, pid: int, start: int, doubles: list[int], dims: list[int] = ()
    ) -> None:
        self.row = row
        self.tid, self.sid, self.pid, self.start = tid, sid, pid, start  # end is at start + 9; pid -1: no parent
        self.doubles = np.asarray(doubles, dtype=np.intp)
        self.n_doubles = len(doubles)
        self.dims = np.asarray(dims, dtype=np.intp)  # 5-byte varint slots of the int arrays (shapes), in order
        self.n_dims = len(dims)


# A shape changes from call to call (sequence lengths): its dimensions are written into fixed 5-byte varint slots
# (non-minimal varints, which every protobuf parser reads as the same numbers), so the template stays the same.
_DIM_LIMIT = 1 << 35  # what 5 varint bytes hold
_DIM_SLOT = b"\x0a\x06\x18" + bytes(5)  # ArrayValue.values: AnyValue{int_value: <5-byte varint>}


def _dims_key_value(key: str, rank: int) -> bytes:
    """KeyValue{key, AnyValue{array_value}} of ``rank`` zeroed dimension slots; each slot's varint is its last
    5 bytes."""
    return _ld(b"\x0a", key.encode("utf-8")) + _ld(b"\x12", _ld(b"\x2a", _DIM_SLOT * rank))


def _is_dims(value: Any) -> bool:
    """A non-empty tuple of plain ints (a shape): encoded into dimension slots."""
    return type(value) is tuple and len(value) > 0 and all(type(item) is int for item in value)


def _build(
    call: ModuleCall,
    name: str,
    trace_state: str | None,
    float_slots: frozenset[int],
    limits: _Limits | None = None,
    dims_slots: frozenset[int] = frozenset(),
) -> _Template:
    """Encode ``call`` as a template; attribute values at positions ``float_slots`` become zeroed 8-byte slots,
    int tuples at ``dims_slots`` zeroed 5-byte varint slots. With ``limits``, attributes are bounded first (the
    slow path only: then there are no slots)."""
    parts: list[bytes] = []
    size = 0
    slots: dict[str, int] = {}
    doubles: list[int] = []
    dims: list[int] = []

    def put(b: bytes) -> None:
        nonlocal size
        parts.append(b)
        size += len(b)

    put(b"\x0a\x10")
    slots["tid"] = size
    put(bytes(16))
    put(b"\x12\x08")
    slots["sid"] = size
    put(bytes(8))
    if trace_state:
        put(_ld(b"\x1a", trace_state.encode("utf-8")))
    slots["pid"] = -1
    if call.parent_span_id:
        put(b"\x22\x08")
        slots["pid"] = size
        put(bytes(8))
    put(_ld(b"\x2a", name.encode("utf-8")) + _SPAN_KIND_INTERNAL + b"\x39")
    slots["start"] = size
    put(bytes(8) + b"\x41" + bytes(8))
    attributes, dropped = call.attributes, 0
    if limits is not None and _over_limits(attributes, limits):
        attributes, dropped = _bounded(attributes, limits.attributes, limits.value_length)
    for position, (key, value) in enumerate(attributes.items()):
        if position in float_slots:
            kb = _ld(b"\x0a", key.encode("utf-8"))
            put(_ld(b"\x4a", kb + b"\x12\x09\x21" + bytes(8))[:-8])
            doubles.append(size)
            put(bytes(8))
        elif position in dims_slots:
            field = _ld(b"\x4a", _dims_key_value(key, len(value)))
            first = size + len(field) - len(_DIM_SLOT) * len(value) + 3  # each slot: tag, length, tag, varint
            dims.extend(first + i * len(_DIM_SLOT) for i in range(len(value)))
            put(field)
        elif (kv := _key_value(key, value)) is not None:
            put(_ld(b"\x4a", kv))
    if dropped:
        put(b"\x50" + _varint(dropped))  # Span.dropped_attributes_count
    if call.error is not None:
        if limits is not None and limits.events == 0:
            put(b"\x60\x01")  # Span.dropped_events_count = 1
        else:
            put(_exception_event(call.error, call.end_ns, limits))
        message = error_text(call.error).encode()
        put(_ld(b"\x7a", _ld(b"\x12", message) + b"\x18\x02"))  # Status{message, code=ERROR}
    else:
        put(_STATUS_UNSET)
    flags = _FLAG_HAS_IS_REMOTE | (_FLAG_IS_REMOTE if call.parent_span_id and call.parent_is_remote else 0)
    put(_FLAGS_TAG + flags.to_bytes(4, "little"))

    head = b"\x12" + _varint(size)  # ScopeSpans.spans tag + Span length: shifts every slot
    h = len(head)
    return _Template(
        head + b"".join(parts),
        slots["tid"] + h,
        slots["sid"] + h,
        slots["pid"] + h if slots["pid"] >= 0 else -1,
        slots["start"] + h,
        [d + h for d in doubles],
        [d + h for d in dims],
    )


def _encode_span_row(call: ModuleCall, trace_state: str | None, limits: _Limits | None = None) -> bytes:
    """Slow path: one span, all values written here (errors, odd attribute types, spans over the limits)."""
    t = _build(call, call.name, trace_state, frozenset(), limits)
    row = bytearray(t.row)
    _write_ids_and_times(row, 0, t, call)
    return bytes(row)


def _write_ids_and_times(out: bytearray, base: int, t: _Template, call: ModuleCall) -> None:
    """A span's trace id, span id, parent id and times into its template's slots (the row at ``base``)."""
    at = base + t.tid
    out[at : at + 16] = call.trace_id.to_bytes(16, "big")
    at = base + t.sid
    out[at : at + 8] = call.span_id.to_bytes(8, "big")
    if t.pid >= 0:
        at = base + t.pid
        out[at : at + 8] = call.parent_span_id.to_bytes(8, "big")
    _PACK_Q_INTO(out, base + t.start, call.start_ns)
    _PACK_Q_INTO(out, base + t.start + 9, call.end_ns)


class _Shape:
    """What is fixed per (name, parent kind, trace state, keys): which attribute values are float slots.

    Decided by the first call seen; a later call with a non-float where a float was is caught by the batch-wide
    type check in ``_encode_spans``, and a float where a non-float was is part of the variant key (constant).
    """

    __slots__ = ("float_positions", "dims_positions", "floats", "dims", "others", "variants")

    def __init__(self, values: tuple, dims: bool = True) -> None:
        self.float_positions = frozenset(i for i, v in enumerate(values) if type(v) is float)
        # with ``dims``, shapes are slots too (their ranks are part of the variant key)
        self.dims_positions = frozenset(i for i, v in enumerate(values) if dims and _is_dims(v))
        self.floats = _getter(sorted(self.float_positions))
        self.dims = _getter(sorted(self.dims_positions))
        slots = self.float_positions | self.dims_positions
        self.others = _getter([i for i in range(len(values)) if i not in slots])
        self.variants: dict[bytes, Any] = {}  # marshal(other values, ranks) -> template (protobuf or JSON)

    def variant(self, values: tuple) -> bytes:
        """The variant key of ``values``: marshal keeps True/1/1.0 and list/tuple apart, so equal keys mean
        identical encodings; it raises ValueError on types it does not know (numpy scalars...), and TypeError where
        a shape's place holds something without a length. A shape that is no tuple any more gets the slots of its
        length here and is refused by ``_slots_fit``."""
        if not self.dims_positions:
            return marshal.dumps(self.others(values), 2)  # version 2: no back-references
        return marshal.dumps((self.others(values), tuple(map(len, self.dims(values)))), 2)


def cached_shape(cache: dict[tuple, _Shape], key: tuple, values: tuple, dims: bool = True) -> _Shape:
    """The shape of spans keyed ``key`` in ``cache`` (decided by ``values``, the first seen); the cache starts over
    past ``_MAX_TEMPLATES`` keys (ever-new output structures)."""
    shape = cache.get(key)
    if shape is None:
        if len(cache) >= _MAX_TEMPLATES:
            cache.clear()
        shape = cache[key] = _Shape(values, dims)
    return shape


def _getter(indices: list[int]) -> Any:
    """itemgetter that always returns a tuple."""
    if not indices:
        return lambda v: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda v: (v[i],)
    return itemgetter(*indices)


_shapes: dict[tuple, _Shape] = {}
_FLOAT_TYPES = frozenset((float,))
_TUPLE_TYPES = frozenset((tuple,))
_INT_TYPES = frozenset((int,))


def clear_template_cache() -> None:
    _shapes.clear()
    _timing_templates.clear()


_get_trace_id = attrgetter("trace_id")
_get_ids = attrgetter("span_id", "parent_span_id", "start_ns", "end_ns")


def _encode_spans(calls: Sequence[ModuleCall], limits: _Limits | None = None) -> bytes | bytearray:
    """Concatenated ScopeSpans.spans entries for ``calls``, in order, within ``limits`` (default: from env)."""
    if limits is None:
        limits = _Limits()
    if isinstance(calls, (Calls, CallBatch)):
        groups = _runs(calls.segments if isinstance(calls, Calls) else [calls])
        if len(groups) == 1:  # as it is: the request's join is then the encoding's only copy
            return _encode_segments(groups[0], limits)
        return b"".join(_encode_segments(group, limits) for group in groups)
    return _encode_call_list(calls, limits)


def _runs(segments: Sequence[Sequence[ModuleCall]]) -> list[list]:
    """Consecutive segments grouped: runs of columns, and single other segments, in order."""
    runs: list[list] = []
    columns_run = False
    for segment in segments:
        columns = _from_columns(segment)
        if columns and columns_run:
            runs[-1].append(segment)
        else:
            runs.append([segment])
        columns_run = columns
    return runs


def _encode_segments(group: list, limits: _Limits) -> bytes | bytearray:
    if _from_columns(group[0]):
        encoded = _encode_columns(group, limits)
        if encoded is not None:
            return encoded
    return _encode_call_list([call for segment in group for call in segment], limits)


def _encode_call_list(calls: Sequence[ModuleCall], limits: _Limits) -> bytes:
    max_attributes = limits.attributes if limits.attributes is not None else 1 << 62
    check_lengths = limits.value_length is not None
    rows: list[bytes] = []
    fast: list[ModuleCall] = []  # calls encoded from a template, and for each:
    starts: list[int] = []  # its row's offset in the output
    temps: list[_Template] = []
    floats: list[tuple] = []
    dims: list[tuple] = []
    pos = 0
    ts_memo: dict[int, str] = {}
    shapes = _shapes
    for c in calls:
        ts = c.trace_state
        if ts is not None:
            ts = ts_memo.get(id(ts))
            if ts is None:
                ts = ts_memo[id(c.trace_state)] = _trace_state_str(c.trace_state)
        if (
            c.error is not None
            or len(c.attributes) > max_attributes
            or (check_lengths and _over_limits(c.attributes, limits))
        ):
            row = _encode_span_row(c, ts, limits)
        else:
            attrs = c.attributes
            vals = tuple(attrs.values())
            name = c.name
            key = (name, c.parent_span_id != 0, c.parent_is_remote, ts, tuple(attrs))
            shape = cached_shape(shapes, key, vals)
            try:
                vkey = shape.variant(vals)
            except (ValueError, TypeError):  # a type marshal does not know, or a shape with no length: slow path
                row = _encode_span_row(c, ts, limits)
            else:
                t = shape.variants.get(vkey)
                if t is None:
                    if len(shape.variants) >= _MAX_VARIANTS:
                        shape.variants.clear()
                    t = shape.variants[vkey] = _build(c, name, ts, shape.float_positions, None, shape.dims_positions)
                row = t.row
                fast.append(c)
                starts.append(pos)
                temps.append(t)
                floats.append(shape.floats(vals))
                dims.append(shape.dims(vals))
        rows.append(row)
        pos += len(row)

    if fast and not _slots_fit(floats, dims):
        # a non-float where the template has a double slot (rare): encode this batch span by span
        return b"".join(
            _encode_span_row(c, _trace_state_str(c.trace_state) if c.trace_state else None, limits) for c in calls
        )
    out = bytearray(b"".join(rows))
    if len(fast) > _FEW_SPANS:
        _fill(np.frombuffer(out, dtype=np.uint8), fast, starts, temps, floats, dims)
    elif fast:
        _fill_few(out, fast, starts, temps, floats, dims)
    return bytes(out)


def _slots_fit(floats: list[tuple], dims: list[tuple]) -> bool:
    """Whether every double slot got a float and every dimension slot an int tuple that 5 varint bytes hold (a
    value that changed type is rare: the batch is then encoded span by span)."""
    if not _FLOAT_TYPES.issuperset(map(type, chain.from_iterable(floats))):
        return False
    arrays = list(chain.from_iterable(dims))
    if not arrays:
        return True
    if not (_TUPLE_TYPES.issuperset(map(type, arrays)) and all(arrays)):  # non-empty tuples
        return False
    flat = list(chain.from_iterable(arrays))
    return _INT_TYPES.issuperset(map(type, flat)) and min(flat) >= 0 and max(flat) < _DIM_LIMIT


def _fill(
    buf: np.ndarray, calls: list[ModuleCall], starts: list[int], temps: list[_Template], floats: list, dims: list
) -> None:
    """Write ids, timestamps and doubles of all template-encoded spans into ``buf`` at once."""
    n = len(calls)
    trace_ids = list(map(_get_trace_id, calls))
    if trace_ids.count(trace_ids[0]) == n:  # usually one per batch (one forward): a single broadcast write
        tid_bytes = np.frombuffer(trace_ids[0].to_bytes(16, "big"), dtype=np.uint8)
    else:
        tid_bytes = np.frombuffer(b"".join(t.to_bytes(16, "big") for t in trace_ids), np.uint8).reshape(n, 16)
    nums = np.fromiter(chain.from_iterable(map(_get_ids, calls)), dtype=np.uint64, count=4 * n).reshape(n, 4)
    _fill_slots(buf, np.asarray(starts, dtype=np.intp), temps, tid_bytes, nums, floats, dims)


# Up to this many template-encoded spans (a training step's own: its root, phases and all-reduce buckets) are
# written slot by slot in Python: numpy's ~15 array operations per batch cost ~20 us whatever its size.
_FEW_SPANS = 8


def _fill_few(
    out: bytearray, calls: list[ModuleCall], starts: list[int], temps: list[_Template], floats: list, dims: list
) -> None:
    """``_fill`` for a handful of spans: the same slots written in place (the checks of ``_slots_fit`` done)."""
    for call, base, template, values, shapes in zip(calls, starts, temps, floats, dims):
        _write_ids_and_times(out, base, template, call)
        if template.n_doubles:
            for offset, value in zip(template.doubles.tolist(), values):
                _PACK_D_INTO(out, base + offset, value)
        if template.n_dims:
            for offset, dim in zip(template.dims.tolist(), chain.from_iterable(shapes)):
                at = base + offset  # a 5-byte varint: 7 bits a byte, the continuation bit on all but the last
                out[at : at + 5] = bytes(
                    (dim >> 0 & 0x7F | 0x80, dim >> 7 & 0x7F | 0x80, dim >> 14 & 0x7F | 0x80, dim >> 21 & 0x7F | 0x80,
                     dim >> 28 & 0x7F)
                )  # fmt: skip


def _fill_slots(
    buf: np.ndarray,
    base: np.ndarray,
    temps: list[_Template],
    tid_bytes: np.ndarray,
    nums: np.ndarray,
    floats: list,
    dims: list,
) -> None:
    """Write trace ids (16 bytes, or n x 16), the (span id, parent id, start, end) rows of ``nums``, the doubles
    and the dimensions of every template-encoded span into ``buf`` at the rows' offsets ``base``."""
    n = len(temps)
    tid_off = base + np.fromiter(map(attrgetter("tid"), temps), dtype=np.intp, count=n)
    buf[tid_off[:, None] + _AR16] = tid_bytes

    # span id, parent id (big-endian bytes), start and end (fixed64, little-endian)
    sid_off = base + np.fromiter(map(attrgetter("sid"), temps), dtype=np.intp, count=n)
    buf[sid_off[:, None] + _AR8] = nums[:, 0].astype(">u8").view(np.uint8).reshape(n, 8)
    pid_rel = np.fromiter(map(attrgetter("pid"), temps), dtype=np.intp, count=n)
    has_parent = pid_rel >= 0
    if has_parent.any():
        pid_off = (base + pid_rel)[has_parent]
        pids = nums[has_parent, 1].astype(">u8").view(np.uint8).reshape(-1, 8)
        buf[pid_off[:, None] + _AR8] = pids
    start_off = base + np.fromiter(map(attrgetter("start"), temps), dtype=np.intp, count=n)
    buf[start_off[:, None] + _AR8] = nums[:, 2].astype("<u8").view(np.uint8).reshape(n, 8)
    buf[(start_off + 9)[:, None] + _AR8] = nums[:, 3].astype("<u8").view(np.uint8).reshape(n, 8)

    if floats:  # every float attribute of every span
        counts = np.fromiter(map(attrgetter("n_doubles"), temps), dtype=np.intp, count=n)
        if counts.any():
            _write_doubles(buf, np.concatenate([t.doubles for t in temps]) + np.repeat(base, counts), floats)
    if dims:
        counts = np.fromiter(map(attrgetter("n_dims"), temps), dtype=np.intp, count=n)
        if counts.any():
            _write_dims(buf, np.concatenate([t.dims for t in temps]) + np.repeat(base, counts), dims)


def _write_doubles(buf: np.ndarray, offsets: np.ndarray, floats: list[tuple]) -> None:
    """The floats of ``floats`` (tuples, in slot order) as little-endian doubles at ``offsets``."""
    values = np.fromiter(chain.from_iterable(floats), dtype="<f8", count=len(offsets))
    buf[offsets[:, None] + _AR8] = values.view(np.uint8).reshape(-1, 8)


def _write_dims(buf: np.ndarray, offsets: np.ndarray, dims: list[tuple]) -> None:
    """The dimensions of the shapes in ``dims`` (tuples of shapes, in slot order) as 5-byte varints at ``offsets``:
    7 bits a byte, the continuation bit on all but the last."""
    values = np.fromiter(chain.from_iterable(chain.from_iterable(dims)), dtype=np.uint64, count=len(offsets))
    buf[offsets[:, None] + _AR5] = ((values[:, None] >> _SHIFTS7) & np.uint64(0x7F)).astype(np.uint8) | _CONTINUE


# --- columns: forwards encoded without ModuleCall objects ---------------------------------------------------

_CHILD, _ROOT, _ROOT_UNDER_LOCAL, _ROOT_UNDER_REMOTE = range(4)  # parent kinds


class _TimingTemplates:
    """The templates of calls with only the path and type attributes, for one handle's modules and trace state:
    one per module and parent kind, and one block per whole forward's module sequence (see ``_Block``)."""

    __slots__ = ("modules", "trace_state", "by_kind", "blocks", "json_blocks", "stats_blocks", "json_stats_blocks")

    def __init__(self, modules: Sequence[Any], trace_state: str | None) -> None:
        self.modules = modules
        self.trace_state = trace_state
        self.by_kind: list[list] = [[None] * len(modules) for _ in range(4)]  # parent kind -> by module index
        self.blocks: dict[tuple, _Block] = {}  # (module sequence, root kind) -> block
        self.json_blocks: dict[tuple, Any] = {}  # the same, as OTLP/JSON text (``json_lines``)
        self.stats_blocks: dict[tuple, list[_StatsBlock]] = {}  # forwards with statistics (``_stats_block``)
        self.json_stats_blocks: dict[tuple, list[_StatsBlock]] = {}  # the same, as OTLP/JSON text

    def template(self, index: int, kind: int, limits: _Limits) -> Any:
        """The template of a call of ``modules[index]`` under a parent of ``kind``, made once (False: over the span
        limits, see ``_timing_template``)."""
        templates = self.by_kind[kind]
        template = templates[index]
        if template is None:
            template = templates[index] = _timing_template(self.modules, index, kind, self.trace_state, limits)
        return template


# (id(modules), trace state) -> its templates
_timing_templates: dict[tuple[int, str | None], _TimingTemplates] = {}


def timing_templates_of(modules: Sequence[Any], trace_state: str | None) -> _TimingTemplates:
    key = (id(modules), trace_state)
    cached = _timing_templates.get(key)
    if cached is None or cached.modules is not modules:
        if len(_timing_templates) >= 64:  # handles come and go: stay bounded
            _timing_templates.clear()
        cached = _timing_templates[key] = _TimingTemplates(modules, trace_state)
    return cached


def _timing_template(modules: Sequence[Any], index: int, kind: int, trace_state: str | None, limits: _Limits) -> Any:
    """The template of a call of ``modules[index]`` with only the path and type attributes, made once; False if
    such a call is over the span limits (it takes the general path)."""
    call = timing_call(modules, index, kind, limits)
    return _build(call, call.name, trace_state, frozenset()) if call is not None else False


def timing_call(modules: Sequence[Any], index: int, kind: int, limits: _Limits) -> ModuleCall | None:
    """A stand-in call of ``modules[index]`` with only the path and type attributes under a parent of ``kind``
    (ids and times are slots): what timing templates are made from; None if such a call is over the span limits."""
    info = modules[index]
    attributes = {MODULE_PATH: info.path, MODULE_TYPE: info.type_name}
    if len(attributes) > (limits.attributes if limits.attributes is not None else 1 << 62) or (
        limits.value_length is not None and _over_limits(attributes, limits)
    ):
        return None
    parent_id, remote = (0, False) if kind == _ROOT else (1, kind == _ROOT_UNDER_REMOTE)
    return ModuleCall(info.path, info.type_name, 0, 1, 1, parent_id, 0, 0, attributes, parent_is_remote=remote)


def root_kind(batch: CallBatch) -> int:
    """The parent kind of a forward's root: none, a span of this process, or the caller's remote span."""
    if not batch.root_parent_id:
        return _ROOT
    return _ROOT_UNDER_REMOTE if batch.parent_is_remote else _ROOT_UNDER_LOCAL


def _is_whole_forward(batch: CallBatch) -> bool:
    """A whole forward (not a slice of one) with one root, its first call: what a block encodes."""
    parents = batch.parent
    n = len(parents)
    return bool(n) and not batch.lo and batch.hi == n and parents[0] < 0 and parents.count(-1) == 1


def is_timing_forward(batch: CallBatch) -> bool:
    """A whole forward with only the module path and type on every call (its spans named as its modules)."""
    return batch.kind == "forward" and _is_whole_forward(batch) and not batch.any_call_attributed(len(batch.module))


class _Block:
    """The spans of a whole forward whose calls carry only the module path and type: its calls' templates end to
    end, with every slot's offset in the block. Made once per module sequence (a model's forwards repeat it), so
    a forward is one bytes copy and its ids and times are written with numpy (no Python step per call)."""

    __slots__ = ("row", "tid", "sid", "pid", "has_pid", "start", "doubles", "dims")

    def __init__(self, templates: list[_Template]) -> None:
        at = np.cumsum([0, *(len(t.row) for t in templates[:-1])])
        self.row = b"".join(t.row for t in templates)
        self.tid = at + [t.tid for t in templates]
        self.sid = at + [t.sid for t in templates]
        self.has_pid = np.array([t.pid >= 0 for t in templates])
        self.pid = (at + [t.pid for t in templates])[self.has_pid]
        self.start = at + [t.start for t in templates]
        self.doubles = np.concatenate([base + t.doubles for base, t in zip(at, templates)])  # in attribute order
        self.dims = np.concatenate([base + t.dims for base, t in zip(at, templates)])


_SCALAR_TYPES = frozenset((str, int, bool, type(None)))  # equal values of one of these types encode identically
_MAX_STATS_BLOCKS = 8  # per module sequence: dtypes or structures that change from forward to forward


class _StatsBlock:
    """A whole forward whose every call has attributes (statistics), encoded once (``payload``: a protobuf
    ``_Block``, or OTLP/JSON text with its slots' order), and what a later forward of the same module sequence must
    match to share it: the same attribute keys in the same order, the same values other than floats and shapes (of
    the same types: True, 1 and 1.0 are equal in Python, not on the wire) and shapes of the same ranks. Compared
    for the whole forward at once, as flat tuples: no Python step per call. ``payload`` None: such a forward does
    not fit a block (values of other types, over the span limits)."""

    __slots__ = ("keys", "payload", "others", "other_values", "other_types", "floats", "dims", "ranks", "float_at",
                 "dims_at", "other_at")  # fmt: skip

    def __init__(self, keys: tuple, payload: Any = None, slots: tuple = ((), (), ()), values: tuple = ()) -> None:
        self.keys = keys
        self.payload = payload
        float_at, dims_at, other_at = slots  # positions in the forward's flat attribute values
        self.floats, self.dims, self.others = _getter(float_at), _getter(dims_at), _getter(other_at)
        self.float_at, self.dims_at, self.other_at = (np.array(at, dtype=np.int64) for at in slots)
        self.other_values = self.others(values)
        self.other_types = tuple(map(type, self.other_values))
        self.ranks = tuple(map(len, self.dims(values)))

    def match(self, keys: tuple, values: tuple) -> bool:
        if keys is not self.keys and keys != self.keys:  # interned: the same object, forward after forward
            return False
        if self.payload is None:
            return True
        if _same_values is not None and type(values) is tuple:  # the same comparisons, in one C loop each
            return _same_values(values, self.other_at, self.other_values, False) and _same_values(
                values, self.dims_at, self.ranks, True
            )
        others = self.others(values)
        if others != self.other_values or tuple(map(type, others)) != self.other_types:
            return False
        try:
            return tuple(map(len, self.dims(values))) == self.ranks
        except TypeError:  # a shape's place holds something without a length
            return False


def shared_stats_block(batch: CallBatch, cache: dict, limits: _Limits, make: Any) -> tuple[_StatsBlock, tuple] | None:
    """(the block that a whole forward whose every call has attributes shares, the forward's flat attribute values),
    or None: the per-call templates then encode it. ``cache``: blocks by module sequence, root kind and limits;
    ``make(keys, values)`` makes a forward's block the first time its kind is seen, up to ``_MAX_STATS_BLOCKS`` kinds
    per sequence (values that keep changing, such as shapes written as text, take the per-call path after that)."""
    if not batch.every_call_attributed() or not _is_whole_forward(batch):
        return None
    _, keys, values = batch.flat_attributes()  # made once for the records and every encoder
    cache_key = (tuple(batch.module), batch.kind, root_kind(batch), limits.attributes, limits.value_length)
    candidates = cache.get(cache_key)
    for candidate in candidates or ():
        if candidate.match(keys, values):
            return (candidate, values) if candidate.payload is not None else None
    if candidates is None:
        if len(cache) >= _MAX_VARIANTS:
            cache.clear()
        candidates = cache[cache_key] = []
    if len(candidates) >= _MAX_STATS_BLOCKS:
        return None
    made = make(keys, values)
    candidates.append(made)
    return (made, values) if made.payload is not None else None


def _stats_block(batch: CallBatch, trace_state: str | None, timing: _TimingTemplates, limits: _Limits):
    """(the encoded block, its ``_StatsBlock``, the forward's flat values) for a whole forward whose every call has
    attributes, or None. Its floats and shapes are checked as they are written (``_write_block_values``)."""
    found = shared_stats_block(
        batch, timing.stats_blocks, limits, partial(_make_stats_block, batch, trace_state=trace_state, limits=limits)
    )
    if found is None:
        return None
    block, values = found
    return block.payload, block, values


def _make_stats_block(batch: CallBatch, keys: tuple, values: tuple, *, trace_state: str | None, limits: _Limits):
    """The block of a forward with statistics: its calls' templates, those of the per-call path (float values and
    shapes in slots); a refusal (``block`` None) where a call is over the span limits or a value has a type that
    equality cannot key."""
    max_attributes = limits.attributes if limits.attributes is not None else 1 << 62
    templates = []
    float_at: list[int] = []
    dims_at: list[int] = []
    other_at: list[int] = []
    at = 0
    for position, attrs in enumerate(batch.attributes):
        if len(attrs) > max_attributes or (limits.value_length is not None and _over_limits(attrs, limits)):
            return _StatsBlock(keys)
        found = _call_template(batch, position, attrs, trace_state)
        if found is None:
            return _StatsBlock(keys)
        template, shape, vals = found
        if not value_slots(vals, shape.float_positions, shape.dims_positions, at, (float_at, dims_at, other_at)):
            return _StatsBlock(keys)
        templates.append(template)
        at += len(vals)
    return _StatsBlock(keys, _Block(templates), (float_at, dims_at, other_at), values)


def value_slots(
    vals: tuple, float_positions: Any, dims_positions: Any, at: int, slots: tuple[list, list, list]
) -> bool:
    """Adds the positions (offset by ``at`` in the forward's flat values) of one call's attribute values to
    ``slots``: (floats, shapes, others). False where an other value has a type equality cannot key (a block then
    refuses the forward)."""
    float_at, dims_at, other_at = slots
    for i, value in enumerate(vals):
        if i in float_positions:
            float_at.append(at + i)
        elif i in dims_positions:
            dims_at.append(at + i)
        elif type(value) in _SCALAR_TYPES or (type(value) is tuple and not value):  # (): a scalar's shape
            other_at.append(at + i)
        else:
            return False
    return True


def _timing_block(batch: CallBatch, root: int, timing: _TimingTemplates, limits: _Limits) -> Any:
    """The block of a whole forward with only path / type attributes and one root (its first call), or None (the
    per-call path then encodes it)."""
    if not is_timing_forward(batch):
        return None
    blocks = timing.blocks
    key = (tuple(batch.module), root)
    block = blocks.get(key)
    if block is None:
        templates = [timing.template(index, _CHILD if position else root, limits) for position, index in
                     enumerate(key[0])]  # fmt: skip
        if not all(templates):  # over the span limits
            return None
        if len(blocks) >= _MAX_VARIANTS:  # ever-new call sequences (control flow that varies): stay bounded
            blocks.clear()
        block = blocks[key] = _Block(templates)
    return block


def _fill_blocks(buf: np.ndarray, row_offsets: np.ndarray, blocks: list[tuple]) -> bool:
    """Write the trace ids, span ids, parent ids and times of every block-encoded forward into ``buf``, and the
    floats and shapes of those with statistics; ``blocks``: (position in rows, block, forward, its ``_StatsBlock``
    or None, its flat values). False: a float or shape slot would get a value of another type (``buf`` is then
    not a valid encoding)."""
    batches = [batch for _, _, batch, _, _ in blocks]
    placed = [(int(row_offsets[row]), block) for row, block, _, _, _ in blocks]
    if not (_put_span_fields is not None and all(
        _put_span_fields(buf, base, batch.trace_id.to_bytes(16, "big"), block.tid, block.sid, block.pid,
                         block.has_pid, block.start, batch.span_id, batch.parent, batch.root_parent_id,
                         batch.start_ns, batch.end_ns)
        for (base, block), batch in zip(placed, batches)
    )):  # fmt: skip
        _write_span_fields(buf, placed, batches)
    with_values = [(base, block, kind, values) for (base, block), (_, _, _, kind, values) in zip(placed, blocks)
                   if kind is not None]  # fmt: skip
    return _write_block_values(buf, with_values) if with_values else True


def _write_span_fields(buf: np.ndarray, placed: list[tuple[int, _Block]], batches: list[CallBatch]) -> None:
    """The trace ids, span ids, parent ids and times of block-encoded forwards, all at once with numpy (without the
    compiled module, or where its writer refused a forward's columns); ``placed``: (offset in ``buf``, block)."""
    counts = [len(batch.span_id) for batch in batches]
    total = sum(counts)

    def offsets(slot: str) -> np.ndarray:
        return np.concatenate([base + getattr(block, slot) for base, block in placed])

    def column(name: str, dtype: Any) -> np.ndarray:
        return np.fromiter(chain.from_iterable(getattr(batch, name) for batch in batches), dtype=dtype, count=total)

    tids = np.frombuffer(b"".join(batch.trace_id.to_bytes(16, "big") for batch in batches), np.uint8).reshape(-1, 16)
    buf[offsets("tid")[:, None] + _AR16] = np.repeat(tids, counts, axis=0)
    ids = column("span_id", np.uint64)
    buf[offsets("sid")[:, None] + _AR8] = ids.astype(">u8").view(np.uint8).reshape(total, 8)
    # a parent's id by its position in its forward; each forward's root (its one call without a parent): the
    # caller's span id, written only where the root's template has a parent slot
    parents = column("parent", np.intp)
    parent_ids = ids[np.maximum(parents, 0) + np.repeat(np.cumsum([0, *counts[:-1]]), counts)]
    parent_ids[parents < 0] = np.array([batch.root_parent_id for batch in batches], dtype=np.uint64)
    has_pid = np.concatenate([block.has_pid for _, block in placed])
    buf[offsets("pid")[:, None] + _AR8] = parent_ids[has_pid].astype(">u8").view(np.uint8).reshape(-1, 8)
    start_off = offsets("start")
    for name, shift in (("start_ns", 0), ("end_ns", 9)):  # Span.start_time_unix_nano, end (fixed64 fields)
        times = column(name, np.uint64).astype("<u8").view(np.uint8).reshape(total, 8)
        buf[(start_off + shift)[:, None] + _AR8] = times


def _write_block_values(buf: np.ndarray, blocks: list[tuple]) -> bool:
    """The floats and shapes of forwards encoded as blocks with statistics, each checked (``_slots_fit``);
    ``blocks``: (offset in ``buf``, encoded block, ``_StatsBlock``, flat values). The compiled writers check and
    write a forward's values in one C loop each, straight from its flat values; numpy writes all forwards at once."""
    if _put_values is not None:
        return all(
            _put_values(buf, base, block.doubles, values, kind.float_at, False)
            and _put_values(buf, base, block.dims, values, kind.dims_at, True)
            for base, block, kind, values in blocks
        )
    floats = [kind.floats(values) for _, _, kind, values in blocks]
    dims = [kind.dims(values) for _, _, kind, values in blocks]
    if not _slots_fit(floats, dims):
        return False
    doubles = np.concatenate([base + block.doubles for base, block, _, _ in blocks])
    if len(doubles):
        _write_doubles(buf, doubles, floats)
    dim_offsets = np.concatenate([base + block.dims for base, block, _, _ in blocks])
    if len(dim_offsets):
        _write_dims(buf, dim_offsets, dims)
    return True


def _from_columns(batch: Sequence[ModuleCall]) -> bool:
    """A forward's columns with no error among its calls (an exception event takes the general path)."""
    if not isinstance(batch, CallBatch) or batch.made:
        return False
    lo, hi = batch.lo, batch.hi
    return not any(extras[0] is not None for position, extras in batch.sparse.items() if lo <= position < hi)


def _call_template(batch: CallBatch, position: int, attrs: dict, trace_state: str | None) -> tuple | None:
    """(template, its ``_Shape``, the call's attribute values) of call ``position`` of a forward's columns, whose
    attributes are ``attrs`` (within the span limits): cached per name, parent kind, trace state and attribute keys,
    then per non-float values. None: values marshal cannot key (the call is then encoded alone)."""
    vals = tuple(attrs.values())
    info = batch.modules[batch.module[position]]
    name = (info.path or info.type_name) if batch.kind == "forward" else batch.span_name(position)
    parent = batch.parent[position]
    key = (name, parent >= 0 or batch.root_parent_id != 0, parent < 0 and batch.parent_is_remote, trace_state,
           tuple(attrs))  # fmt: skip
    shape = cached_shape(_shapes, key, vals)
    try:
        vkey = shape.variant(vals)
    except (ValueError, TypeError):
        return None
    template = shape.variants.get(vkey)
    if template is None:
        if len(shape.variants) >= _MAX_VARIANTS:
            shape.variants.clear()
        template = shape.variants[vkey] = _build(
            batch._make(position), name, trace_state, shape.float_positions, None, shape.dims_positions
        )
    return template, shape, vals


def _encode_columns(batches: list[CallBatch], limits: _Limits) -> bytearray | None:
    """The spans of forwards straight from their columns, all of them at once: a call with only the module path
    and type takes its module's template; one with statistics the template of its attribute keys and non-float
    values (as ``_encode_call_list``); ids, times and doubles are written with numpy. None: a double slot would
    get a non-float (the general path then encodes span by span)."""
    max_attributes = limits.attributes if limits.attributes is not None else 1 << 62
    check_lengths = limits.value_length is not None
    rows: list[bytes] = []
    temps: list[_Template] = []
    templated: list[int] = []  # positions in rows of the spans with a template (the others are complete rows)
    floats: list[tuple] = []
    dims: list[tuple] = []
    span_ids: list[int] = []
    parent_ids: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    trace_ids: list[int] = []
    blocks: list[tuple] = []  # (position in rows, block, forward, its _StatsBlock or None, its flat values)
    for batch in batches:
        trace_state = _trace_state_str(batch.trace_state) if batch.trace_state is not None else None
        timing = timing_templates_of(batch.modules, trace_state)
        root = root_kind(batch)
        block = _timing_block(batch, root, timing, limits)
        if block is not None:
            blocks.append((len(rows), block, batch, None, ()))
            rows.append(block.row)
            continue
        stats = _stats_block(batch, trace_state, timing, limits)
        if stats is not None:
            block, kind, values = stats
            blocks.append((len(rows), block, batch, kind, values))
            rows.append(block.row)
            continue
        ids, trace_id, root_parent = batch.span_id, batch.trace_id, batch.root_parent_id
        for position, index, _, parent, attrs, start, end in batch.rows():
            template = None
            shape_dims: tuple = ()
            if attrs is None:
                template = timing.template(index, _CHILD if parent >= 0 else root, limits)
                values: tuple = ()
            elif not (len(attrs) > max_attributes or (check_lengths and _over_limits(attrs, limits))):
                found = _call_template(batch, position, attrs, trace_state)
                if found is not None:
                    template, shape, vals = found
                    values = shape.floats(vals)
                    shape_dims = shape.dims(vals)
            if not template:  # over the span limits, or values marshal cannot key: this span alone, complete
                rows.append(_encode_span_row(batch._make(position), trace_state, limits))
                continue
            templated.append(len(rows))
            rows.append(template.row)
            temps.append(template)
            floats.append(values)
            dims.append(shape_dims)
            span_ids.append(ids[position])
            parent_ids.append(ids[parent] if parent >= 0 else root_parent)
            starts.append(start)
            ends.append(end)
            trace_ids.append(trace_id)
    if not _slots_fit(floats, dims):
        return None
    out = bytearray().join(rows)  # written in place, returned as it is: the request joins it (no extra copies)
    if not (temps or blocks):
        return out
    offsets = np.zeros(len(rows), dtype=np.intp)
    np.cumsum(np.fromiter(map(len, rows[:-1]), dtype=np.intp, count=len(rows) - 1), out=offsets[1:])
    if blocks and not _fill_blocks(np.frombuffer(out, dtype=np.uint8), offsets, blocks):
        return None
    if temps:
        n = len(temps)
        nums = np.array([span_ids, parent_ids, starts, ends], dtype=np.uint64).T
        if trace_ids.count(trace_ids[0]) == n:
            tid_bytes = np.frombuffer(trace_ids[0].to_bytes(16, "big"), dtype=np.uint8)
        else:
            tid_bytes = np.frombuffer(b"".join(t.to_bytes(16, "big") for t in trace_ids), np.uint8).reshape(n, 16)
        base = offsets if n == len(rows) else offsets[np.asarray(templated, dtype=np.intp)]
        _fill_slots(np.frombuffer(out, dtype=np.uint8), base, temps, tid_bytes, nums, floats, dims)
    return out


# --- request ------------------------------------------------------------------------------------------------

_resource_cache: tuple[Resource | None, bytes] = (None, b"")


def _resource_field(resource: Resource) -> bytes:
    """ResourceSpans.resource, encoded once per Resource object."""
    global _resource_cache
    cached, encoded = _resource_cache
    if cached is not resource:
        encoded = _ld(b"\x0a", _attributes(b"\x0a", resource.attributes))
        _resource_cache = (resource, encoded)
    return encoded


def encode_export_request(
    calls: Sequence[ModuleCall], resource: Resource, scope_name: str, scope_version: str
) -> bytes:
    """Serialized ``ExportTraceServiceRequest``: one ResourceSpans, one ScopeSpans, one span per call, in order.

    Empty ``calls`` gives ``b""`` (an empty request), as the SDK encoder does for no spans.
    """
    if not calls:
        return b""
    spans = _encode_spans(calls)
    scope = b""
    if scope_name:
        scope += _ld(b"\x0a", scope_name.encode("utf-8"))
    if scope_version:
        scope += _ld(b"\x12", scope_version.encode("utf-8"))
    scope_field = _ld(b"\x0a", scope)
    res = _resource_field(resource)
    schema = _ld(b"\x1a", resource.schema_url.encode("utf-8")) if resource.schema_url else b""
    scope_spans_len = len(scope_field) + len(spans)
    resource_spans_len = len(res) + 1 + len(_varint(scope_spans_len)) + scope_spans_len + len(schema)
    return b"".join(
        (
            b"\x0a" + _varint(resource_spans_len),  # ExportTraceServiceRequest.resource_spans
            res,
            b"\x12" + _varint(scope_spans_len),  # ResourceSpans.scope_spans
            scope_field,
            spans,
            schema,  # ResourceSpans.schema_url (after scope_spans, as field order is free)
        )
    )
