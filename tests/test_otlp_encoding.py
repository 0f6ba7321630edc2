"""torchtrace's OTLP encoder writes ExportTraceServiceRequest bytes directly from ModuleCall records.

These tests decode its output with opentelemetry-proto, check every field by hand, and check that it equals what
the OpenTelemetry SDK's own OTLP encoder (``encode_spans``) produces for the same spans.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags, Status
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState, set_span_in_context
from opentelemetry.trace.status import Status as SdkStatus
from opentelemetry.trace.status import StatusCode

from torchtrace._capture.recorder import ModuleInfo
from torchtrace._core.calls import CallBatch, Calls, ModuleCall
from torchtrace._otlp.protobuf import clear_template_cache, encode_export_request

TRACE_ID = 0x0123456789ABCDEF0123456789ABCDEF
T0 = 1_700_000_000_000_000_000
RESOURCE = Resource({"service.name": "test-svc", "host.rank": 3, "pi": 3.5, "tags": ("a", "b")})
SCOPE = ("torchtrace", "9.9.9")


def make_error() -> ValueError:
    try:
        raise ValueError("shape mismatch")
    except ValueError as e:
        return e


def call(
    path: str, span_id: int, parent: int, start: int, end: int, attributes: dict | None = None, **kw: Any
) -> ModuleCall:
    """A ModuleCall of trace TRACE_ID; times are offsets from T0."""
    type_name = kw.pop("type_name", "Net" if not path else "Mod")
    return ModuleCall(path, type_name, path.count(".") + bool(path), TRACE_ID, span_id, parent, T0 + start, T0 + end,
                      attributes or {}, **kw)  # fmt: skip


def sample_calls() -> list[ModuleCall]:
    """A forward of a small model: root, nested children, an error, NaN/inf stats, arrays, a remote parent."""
    stats = {"mean": 0.25, "std": float("nan"), "max": float("inf"), "min": float("-inf"), "zero": -0.0}
    linear = {"shape": [8, 64, 256], "dtype": "torch.float32", **stats, "flag": True, "n": -5, "big": 2**62}
    arrays = {"floats": [1.5, float("nan")], "bools": [True, False], "strs": ["x", ""], "empty": "", "f": False}
    return [
        call("", 0x10, 0, 0, 900, {"dtype": "torch.float32"}),
        call("layers.0.linear1", 0x11, 0x10, 10, 200, linear),
        # same module called again: same template, new ids, times and stats
        call("layers.0.linear1", 0xFFFFFFFFFFFFFFFF, 0x10, 210, 400, linear),
        call("layers.0.relu", 0x12, 0x11, 20, 30, error=make_error()),
        call("layers.0.arrays", 0x13, 0x10, 500, 600, arrays),
    ]


def remote_child() -> ModuleCall:
    """Outermost call under the caller's own OTel span (a remote parent with tracestate)."""
    trace_state = TraceState([("vendor", "v1"), ("other", "o2")])
    return call("", 0x20, 0x99, 0, 5, {"mean": 1.0}, parent_is_remote=True, trace_state=trace_state)


@pytest.fixture(autouse=True, params=["compiled-writers", "numpy-writers"])
def block_writers(request, monkeypatch):
    """Every test runs with a forward matched to its block and the block's ids, times, floats and shapes written by
    ``torchtrace._native`` (same_values, put_span_fields, put_values), and by Python and
    numpy (an install without a C compiler): the bytes must not differ."""
    from torchtrace._otlp import protobuf as _otlp_encoding

    if request.param == "compiled-writers" and _otlp_encoding._put_values is None:
        pytest.skip("torchtrace._native is not built here")
    if request.param == "numpy-writers":
        monkeypatch.setattr(_otlp_encoding, "_put_values", None)
        monkeypatch.setattr(_otlp_encoding, "_put_span_fields", None)
        monkeypatch.setattr(_otlp_encoding, "_same_values", None)
    return request.param


def decode(payload: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString(payload)
    return request


def attrs(kvs) -> dict:
    """KeyValue list -> dict of python values (arrays as lists)."""

    def value(v):
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind) if kind else None

    return {kv.key: value(kv.value) for kv in kvs}


