"""``torchtrace baseline``: a ``Baseline`` from trace files (the file exporter's OTLP JSON lines)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torchtrace._core.baseline import Baseline, BaselineBuilder, BaselineError
from torchtrace._core.calls import call_name
from torchtrace._offline.reader import Span, TraceFileError, TraceReader, file_command
from torchtrace.attributes import MODULE_PATH, MODULE_TYPE

__all__ = ["ForwardSpan", "ForwardSpans", "baseline_command", "baseline_from_spans"]

_SEEN_SPANS = 1 << 16  # forward span ids -> their model, for the spans nested in them (one forward: one line)


@dataclass(frozen=True, slots=True)
class ForwardSpan:
    """A module's forward span and the model it belongs to: ``model`` is the class of the root span (module path
    "") it is nested in, ``root`` that span's id."""

    span: Span
    path: str
    kind: str
    model: str
    root: str


class ForwardSpans:
    """Tells the forward spans of a stream of spans, in file order, with the model each belongs to: two models
    traced in one request's trace are kept apart. ``forward(span)`` is None for other spans (a module's backward,
    a step, another producer's) and for a forward whose root span was not read (a file cut at a forward's start)."""

    def __init__(self) -> None:
        self._owner: dict[str, tuple[str, str]] = {}  # span id -> its model's class and root id; ordered, bounded

    def forward(self, span: Span) -> ForwardSpan | None:
        path, kind = span.attributes.get(MODULE_PATH), span.attributes.get(MODULE_TYPE)
        if not span.torchtrace or not isinstance(path, str) or not isinstance(kind, str):
            return None
        if span.name != call_name(path, kind, "forward"):
            return None  # a module's backward span
        owner = (kind, span.span_id) if path == "" else self._owner.get(span.parent_span_id)
        if owner is None:
            return None
        self._owner[span.span_id] = owner
        if len(self._owner) > _SEEN_SPANS:
            del self._owner[next(iter(self._owner))]
        return ForwardSpan(span, path, kind, *owner)


def baseline_from_spans(spans: Iterable[Span], model: str | None = None, source: str = "") -> Baseline:
    """A baseline of the forward spans of one model: ``model`` (a class name) where the spans hold several.

    Each forward span belongs to the model whose root span (module path "") it is nested in (``ForwardSpans``)."""
    builders: dict[str, BaselineBuilder] = {}
    forwards = ForwardSpans()
    for span in spans:
        found = forwards.forward(span)
        if found is None:
            continue
        builder = builders.get(found.model)
        if builder is None:
            builder = builders[found.model] = BaselineBuilder()
        builder.add(found.path, found.kind, span.attributes)
    if model is not None:
        if model not in builders:
            found = ", ".join(sorted(builders)) or "none"
            raise BaselineError(f"no forward of a {model} in the trace files (models found: {found})")
        chosen = builders[model]
    elif len(builders) > 1:
        found = ", ".join(f"{name} ({builder.models[name]} forwards)" for name, builder in sorted(builders.items()))
        raise BaselineError(f"the trace files hold forwards of several models: {found}; choose one with --model")
    elif builders:
        chosen = next(iter(builders.values()))
    else:
        raise BaselineError('no forward spans of a model (a root span with module path "") in the trace files')
    return chosen.build(source=source)


def baseline_command(traces: Sequence[str], output: str | os.PathLike[str], model: str | None) -> int:
    """``torchtrace baseline``: returns the exit status; messages on stderr."""

    def make() -> tuple[TraceReader, str]:
        reader = TraceReader(traces)
        try:
            baseline = baseline_from_spans(reader, model, source=", ".join(map(str, traces)))
        except BaselineError as error:
            if not reader.torchtrace_spans:
                raise reader.nothing_read("torchtrace spans") from None
            raise TraceFileError(str(error)) from None
        baseline.save(output)
        scored = len({path for path, _ in baseline.references})
        return reader, (
            f"baseline of {baseline.model} written to {output}: {scored} layers, {baseline.forwards} forwards "
            f"(fingerprint {baseline.fingerprint})"
        )

    return file_command("baseline", make)
