"""Sink: ordinary OTel SDK spans through a TracerProvider, so its processors and exporters see normal spans."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from torchtrace._core.calls import CallBatch, Calls, ModuleCall, error_text, exception_event_attributes
from torchtrace.version import __version__

_TRACER_FIELDS = ("sampler", "resource", "span_processor", "id_generator", "_instrumentation_scope", "_span_limits")
_PLAIN_PROCESSORS = (SpanProcessor, BatchSpanProcessor, SimpleSpanProcessor)  # they ignore a span until it ended
_NO_OP_ON_START = {cls.on_start for cls in _PLAIN_PROCESSORS}
_NO_OP_ON_ENDING = {getattr(cls, "_on_ending", None) for cls in _PLAIN_PROCESSORS}  # older SDKs: no _on_ending
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_RANDOM_TRACE_ID = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # the W3C level-2 flag, in newer SDKs
_UNSET = Status(StatusCode.UNSET)


def _processors(processor: Any) -> list:
    """The processors behind a provider's active (multi) span processor."""
    nested = getattr(processor, "_span_processors", None)
    return [processor] if nested is None else [p for inner in nested for p in _processors(inner)]


_ATOMIC = (str, bool, int, float)


def _plain(value: Any, length: int | None) -> bool:
    """A value the SDK's attribute cleaning keeps as it is (within ``length``)."""
    kind = type(value)
    if kind in _ATOMIC:
        return length is None or kind is not str or len(value) <= length
    if kind is tuple and value:
        first = type(value[0])
        return (
            first in _ATOMIC
            and all(type(item) is first for item in value)
            and (length is None or first is not str or all(len(item) <= length for item in value))
        )
    return False


def _within_limits(attributes: Any, limits: Any) -> Any:
    """The span's attributes as the SDK would keep them: the plain values torchtrace makes (nearly always) as they
    are, in a dict of their own; anything else through the SDK's own cleaning and limits."""
    count, length = limits.max_span_attributes, limits.max_span_attribute_length
    if count is None or len(attributes) <= count:
        for key, value in attributes.items():  # a loop, not all(generator): this runs for every span
            if type(key) is not str or not key:
                break
            kind = type(value)
            if kind in _ATOMIC:
                if length is not None and kind is str and len(value) > length:
                    break
            elif not _plain(value, length):
                break
        else:
            return dict(attributes)
    return BoundedAttributes(count, attributes, immutable=True, max_value_len=length)


def _is_random(flags: int) -> bool:
    return bool(flags & _RANDOM_TRACE_ID)


def _parents_first(calls: Sequence[ModuleCall]) -> Sequence[ModuleCall]:
    """The provider assigns ids as spans start, so a parent must start before its children. Forwards' columns are in
    that order already (a call's parent is an earlier call of its forward, or outside the batch)."""
    if isinstance(calls, Calls) and all(isinstance(segment, CallBatch) for segment in calls.segments):
        return calls
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