def test_every_field_of_a_span_decodes_as_written():
    calls = sample_calls()
    request = decode(encode_export_request(calls, RESOURCE, *SCOPE))

    assert len(request.resource_spans) == 1
    rs = request.resource_spans[0]
    assert attrs(rs.resource.attributes) == {"service.name": "test-svc", "host.rank": 3, "pi": 3.5, "tags": ["a", "b"]}
    assert len(rs.scope_spans) == 1
    assert (rs.scope_spans[0].scope.name, rs.scope_spans[0].scope.version) == SCOPE
    spans = rs.scope_spans[0].spans
    names = ["Net", "layers.0.linear1", "layers.0.linear1", "layers.0.relu", "layers.0.arrays"]
    assert [s.name for s in spans] == names

    root, lin, lin2, relu, arrays = spans
    assert root.trace_id == TRACE_ID.to_bytes(16, "big")
    assert root.span_id == (0x10).to_bytes(8, "big")
    assert root.parent_span_id == b""  # no parent: field absent
    assert root.kind == Span.SPAN_KIND_INTERNAL
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (T0, T0 + 900)
    assert root.flags == SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
    assert root.status.code == Status.STATUS_CODE_UNSET and root.HasField("status")
    assert root.trace_state == "" and not root.events

    assert lin.parent_span_id == (0x10).to_bytes(8, "big")
    assert lin2.span_id == b"\xff" * 8
    assert (lin2.start_time_unix_nano, lin2.end_time_unix_nano) == (T0 + 210, T0 + 400)
    a = attrs(lin.attributes)
    assert list(a) == ["shape", "dtype", "mean", "std", "max", "min", "zero", "flag", "n", "big"]
    assert a["shape"] == [8, 64, 256] and a["dtype"] == "torch.float32"
    assert a["mean"] == 0.25 and math.isnan(a["std"]) and a["max"] == math.inf and a["min"] == -math.inf
    assert a["zero"] == 0.0 and math.copysign(1, a["zero"]) == -1
    assert (a["flag"], a["n"], a["big"]) == (True, -5, 2**62)
    assert lin.attributes[2].value.WhichOneof("value") == "double_value"

    assert relu.status.code == Status.STATUS_CODE_ERROR
    assert relu.status.message == "ValueError: shape mismatch"
    (event,) = relu.events
    assert event.name == "exception" and event.time_unix_nano == T0 + 30
    ev = attrs(event.attributes)
    assert ev["exception.type"] == "ValueError" and ev["exception.message"] == "shape mismatch"
    assert ev["exception.stacktrace"].startswith("Traceback") and "make_error" in ev["exception.stacktrace"]

    assert attrs(arrays.attributes) == {
        "floats": [1.5, pytest.approx(float("nan"), nan_ok=True)],
        "bools": [True, False],
        "strs": ["x", ""],
        "empty": "",
        "f": False,  # oneof member: a default value is still present
    }
    assert arrays.attributes[4].value.WhichOneof("value") == "bool_value"


def test_remote_parent_sets_flags_and_trace_state():
    (span,) = decode(encode_export_request([remote_child()], RESOURCE, *SCOPE)).resource_spans[0].scope_spans[0].spans
    assert span.parent_span_id == (0x99).to_bytes(8, "big")
    assert span.flags == SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
    assert span.trace_state == "vendor=v1,other=o2"


def test_nan_and_inf_keep_their_bits():
    nan = struct.unpack("<d", bytes.fromhex("010000000000f87f"))[0]  # a NaN with a payload
    call = ModuleCall("m", "M", 0, TRACE_ID, 1, 0, T0, T0 + 1, {"a": nan, "b": math.inf, "c": -math.inf})
    (span,) = decode(encode_export_request([call], RESOURCE, *SCOPE)).resource_spans[0].scope_spans[0].spans
    got = [struct.pack("<d", kv.value.double_value) for kv in span.attributes]
    assert got == [struct.pack("<d", v) for v in (nan, math.inf, -math.inf)]


