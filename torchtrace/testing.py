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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from torchtrace._handle import TraceHandle, instrument

__all__ = ["CapturedSpans", "SpanTree", "capture_spans", "check_traces"]

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

    ``instrument_options`` are passed to :func:`torchtrace.instrument` (``stats=``, ``include=``, ``records=``...);
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


# -- trace validation ----------------------------------------------------------------------------------------------

_FLAG_IS_REMOTE = 0x200  # OTLP Span.flags: the parent is remote
_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("mean", "std", "min", "max", "abs_max", "norm", "zero_fraction", "seconds"), (float,)),
    **dict.fromkeys(("nan_count", "inf_count", "sampled", "step", "rank", "world_size", "bucket", "bytes"), (int,)),
    **dict.fromkeys(("dtype", "device", "stats_error", "path", "type"), (str,)),
    **dict.fromkeys(("truncated", "last"), (bool,)),
    "shape": (list, tuple),
}
_TENSOR_KEYS = frozenset(("shape", "dtype", "device", "mean", "std", "min", "max", "abs_max", "norm"))
_TENSOR_KEYS |= frozenset(("zero_fraction", "nan_count", "inf_count", "sampled", "truncated", "stats_error"))
# torchtrace.<group>...<last>: the documented last parts of each group (a user's statistic, a module attribute:
# any value)
_DOCUMENTED = {
    **dict.fromkeys(("output", "input", "grad_output", "grad_input"), _TENSOR_KEYS),
    "module": frozenset(("path", "type")),
    "param": frozenset(("norm",)),
    "param_grad": frozenset(("norm",)),
    "comm": frozenset(("seconds", "bucket", "bytes", "last")),
    **{name: frozenset((name,)) for name in ("step", "rank", "world_size")},
}


@dataclass(frozen=True)
class _Span:
    name: str
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root
    parent_remote: bool
    start: int
    end: int
    attributes: dict[str, Any]


def _otlp_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_otlp_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _normalised(span: Any) -> _Span:
    """An SDK ``ReadableSpan`` or an OTLP protobuf ``Span`` (what a receiver got) as one neutral record."""
    if isinstance(span, ReadableSpan):
        parent = span.parent
        return _Span(
            span.name,
            span.context.trace_id,
            span.context.span_id,
            parent.span_id if parent is not None else 0,
            bool(parent is not None and parent.is_remote),
            span.start_time or 0,
            span.end_time or 0,
            dict(span.attributes or {}),
        )
    for name, raw, width in (("trace_id", span.trace_id, 16), ("span_id", span.span_id, 8)):
        if len(raw) != width:
            raise AssertionError(f"span {span.name!r}: {name} is {len(raw)} bytes, not {width}")
    if span.parent_span_id and len(span.parent_span_id) != 8:
        raise AssertionError(f"span {span.name!r}: parent_span_id is {len(span.parent_span_id)} bytes, not 8")
    return _Span(
        span.name,
        int.from_bytes(span.trace_id, "big"),
        int.from_bytes(span.span_id, "big"),
        int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else 0,
        bool(span.flags & _FLAG_IS_REMOTE),
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        {kv.key: _otlp_value(kv.value) for kv in span.attributes},
    )


def _attribute_problems(span: _Span) -> Iterator[str]:
    for key, value in span.attributes.items():
        parts = key.split(".")
        if parts[0] != "torchtrace" or len(parts) < 2 or parts[-1] not in _DOCUMENTED.get(parts[1], ()):
            continue
        expected = _TYPES[parts[-1]]
        if not isinstance(value, expected) or (bool not in expected and isinstance(value, bool)):
            yield f"span {span.name!r}: {key} = {value!r} is not {' or '.join(t.__name__ for t in expected)}"


def check_traces(spans: Iterable[Any]) -> None:
    """Asserts that ``spans`` (SDK ``ReadableSpan`` s, or OTLP protobuf ``Span`` s as a receiver got them) are
    well-formed traces, naming every problem found:

    - ids well formed: trace ids of 16 bytes and span ids of 8, none zero, span ids unique;
    - every parent present, in the same trace (a remote parent, e.g. from a ``traceparent`` header or another
      process, may be absent);
    - every span ends after it starts, and within its parent's time (a remote parent's clock is another one);
    - torchtrace's attributes of the types docs/spans.md documents (statistics, counts, paths, steps, ranks).
    """
    records = [_normalised(span) for span in spans]
    problems: list[str] = []
    by_id: dict[int, _Span] = {}
    for span in records:
        if not 0 < span.trace_id < 2**128 or not 0 < span.span_id < 2**64:
            problems.append(f"span {span.name!r}: zero or oversized id ({span.trace_id:x}/{span.span_id:x})")
        seen = by_id.get(span.span_id)
        if seen is not None and (seen.trace_id, seen.name, seen.start, seen.end) == (
            span.trace_id, span.name, span.start, span.end
        ):  # fmt: skip
            continue  # the same span delivered twice (a retried export): one span
        if seen is not None:
            problems.append(f"span {span.name!r}: span id {span.span_id:016x} used twice")
        by_id[span.span_id] = span
        if span.end < span.start:
            problems.append(f"span {span.name!r} ends before it starts")
        problems.extend(_attribute_problems(span))
    for span in records:
        if not span.parent_id:
            continue
        parent = by_id.get(span.parent_id)
        if parent is None:
            if not span.parent_remote:
                problems.append(f"span {span.name!r}: parent {span.parent_id:016x} missing")
        elif parent.trace_id != span.trace_id:
            problems.append(f"span {span.name!r}: parent {parent.name!r} is in another trace")
        elif not span.parent_remote and not parent.start <= span.start <= span.end <= parent.end:
            problems.append(
                f"span {span.name!r} ({span.start}..{span.end}) is outside its parent {parent.name!r} "
                f"({parent.start}..{parent.end}): {parent.start - span.start} ns before, "
                f"{span.end - parent.end} ns after"
            )
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise AssertionError(f"{len(problems)} problem(s) in {len(records)} spans:\n  {shown}{more}")
