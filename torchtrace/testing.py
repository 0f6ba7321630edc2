"""Testing helpers: trace a model into memory and look at the spans it produced.

Like ``structlog.testing.capture_logs``::

    from torchtrace.testing import capture_spans

    with capture_spans(model, stats=("mean",)) as captured:
        model(x)
    assert captured.tree() == {"Net": {"linear_1": {}, "relu": {}}}
    assert captured.span("linear_1").attributes["torchtrace.output.mean"] == pytest.approx(1.2)

Spans go to a private ``TracerProvider`` (``SimpleSpanProcessor`` into an ``InMemorySpanExporter``); the global
provider is never touched. The instrumentation is removed when the ``with`` block ends; the captured spans stay
readable afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from torchtrace._handle import TraceHandle, instrument

__all__ = ["CapturedSpans", "SpanTree", "capture_spans"]

# {span name: {child name: {...}}}; a repeated sibling name gets a "#2", "#3", ... suffix in call order.
SpanTree = dict[str, "SpanTree"]


class CapturedSpans:
    """What :func:`capture_spans` yields: the handle, the private provider, and the spans it finished."""

    def __init__(self, handle: TraceHandle, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
        self.handle = handle
        self.tracer_provider = provider
        self.exporter = exporter
        # A tracer of the same provider: spans started with it (``with captured.tracer.start_as_current_span(...)``)
        # are captured too, and the model's spans nest under them.
        self.tracer: trace.Tracer = provider.get_tracer("torchtrace.testing")

    def spans(self) -> list[ReadableSpan]:
        """Every finished span so far (after a flush), in the order they ended."""
        if not self.handle._removed:
            self.handle.flush()
        return list(self.exporter.get_finished_spans())

    def span(self, name: str) -> ReadableSpan:
        """The one span called ``name``; fails if there is none or more than one."""
        found = [span for span in self.spans() if span.name == name]
        assert len(found) == 1, f"expected exactly one span named {name!r}, found {len(found)}: {self.names()}"
        return found[0]

    def spans_named(self, name: str) -> list[ReadableSpan]:
        """Every span called ``name``, in start order."""
        return sorted((span for span in self.spans() if span.name == name), key=lambda span: span.start_time or 0)

    def names(self) -> list[str]:
        """Span names in start order."""
        return [span.name for span in sorted(self.spans(), key=lambda span: span.start_time or 0)]

    def tree(self) -> SpanTree:
        """Span names nested by parent: ``{"Net": {"linear_1": {}, "relu": {}}}``.

        Roots are spans whose parent was not captured (none, or a span of another provider). Siblings appear in
        start order; when a name repeats among siblings the later ones are keyed ``"name#2"``, ``"name#3"``...
        """
        spans = sorted(self.spans(), key=lambda span: span.start_time or 0)
        known = {span.context.span_id for span in spans}
        children: dict[int | None, list[ReadableSpan]] = {}
        for span in spans:
            parent = span.parent.span_id if span.parent is not None and span.parent.span_id in known else None
            children.setdefault(parent, []).append(span)

        def build(parent: int | None) -> SpanTree:
            level: SpanTree = {}
            counts: dict[str, int] = {}
            for span in children.get(parent, []):
                counts[span.name] = counts.get(span.name, 0) + 1
                key = span.name if counts[span.name] == 1 else f"{span.name}#{counts[span.name]}"
                level[key] = build(span.context.span_id)
            return level

        return build(None)

    def clear(self) -> None:
        """Forget the spans finished so far (and the handle's in-memory records)."""
        self.spans()
        self.exporter.clear()
        self.handle.clear_recorded_data()


@contextlib.contextmanager
def capture_spans(model: torch.nn.Module, **instrument_options: Any) -> Iterator[CapturedSpans]:
    """Instrument ``model`` with a private in-memory SDK provider; remove the instrumentation on exit.

    ``instrument_options`` are passed to :func:`torchtrace.instrument` (``stats=``, ``inputs=``, ``include=``...);
    ``exporter`` and ``tracer_provider`` are chosen here.
    """
    for reserved in ("exporter", "tracer_provider"):
        if reserved in instrument_options:
            raise TypeError(f"capture_spans() sets {reserved} itself")
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)  # no atexit hook keeping every test's spans alive
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handle = instrument(model, exporter="sdk", tracer_provider=provider, **instrument_options)
    captured = CapturedSpans(handle, provider, exporter)
    try:
        yield captured
    finally:
        handle.remove()