def test_template_cache_never_leaks_values_between_calls():
    """Same module, same keys, different non-float values or types: each span must carry its own values."""
    clear_template_cache()
    values = [[8, 64], [8, 32], (8, 32), 1, True, 1.0, "x", [True, 64], None]
    calls = [ModuleCall("m", "M", 0, TRACE_ID, i + 1, 0, T0 + i, T0 + i + 1, {"v": v}) for i, v in enumerate(values)]
    spans = decode(encode_export_request(calls, RESOURCE, *SCOPE)).resource_spans[0].scope_spans[0].spans
    kinds = [s.attributes[0].value.WhichOneof("value") for s in spans]
    assert kinds == ["array_value"] * 3 + ["int_value", "bool_value", "double_value", "string_value"] + [
        "array_value",
        None,
    ]
    assert [attrs(s.attributes)["v"] for s in spans] == [[8, 64], [8, 32], [8, 32], 1, True, 1.0, "x", [True, 64], None]


def test_empty_batch_is_an_empty_request():
    assert encode_export_request([], RESOURCE, *SCOPE) == b""


# --- equivalence with the SDK ---------------------------------------------------------------------------------


class _GivenIds(IdGenerator):
    """Hands out the ids the ModuleCalls already have, in order."""

    def __init__(self, calls: list[ModuleCall]) -> None:
        self.span_ids = [c.span_id for c in calls]
        self.trace_ids = [c.trace_id for c in calls if not c.parent_span_id]

    def generate_span_id(self) -> int:
        return self.span_ids.pop(0)

    def generate_trace_id(self) -> int:
        return self.trace_ids.pop(0)


def sdk_request(calls: list[ModuleCall]) -> ExportTraceServiceRequest:
    """The same spans made by the SDK after the fact, encoded by opentelemetry-exporter-otlp's encoder."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE, id_generator=_GivenIds(calls))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(*SCOPE)
    for c in calls:
        context = None
        if c.parent_span_id:
            parent = SpanContext(
                c.trace_id,
                c.parent_span_id,
                is_remote=c.parent_is_remote,
                trace_flags=TraceFlags(c.trace_flags),
                trace_state=c.trace_state,
            )
            context = set_span_in_context(NonRecordingSpan(parent))
        span = tracer.start_span(c.name, context=context, attributes=c.attributes, start_time=c.start_ns)
        if c.error is not None:
            span.record_exception(c.error, timestamp=c.end_ns)
            span.set_status(SdkStatus(StatusCode.ERROR, f"{type(c.error).__name__}: {c.error}"))
        span.end(end_time=c.end_ns)
    provider.shutdown()
    return encode_spans(exporter.get_finished_spans())


def test_same_request_as_the_sdk_encoder():
    calls = sample_calls() + [remote_child()]
    ours = decode(encode_export_request(calls, RESOURCE, *SCOPE))
    sdk = sdk_request(calls)
    # The only intended difference: the SDK's record_exception adds the deprecated "exception.escaped".
    for span in sdk.resource_spans[0].scope_spans[0].spans:
        for event in span.events:
            kept = [kv for kv in event.attributes if kv.key != "exception.escaped"]
            del event.attributes[:]
            event.attributes.extend(kept)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == len(calls)
    ours_spans, sdk_spans = ours.resource_spans[0].scope_spans[0].spans, sdk.resource_spans[0].scope_spans[0].spans
    for a, b in zip(ours_spans, sdk_spans, strict=True):
        assert a == b, f"{a.name}:\n{a}\n!=\n{b}"
    assert ours == sdk  # resource, scope, schema urls too


def test_a_handful_of_spans_and_a_batch_are_written_alike(monkeypatch):
    """A training step's own few spans have their ids, times, floats and shapes written slot by slot in Python; a
    larger batch all at once with numpy: both give the SDK's request."""
    from torchtrace._otlp import protobuf as _otlp_encoding

    writers: list[str] = []
    for name in ("_fill", "_fill_few"):
        writer = getattr(_otlp_encoding, name)
        monkeypatch.setattr(_otlp_encoding, name, lambda *a, _w=writer, _n=name: (writers.append(_n), _w(*a))[1])
    few = [call for call in sample_calls() if call.error is None]  # (the SDK adds an attribute to error events)
    many = few * 3
    for calls, writer in ((few, "_fill_few"), (many, "_fill")):
        writers.clear()
        assert decode(encode_export_request(calls, RESOURCE, *SCOPE)) == sdk_request(calls)
        assert writers == [writer]