class _FinishedSpans:
    """Hands finished spans straight to an SDK tracer's span processors: the sampler asked as ``start_span`` would
    ask it, the span limits applied, torchtrace's ids kept; no ``start_span``/``end`` machinery per call (~6x
    cheaper). Only for an SDK tracer whose processors do nothing when a span starts or is ending (the SDK's batch
    and simple processors): anything else needs a live span, and gets one from the ``start_span`` path. Where
    children follow their parent's decision (``ParentBased`` with its default delegates, the SDK's default), a
    whole forward's columns become spans directly: one sampler call at its root, no ``ModuleCall`` made, and the
    records and summary keep reading columns."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.scope = tracer._instrumentation_scope
        sampler = tracer.sampler
        # ParentBased with its default delegates: a child takes its parent's decision (what the SDK's would be)
        self.children_follow_parent = (
            isinstance(sampler, ParentBased)
            and sampler._local_parent_sampled is ALWAYS_ON
            and sampler._local_parent_not_sampled is ALWAYS_OFF
        )

    @staticmethod
    def usable(tracer: Any) -> bool:
        """Whether ``tracer`` (now: processors may be added later) takes finished spans this way."""
        if not isinstance(tracer, SdkTracer) or not all(hasattr(tracer, name) for name in _TRACER_FIELDS):
            return False
        enabled = getattr(tracer, "_is_enabled", None)
        if enabled is not None and not enabled():
            return False  # a disabled tracer: start_span makes non-recording spans, as it should
        return all(
            type(processor).on_start in _NO_OP_ON_START
            and getattr(type(processor), "_on_ending", None) in _NO_OP_ON_ENDING
            for processor in _processors(tracer.span_processor)
        )

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        made: dict[int, tuple[SpanContext, bool]] = {}  # our span id -> (its context, recorded)
        if self.children_follow_parent and isinstance(calls, Calls):
            rest: list[ModuleCall] = []
            for segment in calls.segments:
                if (
                    isinstance(segment, CallBatch)
                    and not segment.made
                    and segment.lo == 0 == segment.hi - len(segment.module)
                ):
                    self._forward(segment)  # a whole forward's columns: no ModuleCall made
                else:
                    rest.extend(segment)
            calls = rest
        for call in calls:  # parents come before their children in every batch
            parent = made.get(call.parent_span_id)
            if parent is not None and self.children_follow_parent:
                parent_context, recording = parent
                flags, trace_state, attributes = parent_context.trace_flags, parent_context.trace_state, call.attributes
            else:
                parent_context = (
                    parent[0]
                    if parent is not None
                    else self._outside_parent(call.trace_id, call.parent_span_id, call.trace_flags, call.trace_state)
                )
                recording, flags, trace_state, attributes = self._decide(
                    parent_context, call.trace_id, call.name, call.attributes
                )
            span_context = SpanContext(call.trace_id, call.span_id, False, flags, trace_state)
            made[call.span_id] = (span_context, recording)
            call.trace_flags = int(flags)  # sampled out by the provider: no exemplar may link it
            if recording:
                self._end(call.name, span_context, parent_context, attributes, call.error, call.start_ns, call.end_ns)

    def _forward(self, batch: CallBatch) -> None:
        """One forward from its columns: the root decides (children follow it), every call becomes a span."""
        span_ids, trace_id = batch.span_id, batch.trace_id
        root_parent = self._outside_parent(trace_id, batch.root_parent_id, batch.trace_flags, batch.trace_state)
        recording, flags, trace_state, root_attributes = self._decide(
            root_parent, trace_id, batch.span_name(0), batch.span_attributes(0)
        )
        batch.trace_flags = int(flags)  # every call of the forward: sampled out by the provider, no exemplar link
        if not recording:
            return
        contexts: list[SpanContext] = []
        modules, forward = batch.modules, batch.kind == "forward"
        for position, index, _, parent, _, start, end in batch.rows():
            span_context = SpanContext(trace_id, span_ids[position], False, flags, trace_state)
            contexts.append(span_context)
            attributes = root_attributes if position == 0 else batch.span_attributes(position)
            parent_context = contexts[parent] if parent >= 0 else root_parent
            info = modules[index]
            name = (info.path or info.type_name) if forward else batch.span_name(position)
            self._end(name, span_context, parent_context, attributes, batch.error(position), start, end)

    @staticmethod
    def _outside_parent(trace_id: int, parent_span_id: int, trace_flags: int, trace_state: Any) -> SpanContext | None:
        """The context of a parent outside the batch (the caller's request span), as a remote one."""
        if not parent_span_id:
            return None
        return SpanContext(trace_id, parent_span_id, is_remote=True, trace_flags=TraceFlags(trace_flags),
                           trace_state=trace_state)  # fmt: skip

    def _decide(self, parent_context: SpanContext | None, trace_id: int, name: str, attributes: Any) -> tuple:
        """(recording, flags, trace state, attributes) as the tracer's sampler decides for a span to start."""
        tracer = self.tracer
        context = Context() if parent_context is None else set_span_in_context(NonRecordingSpan(parent_context))
        result = tracer.sampler.should_sample(context, trace_id, name, SpanKind.INTERNAL, attributes, ())
        flags = _SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED
        if parent_context is None:
            random_trace_id = tracer.id_generator.is_trace_id_random()
        else:
            random_trace_id = _is_random(parent_context.trace_flags)
        if random_trace_id:
            flags = TraceFlags(flags | _RANDOM_TRACE_ID)
        if result.attributes is not None and result.attributes is not attributes:
            attributes = dict(result.attributes)
        return result.decision.is_recording(), flags, result.trace_state, attributes

    def _end(self, name: str, span_context: SpanContext, parent_context: SpanContext | None, attributes: Any,
             error: BaseException | None, start_ns: int, end_ns: int) -> None:  # fmt: skip
        tracer = self.tracer
        limits = tracer._span_limits
        events: Any = ()
        status = _UNSET
        if error is not None:
            # what record_exception(escaped=True) adds, without its unguarded str(error)
            event_attributes = {**exception_event_attributes(error), "exception.escaped": "True"}
            bounded = BoundedAttributes(
                limits.max_event_attributes, event_attributes, max_value_len=limits.max_attribute_length
            )
            events = BoundedList(limits.max_events)  # 0: the event is dropped and counted, as the SDK does
            events.append(Event("exception", bounded, end_ns))
            status = Status(StatusCode.ERROR, error_text(error))
        tracer.span_processor.on_end(
            ReadableSpan(
                name,
                span_context,
                parent_context,
                tracer.resource,
                _within_limits(attributes, limits),
                events,
                (),
                SpanKind.INTERNAL,
                None,
                status,
                start_ns,
                end_ns,
                self.scope,
            )
        )


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
        self._finished: _FinishedSpans | None = None

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        if _FinishedSpans.usable(self.tracer):
            if self._finished is None:
                self._finished = _FinishedSpans(self.tracer)
            self._finished(_parents_first(calls))
            return
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
