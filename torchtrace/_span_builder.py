"""Sink: ordinary OTel SDK spans through a TracerProvider, so its processors and exporters see normal spans."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from torchtrace._calls import ModuleCall, error_text, exception_event_attributes
from torchtrace.version import __version__


def _parents_first(calls: Sequence[ModuleCall]) -> list[ModuleCall]:
    """The provider assigns ids as spans start, so a parent must start before its children."""
    in_batch = {call.span_id for call in calls}
    children: dict[int, list[ModuleCall]] = {}
    ordered: list[ModuleCall] = []
    for call in calls:
        if call.parent_span_id in in_batch:
            children.setdefault(call.parent_span_id, []).append(call)
        else:
            ordered.append(call)
    for call in ordered:  # grows while iterating: breadth-first from the roots
        ordered.extend(children.pop(call.span_id, ()))
    return ordered


class _CallIds(IdGenerator):
    """The ids torchtrace gave the call being started, for an SDK tracer: a training step's trace and root ids are
    derived from (run id, step) so that every rank of a job agrees on them without talking (as on the OTLP path).
    Falls back to the provider's own generator between calls."""

    def __init__(self, fallback: IdGenerator) -> None:
        self.fallback = fallback
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id or self.fallback.generate_trace_id()

    def generate_span_id(self) -> int:
        return self.span_id or self.fallback.generate_span_id()

    def is_trace_id_random(self) -> bool:  # W3C random flag: our ids are random or hashes of random run ids
        return self.fallback.is_trace_id_random()


class SdkSpanSink:
    """Builds one span per call after the fact (explicit times and parents), parents first, with torchtrace's ids
    where the tracer is the SDK's (else the provider's ids are written back into each ``ModuleCall``, so later
    sinks, records and metrics exemplars, refer to the spans that were really exported)."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("torchtrace", __version__, tracer_provider)
        fallback = getattr(self.tracer, "id_generator", None)  # an SDK Tracer (a tracer of its own: not shared)
        self._ids = _CallIds(fallback) if isinstance(fallback, IdGenerator) else None
        if self._ids is not None:
            self.tracer.id_generator = self._ids

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        spans: dict[int, trace.Span] = {}
        ids = self._ids
        for call in _parents_first(calls):
            if ids is not None:
                ids.trace_id, ids.span_id = call.trace_id, call.span_id
            parent_span = spans.get(call.parent_span_id)
            if parent_span is not None:
                context = trace.set_span_in_context(parent_span)
            elif call.parent_span_id:
                remote = SpanContext(
                    call.trace_id,
                    call.parent_span_id,
                    is_remote=True,
                    trace_flags=TraceFlags(call.trace_flags),
                    trace_state=call.trace_state,
                )
                context = trace.set_span_in_context(NonRecordingSpan(remote))
            else:
                context = Context()  # a new trace: never the worker thread's current context
            span = self.tracer.start_span(
                call.name, context=context, start_time=call.start_ns, attributes=call.attributes
            )
            spans[call.span_id] = span
            if call.error is not None:
                # what record_exception(escaped=True) adds, without its unguarded str(error)
                attributes = {**exception_event_attributes(call.error), "exception.escaped": "True"}
                span.add_event("exception", attributes, timestamp=call.end_ns)
                span.set_status(Status(StatusCode.ERROR, error_text(call.error)))
            span.end(end_time=call.end_ns)
            if ids is not None:
                ids.trace_id = ids.span_id = 0
            exported = span.get_span_context()
            if exported.is_valid:
                call.trace_id, call.span_id = exported.trace_id, exported.span_id
            call.trace_flags = int(exported.trace_flags)  # sampled out by the provider: no exemplar may link it
        # children looked their parents up by our ids before the write-back; fix their parent ids afterwards
        for call in calls:
            parent_span = spans.get(call.parent_span_id)
            if parent_span is not None:
                call.parent_span_id = parent_span.get_span_context().span_id