def test_fast_and_slow_paths_encode_alike():
    """Unusual attribute values (numpy scalars) take the per-span path; the bytes decode the same as the SDK's."""
    np = pytest.importorskip("numpy")
    calls = [
        ModuleCall("m", "M", 0, TRACE_ID, 5, 0, T0, T0 + 1, {"i": np.int64(7), "f": np.float32(0.5), "x": 2.0}),
        ModuleCall("m", "M", 0, TRACE_ID, 6, 5, T0, T0 + 1, {"big": 2**70, "ok": 1}),  # out of int64: dropped
    ]
    ours = decode(encode_export_request(calls, RESOURCE, *SCOPE))
    assert ours == sdk_request(calls)


def test_a_stat_that_changes_type_is_encoded_with_its_own_type():
    """The template of "m" has a double slot for "s"; a later call with an int there must still say int."""
    calls = [
        ModuleCall("m", "M", 0, TRACE_ID, 1, 0, T0, T0 + 1, {"s": 1.5, "k": 2.5}),
        ModuleCall("m", "M", 0, TRACE_ID, 2, 0, T0, T0 + 1, {"s": 3, "k": 2.5}),
        ModuleCall("m", "M", 0, TRACE_ID, 3, 0, T0, T0 + 1, {"s": 4.5, "k": 7}),
    ]
    ours = decode(encode_export_request(calls, RESOURCE, *SCOPE))
    assert ours == sdk_request(calls)
    kinds = [[kv.value.WhichOneof("value") for kv in s.attributes] for s in ours.resource_spans[0].scope_spans[0].spans]
    assert kinds == [["double_value", "double_value"], ["int_value", "double_value"], ["double_value", "int_value"]]


def timing_batch(root_parent_id: int = 0, remote: bool = False, trace_state: Any = None) -> CallBatch:
    """A resolved forward (columns) of a model with nested modules, traced without statistics: every call has
    only the module path and type."""
    modules = [ModuleInfo("", "Net", 0), ModuleInfo("0", "Linear", 1), ModuleInfo("1", "Seq", 1),
               ModuleInfo("1.0", "ReLU", 2)]  # fmt: skip
    batch = CallBatch(modules, TRACE_ID, root_parent_id, remote, 1, trace_state, 7)
    # module, parent position: Net > (Linear, Seq > ReLU, Linear again)
    for module, parent, start, end in [(0, -1, 0, 100), (1, 0, 5, 20), (2, 0, 25, 60), (3, 2, 30, 50), (1, 0, 70, 90)]:
        batch.module.append(module)
        batch.parent.append(parent)
        batch.depth.append(0 if parent < 0 else batch.depth[parent] + 1)
        batch.start_ns.append(T0 + start)
        batch.end_ns.append(T0 + end)
        batch.attributes.append(None)
    batch.span_id = [0x100 + i for i in range(5)]
    batch.span_id[3] = 0xFFFFFFFFFFFFFFFF
    batch.hi = 5
    return batch


@pytest.mark.parametrize(
    "root",
    [{}, {"root_parent_id": 0x99}, {"root_parent_id": 0x99, "remote": True, "trace_state": TraceState([("v", "1")])}],
    ids=["new_trace", "local_parent", "remote_parent"],
)
def test_a_forward_traced_without_statistics_encodes_from_its_columns_as_from_its_calls(root) -> None:
    batch = timing_batch(**root)
    from_columns = encode_export_request(Calls([batch, batch[1:4]]), RESOURCE, *SCOPE)
    assert not batch.made  # the columns were enough
    assert from_columns == encode_export_request([*batch.calls(), *batch.calls()[1:4]], RESOURCE, *SCOPE)
    spans = decode(from_columns).resource_spans[0].scope_spans[0].spans
    assert [span.name for span in spans] == ["Net", "0", "1", "1.0", "0", "0", "1", "1.0"]
    assert spans[3].parent_span_id == (0x102).to_bytes(8, "big")
    assert spans[3].span_id == bytes(8 * [0xFF])


