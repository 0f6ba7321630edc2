"""The fast OTLP encoder respects the SDK's span limits exactly as the SDK does (OTEL_*_LIMIT variables)."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_receiver import attributes_dict

from torchtrace._core.calls import ModuleCall
from torchtrace._otlp.protobuf import encode_export_request

RESOURCE = Resource({"service.name": "limits"})
T0 = 1_700_000_000_000_000_000


def wide_call(attribute_count: int, error: BaseException | None = None) -> ModuleCall:
    attributes = {"torchtrace.module.path": "layer", "torchtrace.module.type": "Linear"}
    attributes.update({f"torchtrace.output.{i}.mean": float(i) for i in range(attribute_count - 3)})
    attributes["torchtrace.output.dtype"] = "x" * 1000
    return ModuleCall("layer", "Linear", 0, 0xABC, 0x1, 0, T0, T0 + 10, attributes, error)


def ours(call: ModuleCall):
    request = ExportTraceServiceRequest.FromString(encode_export_request([call], RESOURCE, "torchtrace", ""))
    return request.resource_spans[0].scope_spans[0].spans[0]


def sdks(call: ModuleCall):
    """The same span made and encoded by the SDK (its TracerProvider reads the same variables)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("torchtrace").start_span("layer", attributes=call.attributes, start_time=T0)
    if call.error is not None:
        span.record_exception(call.error)
    span.end(end_time=T0 + 10)
    request = encode_spans(exporter.get_finished_spans())
    return request.resource_spans[0].scope_spans[0].spans[0]


def test_by_default_at_most_128_attributes_are_exported_and_the_rest_counted(monkeypatch) -> None:
    for name in (
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    ):
        monkeypatch.delenv(name, raising=False)
    call = wide_call(200)
    span, sdk_span = ours(call), sdks(call)
    assert len(span.attributes) == 128
    assert span.dropped_attributes_count == 72
    assert attributes_dict(span.attributes) == attributes_dict(sdk_span.attributes)  # the same ones kept
    assert span.dropped_attributes_count == sdk_span.dropped_attributes_count
    assert len(attributes_dict(span.attributes)["torchtrace.output.dtype"]) == 1000  # no length limit by default


@pytest.mark.parametrize(
    ("variables", "count", "length"),
    [
        ({"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "10", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "16"}, 10, 16),
        ({"OTEL_ATTRIBUTE_COUNT_LIMIT": "20", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "5"}, 20, 5),  # the general ones
        ({"OTEL_ATTRIBUTE_COUNT_LIMIT": "50", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "30"}, 30, 1000),  # span wins
    ],
)
def test_limits_from_the_environment_match_the_sdk(monkeypatch, variables, count, length) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    call = wide_call(60)
    span, sdk_span = ours(call), sdks(call)
    assert len(span.attributes) == count
    assert span.dropped_attributes_count == 60 - count
    assert len(attributes_dict(span.attributes)["torchtrace.output.dtype"]) == length
    assert attributes_dict(span.attributes) == attributes_dict(sdk_span.attributes)


def test_the_exception_event_is_bounded_too(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "12")
    call = wide_call(5, error=ValueError("a rather long error message"))
    (event,) = ours(call).events
    (sdk_event,) = sdks(call).events
    values = attributes_dict(event.attributes)
    assert values["exception.message"] == "a rather lon"
    assert all(len(value) <= 12 for value in values.values())
    assert values["exception.type"] == attributes_dict(sdk_event.attributes)["exception.type"]


def test_an_event_count_limit_of_zero_drops_the_exception_event_and_counts_it_like_the_sdk(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "0")
    call = wide_call(5, error=ValueError("boom"))
    span, sdk_span = ours(call), sdks(call)
    assert (len(span.events), span.dropped_events_count) == (0, 1)
    assert (len(sdk_span.events), sdk_span.dropped_events_count) == (0, 1)
    assert span.status.message == "ValueError: boom"  # still an error


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def test_an_exception_whose_str_raises_is_exported_with_a_placeholder_message() -> None:
    span = ours(wide_call(5, error=Unprintable()))
    (event,) = span.events
    assert attributes_dict(event.attributes)["exception.message"] == "<unprintable Unprintable object>"
    assert span.status.message == "Unprintable: <unprintable Unprintable object>"


def test_dropped_attributes_are_logged_once_not_once_per_attribute(caplog, monkeypatch) -> None:
    monkeypatch.setattr("torchtrace._otlp.protobuf._warned_dropping", False)
    with caplog.at_level(logging.WARNING):
        ours(wide_call(200))
        ours(wide_call(300))
    messages = [record.getMessage() for record in caplog.records]
    assert sum("over the limit of 128" in message for message in messages) == 1
    assert not any("Attributes dict is full" in message for message in messages)  # the SDK's per-attribute line
