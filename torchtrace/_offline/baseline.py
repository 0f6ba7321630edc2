"""``torchtrace baseline``: a ``Baseline`` from trace files (the file exporter's OTLP JSON lines)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence

from torchtrace._core.baseline import Baseline, BaselineBuilder, BaselineError
from torchtrace._core.calls import call_name
from torchtrace._offline.reader import Span, TraceFileError, TraceReader, file_command
from torchtrace.attributes import MODULE_PATH, MODULE_TYPE

__all__ = ["baseline_command", "baseline_from_spans"]

_SEEN_SPANS = 1 << 16  # forward span ids -> their model, for the spans nested in them (one forward: one line)


def baseline_from_spans(spans: Iterable[Span], model: str | None = None, source: str = "") -> Baseline:
    """A baseline of the forward spans of one model: ``model`` (a class name) where the spans hold several.

    Each forward span belongs to the model whose root span (module path "") it is nested in: two models traced
    in one request's trace are kept apart."""
    builders: dict[str, BaselineBuilder] = {}
    model_of: dict[str, str] = {}  # span id -> its model's class, insertion-ordered, bounded
    for span in spans:
        path, kind = span.attributes.get(MODULE_PATH), span.attributes.get(MODULE_TYPE)
        if not span.torchtrace or not isinstance(path, str) or not isinstance(kind, str):
            continue
        if span.name != call_name(path, kind, "forward"):
            continue  # a module's backward span
        owner = kind if path == "" else model_of.get(span.parent_span_id)
        if owner is None:
            continue  # its model's root span was not read (a file cut at a forward's start)
        model_of[span.span_id] = owner
        if len(model_of) > _SEEN_SPANS:
            del model_of[next(iter(model_of))]
        builder = builders.get(owner)
        if builder is None:
            builder = builders[owner] = BaselineBuilder()
        builder.add(path, kind, span.attributes)
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
    return chosen.build(source=source, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


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