def test_a_forward_with_statistics_encodes_from_its_columns_as_from_its_calls() -> None:
    import numpy as np

    batch = timing_batch(root_parent_id=0x99)
    stats = {"torchtrace.output.shape": (1, 32), "torchtrace.output.mean": 0.5, "torchtrace.output.nan_count": 0}
    batch.attributes[1] = {"torchtrace.module.path": "0", "torchtrace.module.type": "Linear", **stats}
    batch.attributes[4] = {**batch.attributes[1], "torchtrace.output.shape": (2, 32), "torchtrace.output.mean": 1.5}
    batch.attributes[3] = {"torchtrace.module.path": "1.0", "odd": np.float32(2.0)}  # marshal cannot key it
    payload = encode_export_request(Calls([batch]), RESOURCE, *SCOPE)
    assert not batch.made
    assert decode(payload) == decode(encode_export_request(batch.calls(), RESOURCE, *SCOPE))
    spans = decode(payload).resource_spans[0].scope_spans[0].spans
    assert attrs(spans[4].attributes)["torchtrace.output.mean"] == 1.5


def test_shapes_are_data_one_template_serves_every_sequence_length() -> None:
    from torchtrace._otlp import protobuf as _otlp_encoding

    clear_template_cache()
    calls = [
        call("enc", 0x40 + length, 0, 0, 10, {"torchtrace.output.shape": (8, length, 256), "mean": 0.5})
        for length in range(7, 161)
    ]
    ours = decode(encode_export_request(calls, RESOURCE, *SCOPE))
    assert ours == sdk_request(calls)
    (shape,) = _otlp_encoding._shapes.values()
    assert len(shape.variants) == 1  # not one per length


@pytest.mark.parametrize(
    "odd", [(8, -1, 256), (2**35, 1), (True, 3), (), (1.5, 2)], ids=["jagged", "huge", "bool", "empty", "float"]
)
def test_shapes_that_fit_no_dimension_slot_are_encoded_exactly(odd) -> None:
    calls = [
        call("enc", 0x50, 0, 0, 10, {"torchtrace.output.shape": (8, 7, 256), "mean": 0.5}),
        call("enc", 0x51, 0, 0, 10, {"torchtrace.output.shape": odd, "mean": 0.5}),
    ]
    assert decode(encode_export_request(calls, RESOURCE, *SCOPE)) == sdk_request(calls)


def three_forwards() -> tuple[CallBatch, CallBatch, CallBatch]:
    """Forwards of one module sequence: the second under a local parent 0x99 with trace id + 1 and span ids 0x200..,
    the third with trace id + 2, span ids 0x300.. and times shifted by 1000 (starts) and 2000 (ends)."""
    first, second, third = timing_batch(), timing_batch(root_parent_id=0x99), timing_batch()
    second.trace_id, third.trace_id = TRACE_ID + 1, TRACE_ID + 2
    second.span_id = [0x200 + i for i in range(5)]
    third.span_id = [0x300 + i for i in range(5)]
    third.start_ns = [t + 1000 for t in third.start_ns]
    third.end_ns = [t + 2000 for t in third.end_ns]
    return first, second, third


def test_forwards_of_one_module_sequence_share_a_block_and_keep_their_own_ids_and_times() -> None:
    """A whole forward with only path / type attributes is encoded as one block of templates per module sequence;
    every forward still gets its own trace id, span ids, parents and times."""
    first, second, third = three_forwards()
    batches = [first, second, third, first]
    from_columns = encode_export_request(Calls(batches), RESOURCE, *SCOPE)
    assert from_columns == encode_export_request([c for b in batches for c in b.calls()], RESOURCE, *SCOPE)
    spans = decode(from_columns).resource_spans[0].scope_spans[0].spans
    assert [int.from_bytes(span.trace_id, "big") - TRACE_ID for span in spans] == [0] * 5 + [1] * 5 + [2] * 5 + [0] * 5
    assert spans[5].parent_span_id == (0x99).to_bytes(8, "big") and spans[0].parent_span_id == b""
    assert spans[13].parent_span_id == (0x302).to_bytes(8, "big")
    assert spans[11].start_time_unix_nano == T0 + 1005 and spans[11].end_time_unix_nano == T0 + 2020


def with_statistics(batch: CallBatch, scale: float, rows: int = 1) -> CallBatch:
    """Every call of ``batch`` gets statistics: its own shape (rows + position, 32), mean and std."""
    for position, index in enumerate(batch.module):
        info = batch.modules[index]
        batch.attributes[position] = {
            "torchtrace.module.path": info.path,
            "torchtrace.module.type": info.type_name,
            "torchtrace.output.shape": (rows + position, 32),
            "torchtrace.output.dtype": "float32",
            "torchtrace.output.mean": scale * position,
            "torchtrace.output.std": -0.0 if position == 2 else scale,
            "torchtrace.output.nan_count": 0,
        }
    return batch


