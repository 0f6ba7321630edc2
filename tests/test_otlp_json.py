"""The file exporter's OTLP/JSON, written straight from the calls, equals protobuf's own JSON mapping of the bytes
the OTLP exporters send (``json_format`` on ``encode_export_request``'s output, ids in hex), value for value; its
templates filled in C (``torchtrace._otlp._json_text``) or by Python's ``%``, the same text."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.trace import TraceState
from test_otlp_encoding import (
    RESOURCE,
    SCOPE,
    T0,
    TRACE_ID,
    call,
    decode,
    remote_child,
    sample_calls,
    three_forwards,
    timing_batch,
    with_statistics,
)

import torchtrace
from torchtrace._core.calls import Calls, ModuleCall
from torchtrace._otlp import json_lines
from torchtrace._otlp.exporters import request_to_otlp_json
from torchtrace._otlp.json_lines import encode_otlp_json
from torchtrace._otlp.protobuf import encode_export_request, timing_templates_of
from torchtrace.attributes import OUTPUT_PREFIX


def compiled_writer():
    """``torchtrace._otlp._json_text.percent_format``, or None where the module is not built."""
    try:
        from torchtrace._otlp._json_text import percent_format
    except ImportError:
        return None
    return percent_format


@pytest.fixture(autouse=True, params=["compiled-text", "python-text"])
def text_writer(request, monkeypatch):
    """Every test runs with the templates filled by ``torchtrace._otlp._json_text`` and by Python's ``%`` (an
    install without a C compiler)."""
    if request.param == "compiled-text" and json_lines._percent_format is None:
        pytest.skip("torchtrace._otlp._json_text is not built here")
    if request.param == "python-text":
        monkeypatch.setattr(json_lines, "_percent_format", None)
    return request.param


def through_protobuf(calls: list[ModuleCall]) -> dict:
    return json.loads(request_to_otlp_json(encode_export_request(calls, RESOURCE, *SCOPE)))


def direct(calls: list[ModuleCall]) -> dict:
    return json.loads(encode_otlp_json(calls, RESOURCE, *SCOPE))


def test_same_json_as_protobufs_mapping():
    calls = [*sample_calls(), remote_child()]
    assert direct(calls) == through_protobuf(calls)


def test_ids_are_hex_and_times_strings_as_otlp_json_has_them():
    span = direct([call("layers.0", 0xAB, 0x10, 5, 9, {"mean": 0.5})])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == f"{TRACE_ID:032x}"
    assert (span["spanId"], span["parentSpanId"]) == ("00000000000000ab", "0000000000000010")
    assert (span["startTimeUnixNano"], span["endTimeUnixNano"]) == (str(T0 + 5), str(T0 + 9))
    assert span["attributes"] == [{"key": "mean", "value": {"doubleValue": 0.5}}]


def test_forwards_of_one_module_sequence_share_a_block_and_keep_their_own_ids_and_times():
    """A whole forward with only path / type attributes is written from one text per module sequence and root
    kind; every forward keeps its own trace id, span ids, parents and times, as the protobuf path has them."""
    first, second, third = three_forwards()
    remote = timing_batch(root_parent_id=0x77, remote=True, trace_state=TraceState([("v", "1%d")]))
    batches = [first, second, third, first, remote]
    from_blocks = json.loads(encode_otlp_json(Calls(batches), RESOURCE, *SCOPE))
    assert from_blocks == through_protobuf([c for b in batches for c in b.calls()])
    spans = from_blocks["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [span["traceId"] for span in spans[::5]] == [f"{TRACE_ID + i:032x}" for i in (0, 1, 2, 0)] + [
        f"{TRACE_ID:032x}"
    ]
    assert "parentSpanId" not in spans[0] and spans[5]["parentSpanId"] == f"{0x99:016x}"
    assert spans[13]["parentSpanId"] == f"{0x302:016x}"
    assert (spans[11]["startTimeUnixNano"], spans[11]["endTimeUnixNano"]) == (str(T0 + 1005), str(T0 + 2020))
    assert spans[20]["traceState"] == "v=1%d" and spans[20]["flags"] == 0x300


@pytest.mark.parametrize("odd", [None, "dtype", "shape", "float_shape", "nan", "numpy_value"])
def test_forwards_with_statistics_share_a_text_and_keep_their_own_values(odd):
    """A whole forward whose calls all carry statistics is written from one text per module sequence and kind of
    values; shapes are text here, so a forward with other shapes (or a shape of floats, equal in Python) gets its
    own. NaN (written as a string) and values marshal cannot key take the per-call path. Each reads back as the
    protobuf path's JSON."""
    first, second, third = (with_statistics(batch, scale) for batch, scale in zip(three_forwards(), (0.5, 1.5, 2.5)))
    fourth = with_statistics(timing_batch(), 3.5)
    for batch in (second, third, fourth):
        batch.modules = first.modules  # one model's forwards
    if odd == "dtype":
        fourth.attributes[2]["torchtrace.output.dtype"] = "bfloat16"
    elif odd == "shape":
        fourth.attributes[2]["torchtrace.output.shape"] = (7, 32)
    elif odd == "float_shape":
        fourth.attributes[2]["torchtrace.output.shape"] = (3.0, 32)
    elif odd == "nan":
        fourth.attributes[1]["torchtrace.output.mean"] = float("nan")
    elif odd == "numpy_value":
        fourth.attributes[3]["odd"] = np.float32(2.0)
    batches = [first, second, third, fourth, first]
    from_blocks = direct(Calls(batches))
    assert not any(batch.made for batch in batches)
    calls = [call for batch in batches for call in batch.calls()]
    assert from_blocks == through_protobuf(calls)
    spans = from_blocks["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert {"key": "torchtrace.output.mean", "value": {"doubleValue": 1.5 * 3}} in spans[8]["attributes"]


def test_forwards_of_other_shapes_share_one_text_and_keep_their_own_shapes():
    """A shape is a slot of the text, its rank part of the key (as in protobuf, where shapes are data): forwards
    whose outputs change shape (a new sequence length every request) share the forward's block and its calls'
    templates instead of each making their own, and each span writes its own shape."""
    first, _, third = three_forwards()
    batches = [with_statistics(first, 0.5, rows=1), with_statistics(third, 1.5, rows=300)]
    batches[1].modules = batches[0].modules
    result = direct(Calls(batches))
    assert result == through_protobuf([call for batch in batches for call in batch.calls()])
    blocks = timing_templates_of(batches[0].modules, None).json_stats_blocks
    assert [len(candidates) for candidates in blocks.values()] == [1]  # one block for both forwards
    spans = result["resourceSpans"][0]["scopeSpans"][0]["spans"]
    shapes = [
        [int(dim["intValue"]) for dim in attribute["value"]["arrayValue"]["values"]]
        for span in spans
        for attribute in span["attributes"]
        if attribute["key"] == f"{OUTPUT_PREFIX}.shape"
    ]
    assert shapes == [[rows + position, 32] for rows in (1, 300) for position in range(len(first))]


def test_the_compiled_and_the_python_writer_write_the_same_text(monkeypatch):
    """Not only the same values once parsed: the same characters (a float as ``repr`` writes it, ids and times as
    ``%`` does), for forwards written as blocks, per-call templates and dicts."""
    compiled = compiled_writer()
    if compiled is None:
        pytest.skip("torchtrace._otlp._json_text is not built here")
    batches = [with_statistics(batch, scale) for batch, scale in zip(three_forwards(), (1e-7, 1 / 3, 2.5e17))]
    for batch in batches[1:]:
        batch.modules = batches[0].modules
    timing = timing_batch(root_parent_id=0x77, remote=True)
    one_by_one = [*sample_calls(), remote_child(), call("m", 2, 0, 0, 1, {"tiny": 5e-324, "whole": 1e16, "neg": -0.0})]

    def texts() -> list[str]:
        return [encode_otlp_json(calls, RESOURCE, *SCOPE) for calls in (Calls([*batches, timing]), one_by_one)]

    monkeypatch.setattr(json_lines, "_percent_format", compiled)
    written = texts()
    monkeypatch.setattr(json_lines, "_percent_format", None)
    assert texts() == written
    assert "2.5e+17" in written[0] and "5e-324" in written[1]


def test_a_hugging_face_generate_and_requests_of_other_lengths_are_written_as_protobuf_maps_them(monkeypatch):
    """A GPT-2 from a config: greedy generate (a prompt, then one token a step), then forwards of other sequence
    lengths. The compiled and the Python writer write the same text from the columns the exporters get, and it reads
    back as protobuf's JSON of the same spans."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    delivered: list = []
    with torchtrace.instrument(model, exporter="none", sinks=[delivered.append]) as handle, torch.no_grad():
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        for length in (5, 9, 17):
            model(torch.arange(length).unsqueeze(0))
        handle.flush()
    segments = [segment for calls in delivered for segment in calls.segments]
    texts = []
    for writer in (compiled_writer(), None):  # the compiled one where it is built, whichever the fixture set
        monkeypatch.setattr(json_lines, "_percent_format", writer)
        texts.append(encode_otlp_json(Calls(segments), RESOURCE, *SCOPE))
    assert not any(segment.made for segment in segments)  # written from the columns
    assert texts[0] == texts[1]
    spans = [call for segment in segments for call in segment]
    assert len(spans) > 100 and json.loads(texts[0]) == through_protobuf(spans)


def test_cached_templates_never_carry_values_from_one_call_to_the_next():
    first = call("m", 1, 0, 0, 1, {"shape": [2, 3], "mean": 0.5, "note": "100%"})
    second = call("m", 2, 0, 2, 3, {"shape": [2, 3], "mean": -1.25, "note": "100%"})
    other_shape = call("m", 3, 0, 4, 5, {"shape": [4, 3], "mean": float("nan"), "note": "%s %d"})
    for calls in ([first], [second, other_shape], [first, second, other_shape]):
        assert direct(calls) == through_protobuf(calls)


def test_unusual_values_take_the_per_span_path_and_still_agree():
    calls = [
        ModuleCall("m", "M", 0, TRACE_ID, 5, 0, T0, T0 + 1, {"i": np.int64(7), "f": np.float32(0.5), "x": 2.0}),
        ModuleCall("m", "M", 0, TRACE_ID, 6, 5, T0, T0 + 1, {"big": 2**70, "ok": 1, "b": b"\x00\xff", "n": None}),
        ModuleCall("m", "M", 0, TRACE_ID, 7, 0, T0, T0 + 1, {"s": 3, "k": 2.5}),
        ModuleCall("m", "M", 0, TRACE_ID, 8, 0, T0, T0 + 1, {"s": 4.5, "k": 7}),
        ModuleCall("m", "M", 0, TRACE_ID, 9, 0, T0, T0 + 1, {"map": {"a": 1, "b": [1.5, None]}, "e": [], "": "x"}),
    ]
    assert direct(calls) == through_protobuf(calls)


def test_span_limits_apply_as_on_the_protobuf_path(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "3")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    calls = [call("m", 1, 0, 0, 1, {f"k{i}": float(i) for i in range(6)}), call("m", 2, 0, 0, 1, {"s": "long text"})]
    result = direct(calls)
    assert result == through_protobuf(calls)
    spans = result["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert spans[0]["droppedAttributesCount"] == 3
    assert spans[1]["attributes"] == [{"key": "s", "value": {"stringValue": "long"}}]


def test_an_event_count_limit_of_zero_applies_as_on_the_protobuf_path(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "0")
    failed = call("m", 1, 0, 0, 1, {"k": 1.0})
    failed.error = ValueError("boom")
    result = direct([failed])
    assert result == through_protobuf([failed])
    (span,) = result["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert "events" not in span and span["droppedEventsCount"] == 1


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
values = scalars | st.lists(scalars, max_size=3) | st.tuples(st.integers(), st.integers())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=6), values, max_size=6), min_size=1, max_size=4))
def test_any_attributes_encode_as_protobufs_mapping_does(attribute_sets):
    calls = [call("m", index + 1, 0, index, index + 1, attributes) for index, attributes in enumerate(attribute_sets)]
    assert direct(calls) == through_protobuf(calls)


def test_the_file_exporter_writes_it(tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    path = tmp_path / "traces.jsonl"
    with torchtrace.instrument(model, exporter="file", trace_file=str(path)) as handle:
        model(torch.randn(2, 3))
        handle.flush()
        records = {record.name: record for record in handle.records}
    (line,) = path.read_text().splitlines()
    spans = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [span["name"] for span in spans] == ["Sequential", "0", "1"]
    linear = next(span for span in spans if span["name"] == "0")
    assert linear["spanId"] == f"{records['0'].span_id:016x}"
    mean = next(a for a in linear["attributes"] if a["key"] == "torchtrace.output.mean")["value"]["doubleValue"]
    assert math.isclose(mean, records["0"].attributes["torchtrace.output.mean"])


def traced_step_segments() -> list:
    """What the sinks get for one traced training step of a small MLP (its own spans, then columns: each forward's
    backward spans and its calls), unread by anyone (no ModuleCall made)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches: list = []
    with torchtrace.instrument(
        model, exporter="none", backward=True, optimizer=optimizer, sinks=[lambda calls: batches.append(calls)]
    ) as handle:
        model(torch.randn(5, 8)).pow(2).sum().backward()
        optimizer.step()
        handle.flush()
    return [segment for calls in batches for segment in calls.segments]


def test_a_steps_backward_spans_encode_from_their_columns_as_from_their_calls():
    """A forward's module backward spans are columns, as its calls are: both encoders write them from the columns
    (the protobuf one as a block), as they write the same spans made one by one."""
    segments = traced_step_segments()
    backward = [segment for segment in segments if getattr(segment, "kind", None) == "backward"]
    assert len(backward) == 1 and len(backward[0]) == 4  # the model's and its three layers' backward spans
    protobuf = encode_export_request(Calls(segments), RESOURCE, *SCOPE)
    text = json.loads(encode_otlp_json(Calls(segments), RESOURCE, *SCOPE))
    assert not backward[0].made  # the columns were enough for both
    calls = [call for segment in segments for call in segment]
    assert decode(protobuf) == decode(encode_export_request(calls, RESOURCE, *SCOPE))
    assert text == through_protobuf(calls)
    spans = decode(protobuf).resource_spans[0].scope_spans[0].spans
    names = {span.span_id: span.name for span in spans}
    nested = {span.name: names.get(span.parent_span_id) for span in spans if span.name.endswith(" backward")}
    assert nested == {"Sequential backward": "backward", "0 backward": "Sequential backward",
                      "1 backward": "Sequential backward", "2 backward": "Sequential backward"}  # fmt: skip
