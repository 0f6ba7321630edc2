"""Through a caller's SDK TracerProvider, finished spans go straight to its span processors; what they receive is
exactly what ``start_span``/``end`` per call would have given them (the path taken when a processor needs a live
span), for every sampler, span limit and parent kind."""

from __future__ import annotations

import copy

import pytest
import torch
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import TraceState
from test_otlp_encoding import call, sample_calls
from torch import nn

import torchtrace
from torchtrace._core.calls import CallBatch, Calls, ModuleCall
from torchtrace._sinks.sdk_spans import SdkSpanSink, _FinishedSpans

RESOURCE = Resource({"service.name": "span-builder"})


class StartWatcher(SpanProcessor):
    """A processor that acts when a span starts: the sink must give it live spans (start_span/end)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def on_start(self, span, parent_context=None) -> None:
        self.started.append(span.name)


def batch() -> list[ModuleCall]:
    """A forward under a caller's remote span with trace state, one whose root starts a trace, an error, stats."""
    trace_state = TraceState([("vendor", "v1")])
    remote_root = call("", 0x30, 0x99, 0, 50, {"mean": 1.0}, parent_is_remote=True, trace_state=trace_state)
    remote_root.trace_id = 0x5EED
    child = call("0", 0x31, 0x30, 5, 20, {"torchtrace.output.mean": 0.5})
    child.trace_id = 0x5EED
    return [*sample_calls(), remote_root, child]


def exported(calls: list[ModuleCall], sampler=ALWAYS_ON, live: bool = False):
    """What the processors of a provider with ``sampler`` got from the sink, encoded as OTLP, and the calls' flags
    afterwards. ``live``: a processor with on_start forces the start_span/end path."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE, sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    watcher = StartWatcher()
    if live:
        provider.add_span_processor(watcher)
    calls = copy.deepcopy(calls)
    sink = SdkSpanSink(provider)
    assert _FinishedSpans.usable(sink.tracer) is not live
    sink(calls)
    spans = exporter.get_finished_spans()
    if live:
        assert sorted(watcher.started) == sorted(span.name for span in spans)  # it did see every span start
    contexts = [(span.context.trace_flags, span.parent) for span in spans]
    return encode_spans(spans), [c.trace_flags for c in calls], contexts


@pytest.mark.parametrize(
    "sampler",
    [
        ALWAYS_ON,
        ALWAYS_OFF,
        ParentBased(ALWAYS_ON),
        ParentBased(ALWAYS_OFF),
        TraceIdRatioBased(0.5),
        ParentBased(ALWAYS_ON, local_parent_sampled=ALWAYS_OFF),
    ],  # fmt: skip
    ids=["always_on", "always_off", "parent_on", "parent_off", "ratio", "parent_custom_local"],
)
def test_finished_spans_equal_started_and_ended_spans(sampler) -> None:
    direct = exported(batch(), sampler)
    live = exported(batch(), sampler, live=True)
    assert direct == live


@pytest.mark.parametrize(
    "variables",
    [
        {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "3"},
        {"OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "4"},
        {"OTEL_SPAN_EVENT_COUNT_LIMIT": "0"},
        {"OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": "1"},
    ],  # fmt: skip
)
def test_span_limits_apply_as_the_sdk_applies_them(monkeypatch, variables) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    direct, live = exported(batch()), exported(batch(), live=True)
    assert direct == live
    request = direct[0]
    spans = [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    assert len(spans) == len(batch())


def test_a_provider_sampling_out_clears_the_sampled_flag_of_the_calls() -> None:
    request, flags, _ = exported(batch(), ALWAYS_OFF)
    assert not request.resource_spans
    assert not any(flag & 1 for flag in flags)  # not sampled: exemplars must not link spans never exported


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")


def forward_columns() -> Calls:
    """Real forwards as the worker hands them to sinks: columns, no ModuleCall made. One under a caller's request
    span (with statistics), one starting its trace, one that raised (an error in its columns)."""
    batches: list[Calls] = []
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 2)))
    failing = nn.Sequential(nn.Linear(3, 3), Fails())
    request_provider = TracerProvider()
    with torchtrace.instrument(model, exporter="none", sinks=[batches.append]) as handle:
        with request_provider.get_tracer("app").start_as_current_span("request"):
            model(torch.randn(2, 3))
        model(torch.randn(2, 3))
        handle.flush()
    with torchtrace.instrument(failing, exporter="none", stats=False, sinks=[batches.append]) as handle:
        with pytest.raises(ValueError):
            failing(torch.randn(2, 3))
        handle.flush()
    segments = [segment for calls in batches for segment in calls.segments]
    assert all(isinstance(segment, CallBatch) and not segment.made for segment in segments)
    return Calls(segments)


@pytest.mark.parametrize(
    "sampler",
    [ParentBased(ALWAYS_ON), ParentBased(ALWAYS_OFF), ParentBased(TraceIdRatioBased(0.5))],
    ids=["parent_on", "parent_off", "parent_ratio"],
)
def test_forward_columns_give_the_spans_started_and_ended_spans_give(sampler, monkeypatch) -> None:
    """Where children follow their parent's decision, a forward's columns become spans without ModuleCall objects:
    the same spans, flags and parents as the start_span/end path."""
    columns = forward_columns()
    from_columns = []
    forward = _FinishedSpans._forward
    monkeypatch.setattr(_FinishedSpans, "_forward", lambda self, batch: from_columns.append(forward(self, batch)))
    direct = exported(columns, sampler)
    assert len(from_columns) == 3  # every forward went the column way
    assert direct == exported(columns, sampler, live=True)
    assert len(direct[1]) == 13 and trace.get_current_span() is trace.INVALID_SPAN