@pytest.mark.parametrize(
    "odd",
    [None, "dtype", "rank", "int_mean", "numpy_value", "scalar_shape", "huge_dimension"],
)
def test_forwards_with_statistics_share_a_block_and_keep_their_own_values(odd) -> None:
    """A whole forward whose calls all carry statistics is one block per module sequence and kind of values
    (attribute keys, dtypes, shape ranks); every forward keeps its own ids, times, floats and shapes. A forward that
    differs gets its own block, or the per-call templates: the bytes are those of the per-call path either way."""
    import numpy as np

    first, second, third = (with_statistics(batch, scale) for batch, scale in zip(three_forwards(), (0.5, 1.5, 2.5)))
    fourth = with_statistics(timing_batch(), 3.5, rows=2**34)
    for batch in (second, third, fourth):
        batch.modules = first.modules  # one model's forwards
    if odd == "dtype":
        fourth.attributes[2]["torchtrace.output.dtype"] = "bfloat16"
    elif odd == "int_mean":  # an int in a double slot: the general path
        fourth.attributes[1]["torchtrace.output.mean"] = 1
    elif odd == "numpy_value":
        fourth.attributes[3]["odd"] = np.float32(2.0)
    elif odd == "rank":  # a shape of another rank: the block of that rank
        fourth.attributes[2]["torchtrace.output.shape"] = (3, 1, 2)
    elif odd == "scalar_shape":
        fourth.attributes[0]["torchtrace.output.shape"] = ()
    elif odd == "huge_dimension":  # past what a dimension slot holds
        fourth.attributes[4]["torchtrace.output.shape"] = (2**35, 1)
    batches = [first, second, third, fourth, first]
    from_columns = encode_export_request(Calls(batches), RESOURCE, *SCOPE)
    # a value that fits no slot it had before sends the whole drain down the general path, as on the per-call one
    assert any(batch.made for batch in batches) == (odd in ("int_mean", "huge_dimension", "scalar_shape"))
    calls = [call for batch in batches for call in batch.calls()]
    assert decode(from_columns) == decode(encode_export_request(calls, RESOURCE, *SCOPE)) == sdk_request(calls)
    spans = decode(from_columns).resource_spans[0].scope_spans[0].spans
    assert attrs(spans[8].attributes)["torchtrace.output.mean"] == 1.5 * 3
    assert attrs(spans[13].attributes)["torchtrace.output.shape"] == [4, 32]
    assert attrs(spans[24].attributes)["torchtrace.output.mean"] == 0.5 * 4


def test_the_compiled_slot_writers_refuse_what_does_not_fit_and_never_write_outside_the_buffer(block_writers):
    """``put_values`` writes a block's floats (or shapes) where the encoder's offsets say, and answer
    False (the batch then takes the general path) for a value of another type, a dimension no slot holds, more or
    fewer dimensions than slots, or an offset past the buffer."""
    import numpy as np

    if block_writers == "numpy-writers":
        pytest.skip("the compiled writers themselves")
    from torchtrace._native import put_values

    def put_doubles(*args):
        return put_values(*args, False)

    def put_dims(*args):
        return put_values(*args, True)

    two = np.array([0, 8], dtype=np.int64)
    first_two = np.array([0, 1], dtype=np.int64)
    buf = bytearray(16)
    assert put_doubles(buf, 0, two, (1.5, -0.0), first_two) and buf == struct.pack("<dd", 1.5, -0.0)
    assert not put_doubles(bytearray(16), 1, two, (1.5, 2.5), first_two)  # the second slot ends past the buffer
    assert not put_doubles(bytearray(16), 0, two, (1.5, 2), first_two)  # an int in a double slot
    assert not put_doubles(bytearray(16), 0, two, (1.5,), first_two)  # no value at position 1
    slots = np.array([0, 5], dtype=np.int64)
    buf = bytearray(10)
    assert put_dims(buf, 0, slots, ("x", (3, 2**35 - 1)), np.array([1], dtype=np.int64))
    assert buf == bytes([0x83, 0x80, 0x80, 0x80, 0x00, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F])  # 5-byte varints
    for shape in [(True, 1), (-1, 1), (2**35, 1), (1, 2**70), (), [3, 2], (1,), (1, 2, 3), 5]:
        assert not put_dims(bytearray(10), 0, slots, (shape,), np.array([0], dtype=np.int64)), shape
    assert not put_dims(bytearray(9), 0, slots, ((3, 2),), np.array([0], dtype=np.int64))  # past the buffer


