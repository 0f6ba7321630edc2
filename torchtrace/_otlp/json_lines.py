"""OTLP/JSON encoding of ``ModuleCall`` batches: the line the file exporter writes, straight from the calls.

Going through protobuf (``ExportTraceServiceRequest`` -> ``json_format.MessageToDict``) costs ~250 us per span with
statistics, which the embedded default exporter cannot afford. This writes the same JSON (equal once parsed:
tests/test_otlp_json.py checks it against that conversion of ``protobuf``'s bytes): OTLP/JSON's mapping of
protobuf, lowerCamelCase keys, hex trace and span ids, int64 and fixed64 as strings, enums as integers, NaN and
infinities as the strings "NaN", "Infinity", "-Infinity", default values left out, the protobuf path's span limits.

As in ``protobuf``, most of a span's text is fixed per module: a cached ``%``-format template per (name,
parent kind, trace state, attribute keys, non-float values, shapes' ranks) leaves slots for the ids, times, float
statistics and shapes (their cached text), filled by ``_json_text`` in C where it is built. Spans that do not fit
(an error, attributes over the limits, values marshal cannot key) are built as dicts and dumped one by one, the
reference the templates are made from.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import chain, repeat
from operator import is_, itemgetter
from typing import Any

from opentelemetry.sdk.resources import Resource

from torchtrace._core.calls import CallBatch, Calls, ModuleCall, error_text
from torchtrace._otlp.protobuf import (
    _CHILD,
    _FLAG_HAS_IS_REMOTE,
    _FLAG_IS_REMOTE,
    _INT64_MAX,
    _INT64_MIN,
    _MAX_VARIANTS,
    _ROOT,
    _bounded,
    _from_columns,
    _getter,
    _is_dims,
    _Limits,
    _over_limits,
    _Shape,
    _StatsBlock,
    _trace_state_str,
    cached_shape,
    exception_attributes,
    is_timing_forward,
    root_kind,
    shared_stats_block,
    timing_call,
    timing_templates_of,
    value_slots,
)
from torchtrace.attributes import MODULE_PATH, MODULE_TYPE

try:
    from torchtrace._otlp._json_text import percent_format as _percent_format
except ImportError:  # not built (no C compiler at install): Python's % writes the same text
    _percent_format = None

__all__ = ["encode_otlp_json"]

_SPAN_KIND_INTERNAL = 1
_STATUS_ERROR = 2


def _double(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _any_value(value: Any) -> dict | None:
    """AnyValue as the protobuf path encodes it (see ``protobuf._any_value``); None = attribute dropped."""
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value} if value else {"stringValue": ""}
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            return None
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": _double(value)}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Sequence):
        items = [_any_value(item) for item in value]
        if any(item is None for item in items):
            return None
        return {"arrayValue": {"values": items} if items else {}}
    if isinstance(value, Mapping):
        pairs = [_key_value(str(key), item) for key, item in value.items()]
        if any(pair is None for pair in pairs):
            return None
        return {"kvlistValue": {"values": pairs} if pairs else {}}
    if type(value).__str__ is not object.__str__ or type(value).__repr__ is not object.__repr__:
        return _any_value(str(value))
    return {}


def _key_value(key: str, value: Any) -> dict | None:
    body = _any_value(value)
    if body is None:
        return None
    return {"key": key, "value": body} if key else {"value": body}


def _attributes(attributes: Mapping[str, Any]) -> list[dict]:
    return [pair for key, value in attributes.items() if (pair := _key_value(key, value)) is not None]


def _exception_event(call: ModuleCall, limits: _Limits) -> dict[str, Any]:
    event_attributes, event_dropped = exception_attributes(call.error, limits)
    event: dict[str, Any] = {"timeUnixNano": str(call.end_ns), "name": "exception"}
    if event_attributes:
        event["attributes"] = _attributes(event_attributes)
    if event_dropped:
        event["droppedAttributesCount"] = event_dropped
    return event


def _span(call: ModuleCall, trace_state: str | None, limits: _Limits) -> dict:
    span: dict[str, Any] = {"traceId": f"{call.trace_id:032x}", "spanId": f"{call.span_id:016x}"}
    if trace_state:
        span["traceState"] = trace_state
    if call.parent_span_id:
        span["parentSpanId"] = f"{call.parent_span_id:016x}"
    span["name"] = call.name
    span["kind"] = _SPAN_KIND_INTERNAL
    span["startTimeUnixNano"] = str(call.start_ns)
    span["endTimeUnixNano"] = str(call.end_ns)
    attributes, dropped = call.attributes, 0
    if _over_limits(attributes, limits):
        attributes, dropped = _bounded(attributes, limits.attributes, limits.value_length)
    pairs = _attributes(attributes)
    if pairs:
        span["attributes"] = pairs
    if dropped:
        span["droppedAttributesCount"] = dropped
    if call.error is not None:
        if limits.events == 0:  # OTEL_SPAN_EVENT_COUNT_LIMIT=0
            span["droppedEventsCount"] = 1
        else:
            span["events"] = [_exception_event(call, limits)]
        span["status"] = {"message": error_text(call.error), "code": _STATUS_ERROR}
    else:
        span["status"] = {}
    remote = call.parent_span_id and call.parent_is_remote
    span["flags"] = _FLAG_HAS_IS_REMOTE | (_FLAG_IS_REMOTE if remote else 0)
    return span


_resource_cache: tuple[Resource | None, dict] = (None, {})


def _resource(resource: Resource) -> dict:
    global _resource_cache
    cached, encoded = _resource_cache
    if cached is not resource:
        pairs = _attributes(resource.attributes)
        encoded = {"attributes": pairs} if pairs else {}
        _resource_cache = (resource, encoded)
    return encoded


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _filled(template: str, values: tuple) -> str:
    """``template % values``: in C where built (a float's repr there is Ryu's shortest digits, several times faster than
    CPython's; the same text), Python's ``%`` for what the C writer does not take."""
    if _percent_format is not None:
        text = _percent_format(template, values)
        if text is not None:
            return text
    return template % values


class _Template:
    """A span's JSON text as a ``%`` format: slots for ids, times, then the attribute values that are slots (floats,
    and shapes as their text: ``_shape_text``), in attribute order (``slots`` picks them from the values; ``dims_at``:
    which of those are shapes)."""

    __slots__ = ("text", "has_parent", "slots", "dims_at")

    def __init__(
        self,
        call: ModuleCall,
        trace_state: str | None,
        float_positions: frozenset[int],
        dims_positions: frozenset[int] = frozenset(),
    ) -> None:
        pieces: list[str] = []  # static text (its "%" escaped) and the conversions that take the values

        def static(text: str) -> None:
            pieces.append(text.replace("%", "%%"))

        static('{"traceId":"')
        pieces.append('%032x","spanId":"%016x"')
        if trace_state:
            static(',"traceState":' + _dumps(trace_state))
        self.has_parent = bool(call.parent_span_id)
        if self.has_parent:
            pieces.append(',"parentSpanId":"%016x"')
        static(f',"name":{_dumps(call.name)},"kind":{_SPAN_KIND_INTERNAL}')
        pieces.append(',"startTimeUnixNano":"%d","endTimeUnixNano":"%d"')
        attributes = []
        for position, (key, value) in enumerate(call.attributes.items()):
            prefix = '{"key":' + _dumps(key) + "," if key else "{"  # an empty key is a default: left out
            if position in float_positions:
                # a slot: repr is the shortest text that reads back to the same double, as json.dumps writes it
                attributes.append((prefix + '"value":{"doubleValue":').replace("%", "%%") + "%r}}")
            elif position in dims_positions:  # a slot: the shape's text, so that a new shape needs no new template
                attributes.append((prefix + '"value":').replace("%", "%%") + "%s}")
            elif (pair := _key_value(key, value)) is not None:
                attributes.append(_dumps(pair).replace("%", "%%"))
        if attributes:
            pieces.append(',"attributes":[' + ",".join(attributes) + "]")
        remote = call.parent_span_id and call.parent_is_remote
        static(',"status":{},"flags":' + str(_FLAG_HAS_IS_REMOTE | (_FLAG_IS_REMOTE if remote else 0)) + "}")
        self.text = "".join(pieces)
        slot_positions = sorted(float_positions | dims_positions)
        self.slots = _getter(slot_positions)
        self.dims_at = tuple(at for at, position in enumerate(slot_positions) if position in dims_positions)


_shape_texts: dict[tuple, str] = {}  # a shape -> its AnyValue as OTLP/JSON text
_shape_objects: dict[int, tuple[tuple, str]] = {}  # id(shape) -> (the shape, kept alive, its text)


def _shape_text(value: Any) -> str | None:
    """A shape's AnyValue as OTLP/JSON text (``_any_value`` of a tuple of ints, dumped), cached; None where
    ``value`` is no such shape (not a non-empty tuple of plain ints within int64: the span is then built as a dict,
    where such a value is written as it is, or dropped). A forward's calls share their kinds' shape objects, forward
    after forward: those are found by identity."""
    found = _shape_objects.get(id(value))
    if found is not None and found[0] is value:
        return found[1]
    if not _is_dims(value):
        return None  # checked before the cache: (1, 2) and (1.0, 2) or (True, 2) are equal keys
    text = _shape_texts.get(value)
    if text is None:
        if not all(_INT64_MIN <= item <= _INT64_MAX for item in value):
            return None
        if len(_shape_texts) >= 4096:  # ever-new shapes: stay bounded
            _shape_texts.clear()
        text = _shape_texts[value] = _dumps(_any_value(value))
    if len(_shape_objects) >= 4096:
        _shape_objects.clear()
    _shape_objects[id(value)] = (value, text)
    return text


# id(stats block) -> (the block, the shape objects of the last forward written with it, their texts)
_block_shapes: dict[int, tuple[_StatsBlock, tuple, tuple]] = {}


def _slot_values(template: _Template, values: tuple) -> tuple | None:
    """The values of ``template``'s attribute slots, each shape as its text; None where a shape's place holds no
    shape this time."""
    slots = template.slots(values)
    if not template.dims_at:
        return slots
    filled = list(slots)
    for at in template.dims_at:
        text = filled[at] = _shape_text(filled[at])
        if text is None:
            return None
    return tuple(filled)


_shapes: dict[tuple, _Shape] = {}  # as _otlp_encoding's cache, its variants holding JSON templates
_FLOAT = frozenset((float,))


def _span_text(call: ModuleCall, trace_state: str | None, limits: _Limits, max_attributes: int) -> str:
    if call.error is not None:
        return _dumps(_span(call, trace_state, limits))
    return _templated_text(
        call.name,
        call.attributes,
        call.parent_span_id != 0,
        call.parent_is_remote,
        trace_state,
        (call.trace_id, call.span_id, call.parent_span_id, call.start_ns, call.end_ns),
        lambda: call,
        limits,
        max_attributes,
    )


def _templated_text(
    name: str,
    attributes: Mapping[str, Any],
    has_parent: bool,
    remote: bool,
    trace_state: str | None,
    ids: tuple[int, int, int, int, int],
    make_call: Callable[[], ModuleCall],
    limits: _Limits,
    max_attributes: int,
) -> str:
    """A span without an error from its cached template: ``ids`` are (trace, span, parent span, start, end);
    ``make_call`` gives the call itself where a template is made or a span does not fit one (rare)."""
    if len(attributes) > max_attributes or _over_limits(attributes, limits):
        return _dumps(_span(make_call(), trace_state, limits))
    found = _json_template(name, attributes, has_parent, remote, trace_state, make_call)
    if found is None:  # a type marshal does not know (numpy scalars...): built one by one
        return _dumps(_span(make_call(), trace_state, limits))
    template, shape, values = found
    slots = _slot_values(template, values) if _fits(shape.floats(values)) else None
    if slots is None:
        return _dumps(_span(make_call(), trace_state, limits))
    if template.has_parent:
        return _filled(template.text, ids + slots)
    return _filled(template.text, (ids[0], ids[1], ids[3], ids[4]) + slots)


def _fits(floats: tuple) -> bool:
    """Whether the values for a template's float slots are all finite floats (a float slot holding something else
    this time, or NaN / Inf, written as strings: the span is built as a dict)."""
    return _FLOAT.issuperset(map(type, floats)) and math.isfinite(sum(floats))


def _json_template(
    name: str,
    attributes: Mapping[str, Any],
    has_parent: bool,
    remote: bool,
    trace_state: str | None,
    make_call: Callable[[], ModuleCall],
) -> tuple[_Template, _Shape, tuple] | None:
    """(template, its ``_Shape``, the attribute values) of a span within the span limits, cached per name, parent
    kind, trace state and attribute keys, then per non-float, non-shape values and the shapes' ranks (``_Shape``:
    marshal tells True, 1 and 1.0 apart); None where marshal cannot key the values."""
    values = tuple(attributes.values())
    key = (name, has_parent, remote, trace_state, tuple(attributes))
    shape = cached_shape(_shapes, key, values)
    try:
        variant = shape.variant(values)
    except (ValueError, TypeError):  # a type marshal does not know; a shape's place without a length
        return None
    template = shape.variants.get(variant)
    if template is None:
        if len(shape.variants) >= _MAX_VARIANTS:
            shape.variants.clear()
        template = shape.variants[variant] = _Template(
            make_call(), trace_state, shape.float_positions, shape.dims_positions
        )
    return template, shape, values


def _stats_block_text(batch: CallBatch, limits: _Limits) -> str | None:
    """The spans of a whole forward whose every call has attributes (statistics), from one ``%`` format shared by
    the forwards of its kind (``protobuf.shared_stats_block``: the same keys, non-float values and shapes' ranks):
    its ids, times, floats and shapes' texts picked from one flat tuple by one itemgetter, formatted in one C call.
    None: the per-call templates then write it."""
    if not _from_columns(batch):
        return None
    trace_state = _trace_state_str(batch.trace_state) if batch.trace_state is not None else None
    cache = timing_templates_of(batch.modules, trace_state).json_stats_blocks
    found = shared_stats_block(batch, cache, limits, partial(_make_stats_block, batch, trace_state, limits))
    if found is None:
        return None
    block, values = found
    text, gather = block.payload
    dims = block.dims(values)
    last = _block_shapes.get(id(block))
    if last is not None and last[0] is block and len(last[1]) == len(dims) and all(map(is_, dims, last[1])):
        shapes = last[2]  # the shape objects of the forward before (a kind's, shared forward after forward)
    else:
        shapes = tuple(map(_shape_text, dims))
        if None in shapes:  # a shape's place holds no shape this time
            return None
        if len(_block_shapes) >= _MAX_VARIANTS:
            _block_shapes.clear()
        _block_shapes[id(block)] = (block, dims, shapes)  # both kept alive: the ids stay theirs
    ids = batch.span_id
    parent_ids = map(ids.__getitem__, batch.parent[1:])
    source = (batch.trace_id, *ids, batch.root_parent_id, *parent_ids, *batch.start_ns, *batch.end_ns, *values, *shapes)
    if _percent_format is not None:  # None where a float slot holds NaN, an infinity or no float, as _fits checks
        return _percent_format(text, gather(source))
    if not _fits(block.floats(values)):
        return None
    return text % gather(source)


def _make_stats_block(batch: CallBatch, trace_state: str | None, limits: _Limits, keys: tuple, values: tuple):
    """A forward's block: its calls' templates joined, and where each slot's value is in the flat tuple
    ``_stats_block_text`` builds (trace id; span ids; parent ids, the root's first; starts; ends; attribute values;
    the shapes' texts). A later forward with other shapes of the same ranks shares it."""
    n = len(batch.module)
    max_attributes = limits.attributes if limits.attributes is not None else 1 << 62
    texts: list[str] = []
    order: list[int] = []
    float_at: list[int] = []
    dims_at: list[int] = []
    other_at: list[int] = []
    at = 0
    for position, attrs in enumerate(batch.attributes):
        if len(attrs) > max_attributes or _over_limits(attrs, limits):
            return _StatsBlock(keys)
        parent = batch.parent[position]
        has_parent = parent >= 0 or batch.root_parent_id != 0
        remote = parent < 0 and batch.parent_is_remote
        found = _json_template(batch.span_name(position), attrs, has_parent, remote, trace_state,
                               partial(batch._make, position))  # fmt: skip
        if found is None:
            return _StatsBlock(keys)
        template, shape, vals = found
        floats_before, dims_before = len(float_at), len(dims_at)
        if not value_slots(vals, shape.float_positions, shape.dims_positions, at, (float_at, dims_at, other_at)):
            return _StatsBlock(keys)
        order += [0, 1 + position, 1 + n + position] if template.has_parent else [0, 1 + position]
        order += [1 + 2 * n + position, 1 + 3 * n + position]
        new_floats, new_shapes = iter(float_at[floats_before:]), iter(range(dims_before, len(dims_at)))
        for i in sorted(shape.float_positions | shape.dims_positions):  # the template's slots, in attribute order
            order.append(
                1 + 4 * n + (next(new_floats) if i in shape.float_positions else len(values) + next(new_shapes))
            )
        texts.append(template.text)
        at += len(vals)
    payload = (",".join(texts), itemgetter(*order))
    return _StatsBlock(keys, payload, (float_at, dims_at, other_at), values)


def _block_text(batch: CallBatch, limits: _Limits) -> str | None:
    """The spans of a whole forward with only path / type attributes and no error, from one ``%`` format per module
    sequence (its calls' templates joined, made once): every id and time is written by one C-level formatting, no
    Python step per call. None: not such a forward, or over the span limits (``_column_texts`` then)."""
    if not (is_timing_forward(batch) and _from_columns(batch)):
        return None
    trace_state = _trace_state_str(batch.trace_state) if batch.trace_state is not None else None
    root = root_kind(batch)
    blocks = timing_templates_of(batch.modules, trace_state).json_blocks
    key = (tuple(batch.module), root)
    block = blocks.get(key)
    if block is None:
        calls = [timing_call(batch.modules, index, _CHILD if position else root, limits) for position, index in
                 enumerate(key[0])]  # fmt: skip
        if None in calls:
            return None
        if len(blocks) >= _MAX_VARIANTS:  # ever-new call sequences: stay bounded
            blocks.clear()
        block = blocks[key] = ",".join(_Template(call, trace_state, frozenset()).text for call in calls)
    ids, starts, ends, trace_id = batch.span_id, batch.start_ns, batch.end_ns, batch.trace_id
    if root == _ROOT:  # the root's slots: trace id, span id, [parent id,] start, end
        head: tuple = (trace_id, ids[0], starts[0], ends[0])
    else:
        head = (trace_id, ids[0], batch.root_parent_id, starts[0], ends[0])
    parent_ids = map(ids.__getitem__, batch.parent[1:])
    return _filled(
        block, (*head, *chain.from_iterable(zip(repeat(trace_id), ids[1:], parent_ids, starts[1:], ends[1:])))
    )


def _column_texts(batch: CallBatch, limits: _Limits, max_attributes: int) -> list[str]:
    """The spans of a forward's columns, without a ModuleCall per span (made only for the rare span that needs
    one: an error, a new template)."""
    modules, ids, trace_id = batch.modules, batch.span_id, batch.trace_id
    root_parent, remote_root = batch.root_parent_id, batch.parent_is_remote
    trace_state = _trace_state_str(batch.trace_state) if batch.trace_state is not None else None
    sparse = batch.sparse
    texts = []
    for position, index, _, parent, attributes, start, end in batch.rows():
        extras = sparse.get(position)
        if extras is not None and extras[0] is not None:  # an error: the reference path
            texts.append(_dumps(_span(batch._make(position), trace_state, limits)))
            continue
        info = modules[index]
        if attributes is None:
            attributes = {MODULE_PATH: info.path, MODULE_TYPE: info.type_name}
        texts.append(
            _templated_text(
                batch.span_name(position),
                attributes,
                parent >= 0 or root_parent != 0,
                parent < 0 and remote_root,
                trace_state,
                (trace_id, ids[position], ids[parent] if parent >= 0 else root_parent, start, end),
                partial(batch._make, position),
                limits,
                max_attributes,
            )
        )
    return texts


def encode_otlp_json(calls: Sequence[ModuleCall], resource: Resource, scope_name: str, scope_version: str) -> str:
    """One ``ExportTraceServiceRequest`` in OTLP/JSON, one line: one ResourceSpans, one ScopeSpans, in order."""
    if not calls:
        return "{}"
    limits = _Limits()
    max_attributes = limits.attributes if limits.attributes is not None else 1 << 62
    trace_states: dict[int, str] = {}
    spans = []
    for segment in calls.segments if isinstance(calls, Calls) else [calls]:
        if isinstance(segment, CallBatch) and not segment.made:
            block = _block_text(segment, limits) or _stats_block_text(segment, limits)
            if block is not None:
                spans.append(block)
            else:
                spans += _column_texts(segment, limits, max_attributes)
            continue
        for call in segment:
            trace_state = None
            if call.trace_state is not None:
                trace_state = trace_states.get(id(call.trace_state))
                if trace_state is None:
                    trace_state = trace_states[id(call.trace_state)] = _trace_state_str(call.trace_state)
            spans.append(_span_text(call, trace_state, limits, max_attributes))
    scope: dict[str, str] = {}
    if scope_name:
        scope["name"] = scope_name
    if scope_version:
        scope["version"] = scope_version
    head = '{"resourceSpans":[{"resource":' + _dumps(_resource(resource))
    head += ',"scopeSpans":[{"scope":' + _dumps(scope) + ',"spans":['
    tail = "]}]"
    if resource.schema_url:
        tail += ',"schemaUrl":' + _dumps(resource.schema_url)
    parts = [head]
    for text in spans:
        parts += (text, ",")
    if spans:
        parts.pop()  # no comma after the last span
    parts += (tail, "}]}")
    return "".join(parts)  # one copy of the spans' text (a forward's block is one of them), not one per join