def test_the_compiled_span_field_writer_refuses_columns_that_do_not_fit(block_writers):
    """``put_span_fields`` writes a block-encoded forward's trace id, span and parent ids (big-endian) and times
    (little-endian) from its native 64-bit columns, and answers False (numpy then writes them) for columns of the
    wrong length, a column that is not native (a list), a parent position outside the forward, or a slot past the
    buffer."""
    from array import array

    import numpy as np

    if block_writers == "numpy-writers":
        pytest.skip("the compiled writer itself")
    from torchtrace._native import put_span_fields

    def put(buf, listed=(), **change):  # call 0: the root, no parent slot; call 1: its child, with one
        columns = {"tid_at": [0, 41], "sid_at": [16, 57], "pid_at": [65], "has_pid": [False, True],
                   "start_at": [24, 73], "span_ids": [0x0102030405060708, 7], "parents": [-1, 0],
                   "starts": [5, 6], "ends": [-1, 9], **change}  # fmt: skip
        arrays = {key: np.array(columns[key], dtype=bool if key == "has_pid" else np.int64)
                  for key in ("tid_at", "sid_at", "pid_at", "has_pid", "start_at")}  # fmt: skip
        native = {key: array("Q" if key == "span_ids" else "q", columns[key]) if key not in listed else columns[key]
                  for key in ("span_ids", "starts", "ends")}  # fmt: skip
        return put_span_fields(buf, 0, bytes(range(16)), *arrays.values(), native["span_ids"], columns["parents"],
                               0x99, native["starts"], native["ends"])  # fmt: skip

    buf = bytearray(90)
    assert put(buf)
    assert buf[0:16] == buf[41:57] == bytes(range(16))
    assert buf[16:24] == bytes(range(1, 9)) and buf[57:65] == (7).to_bytes(8, "big")
    assert buf[65:73] == (0x0102030405060708).to_bytes(8, "big")  # the child's parent: the root's span id
    assert buf[24:32] == (5).to_bytes(8, "little") and buf[33:41] == bytes([0xFF] * 8)
    assert buf[73:81] == (6).to_bytes(8, "little") and buf[82:90] == (9).to_bytes(8, "little")
    assert not put(bytearray(90), listed=("span_ids",))  # a list of ints, not a native column
    assert not put(bytearray(90), parents=[-1, 5])  # no such call
    assert not put(bytearray(90), starts=[5])  # a column of another length
    assert not put(bytearray(89))  # the last slot past the buffer
    assert not put(bytearray(90), pid_at=[])  # a parent slot missing


def test_the_compiled_block_match_compares_values_with_their_types_and_shapes_by_rank(block_writers):
    """``same_values`` is True only where every value at the positions equals the block's and has its type (True,
    1 and 1.0 are equal in Python but not on the wire); with ``lengths``, where each is a tuple or list of the
    block's length."""
    import numpy as np

    if block_writers == "numpy-writers":
        pytest.skip("the compiled comparisons themselves")
    from torchtrace._native import same_values

    at = np.array([0, 2], dtype=np.int64)
    assert same_values(("a", 0.5, 1), at, ("a", 1), False)
    assert not same_values(("a", 0.5, True), at, ("a", 1), False)  # equal, another type
    assert not same_values(("a", 0.5, 1.0), at, ("a", 1), False)
    assert not same_values(("b", 0.5, 1), at, ("a", 1), False)
    assert not same_values(("a",), at, ("a", 1), False)  # no value at position 2
    assert same_values(((8, 4), 0.5, [1, 2, 3]), at, (2, 3), True)
    assert not same_values(((8, 4), 0.5, (1, 2)), at, (2, 3), True)
    assert not same_values(((8, 4), 0.5, 7), at, (2, 1), True)  # no length
