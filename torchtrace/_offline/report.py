"""``torchtrace report``: one self-contained HTML file from trace files (every script and style inline, no network).

One streaming pass aggregates what the page shows: the overview, the per-layer table (``SummarySink``, the numbers
of ``handle.summary()``), per forward / step a column of activation statistics per layer (down-sampled past
``MAX_COLUMNS``), NaN/Inf provenance, and the spans of a few chosen traces (the slowest, a typical one, those with
an error or NaN/Inf, up to a cap) for the timeline. Traces being read are kept per trace until they fall out of a
small window of recent traces, so memory is bounded by the window, the columns and the chosen traces. With
several ranks, whose spans of one step share its trace but may be in different files, the chosen traces' spans
are read again from every file (lines naming none of them are skipped unparsed), so a step shows every rank. A
training step is drawn as lanes per rank (step, forward, backward, optimizer, all-reduce), a forward nested.
Charts are drawn by uPlot (vendored, MIT; see _vendor/uplot/VERSION) and small canvas / SVG code here.

With a baseline (``--baseline``), the forward spans of the baseline's model are scored against it in file order
(``DriftScorer.observe``, a scorer per rank as each process has its own at run time): the per-layer table and the
heatmap mark the layers and forwards over the alert threshold, and the overview names the first drifted layer.
"""

from __future__ import annotations

import bisect
import html
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from torchtrace._core.baseline import Baseline, BaselineError
from torchtrace._core.calls import DATA_WAIT
from torchtrace._core.files import replaced_when_complete
from torchtrace._offline.baseline import ForwardSpans
from torchtrace._offline.reader import (
    Span,
    TraceFileError,
    TraceReader,
    file_command,
    summary_from_spans,
)
from torchtrace._sinks.drift import DriftScorer
from torchtrace.attributes import COMM_BUCKET, GRAD_OUTPUT_PREFIX, MODULE_PATH, MODULE_TYPE, OUTPUT_PREFIX, STEP

__all__ = ["write_report", "report_command"]

MAX_COLUMNS = 2000  # forwards / steps in the heatmap and line charts; past it, every other column is dropped
_OPEN_TRACES = 64  # traces still collecting spans (a trace's spans come in one or a few lines)
_CHOSEN_CAP = 20  # traces with an error or NaN/Inf kept for the timeline
_STATS = {  # the heatmap's choices: attribute, span kind
    "abs_max": f"{OUTPUT_PREFIX}.abs_max",
    "std": f"{OUTPUT_PREFIX}.std",
    "zero_fraction": f"{OUTPUT_PREFIX}.zero_fraction",
    "grad_norm": f"{GRAD_OUTPUT_PREFIX}.norm",
}
_PATH_KEY = MODULE_PATH
_RECENT_ROOTS = 1024  # root span id -> its start, for the place of its layers' calls in their forward


def _nonfinite(span: Span) -> bool:
    attributes = span.attributes
    return any(
        (attributes.get(f"torchtrace.{tensor}.nan_count") or 0) > 0
        or (attributes.get(f"torchtrace.{tensor}.inf_count") or 0) > 0
        for tensor in ("output", "grad_output")
    )


def _layer(span: Span) -> str | None:
    path = span.attributes.get(_PATH_KEY)
    if not isinstance(path, str):
        return None
    return path or str(span.attributes.get(MODULE_TYPE, span.name))


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) else None
    return None


class _Drift:
    """The drift of each layer of the baseline's model, scored from its forward spans in file order."""

    def __init__(self, baseline: Baseline) -> None:
        self.baseline = baseline
        self.forward_spans = ForwardSpans()
        self.scorers: dict[int | None, DriftScorer] = {}  # per rank: each process scores its own calls
        self.over: dict[str, float] = {}  # span id -> its score, for spans at 1.0 or above until their trace ends
        self.layers: dict[str, dict[str, Any]] = {}  # path -> latest and highest score, when it first went over
        self.models: set[str] = set()  # every model (root span class) found
        self.forwards = 0  # of the baseline's model
        self.first: dict[str, Any] | None = None  # the first drifted layer when it first happened
        self._first_root: str | None = None
        self._first_place = (0, 0)
        self._roots: dict[str, int] = {}  # root span id -> start ns, recent ones
        self._place: dict[tuple[int | None, str], tuple[int, int]] = {}  # its call's end in its latest forward
        self._seen = 0

    def add(self, span: Span) -> None:
        found = self.forward_spans.forward(span)
        if found is None:
            return
        self._seen += 1
        if found.path == "":
            self.models.add(found.model)
            if found.model == self.baseline.model:
                self.forwards += 1
                self._roots[span.span_id] = span.start_ns
                if len(self._roots) > _RECENT_ROOTS:
                    del self._roots[next(iter(self._roots))]
        if found.model != self.baseline.model:  # loosely the baseline's model: the same class
            return
        rank = span.rank
        scorer = self.scorers.get(rank)
        if scorer is None:
            scorer = self.scorers[rank] = DriftScorer(self.baseline)
        scores = scorer.observe(found.path, span.attributes, span.end_ns)
        if not scores:
            return
        statistic, score = max(scores.items(), key=lambda item: item[1])
        # a call ends after the calls nested in it: its end in its forward is its place in execution order; at
        # an equal end, the later span in the file (nested) finished first
        place = (span.end_ns - self._roots.get(found.root, span.start_ns), -self._seen)
        self._place[(rank, found.path)] = place
        layer = self.layers.get(found.path)
        if layer is None:
            layer = self.layers[found.path] = {"type": found.kind, "latest": 0.0, "max": 0.0, "over": None}
        layer["latest"] = round(score, 4)
        layer["max"] = max(layer["max"], round(score, 4))
        if score < 1.0:
            return
        self.over[span.span_id] = score
        event = {"module": found.path, "statistic": statistic, "score": round(score, 4), "since_ns": span.end_ns,
                 "rank": rank}  # fmt: skip
        if layer["over"] is None:
            layer["over"] = event
        # the first forward with a layer over the threshold: its earliest call to finish over it
        if self.first is None or (found.root == self._first_root and place < self._first_place):
            self.first, self._first_root, self._first_place = event, found.root, place

    def page(self) -> dict[str, Any]:
        """The page's drift data: the baseline, each scored layer, the first drifted layer when it first
        happened, and of those over the threshold at the end of the files the earliest in execution order."""
        over = [(rank, layer) for rank, scorer in self.scorers.items() for layer in scorer.status().drifted]
        now = None
        if over:  # DriftScorer.status().first orders by the sink's forwards; observe() feeds it none
            rank, layer = min(over, key=lambda item: (self._place.get((item[0], item[1].module), (1 << 62, 0)),
                                                      -item[1].score))  # fmt: skip
            since = None if layer.since is None else round(layer.since * 1e9)
            now = {"module": layer.module, "statistic": layer.statistic, "score": round(layer.score, 4),
                   "since_ns": since, "rank": rank}  # fmt: skip
        baseline = self.baseline
        return {
            "baseline": {"model": baseline.model, "forwards": baseline.forwards, "source": baseline.source,
                         "fingerprint": baseline.fingerprint, "layers": len({path for path, _ in baseline.references})},
            "models_found": sorted(self.models),
            "forwards": self.forwards,
            "layers": self.layers,
            "first": self.first,
            "first_now": now,
        }  # fmt: skip


class _ReportData:
    def __init__(self, drift: _Drift | None = None) -> None:
        self.drift = drift
        self.open: dict[str, list[Span]] = {}
        self.layers: dict[str, int] = {}  # layer -> row, in first-seen order
        self.columns: list[dict[str, Any]] = []  # per kept forward / step: label, values per stat, NaN layers
        self.stride = 1  # every stride-th finished trace is a column
        self.finished = 0
        self.durations: list[float] = []  # sorted reservoir for the typical trace (bounded by down-sampling too)
        self.slowest: tuple[float, list[Span]] | None = None
        self.typical: tuple[float, list[Span]] | None = None
        self.flagged: list[list[Span]] = []
        self.provenance: list[dict[str, Any]] = []
        self.flagged_total = 0
        self.services: set[str] = set()
        self.ranks: set[int] = set()
        self.models: set[str] = set()
        self.forwards = 0
        self.steps = 0
        self.errors = 0
        self.start_ns: int | None = None
        self.end_ns: int | None = None

    def add(self, span: Span) -> None:
        self.services.add(span.service)
        if span.rank is not None:
            self.ranks.add(span.rank)
        self.start_ns = span.start_ns if self.start_ns is None else min(self.start_ns, span.start_ns)
        self.end_ns = span.end_ns if self.end_ns is None else max(self.end_ns, span.end_ns)
        if span.error is not None:
            self.errors += 1
        if not span.torchtrace:
            return
        if self.drift is not None:
            self.drift.add(span)
        trace = self.open.pop(span.trace_id, None) or []
        trace.append(span)
        self.open[span.trace_id] = trace  # most recent last
        if len(self.open) > _OPEN_TRACES:
            self._finish(self.open.pop(next(iter(self.open))))

    def close(self) -> None:
        for trace in self.open.values():
            self._finish(trace)
        self.open.clear()

    def _finish(self, spans: list[Span]) -> None:
        spans.sort(key=lambda span: (span.start_ns, -span.end_ns))
        over = self.drift.over if self.drift is not None else {}
        drifted = {span.span_id: over.pop(span.span_id) for span in spans if span.span_id in over}
        roots = [span for span in spans if span.attributes.get(_PATH_KEY) == "" and not span.name.endswith(" backward")]
        step = next((span for span in spans if span.name == "train_step"), None)
        self.forwards += len(roots)
        self.steps += step is not None
        self.models.update(_layer(root) or root.name for root in roots)
        duration = (max(span.end_ns for span in spans) - spans[0].start_ns) / 1e6
        index = self.finished
        self.finished += 1
        self._choose(duration, spans)
        if index % self.stride == 0:
            self._column(index, step, spans, drifted)
            if len(self.columns) > MAX_COLUMNS:
                self.columns = self.columns[::2]
                self.stride *= 2

    def _choose(self, duration: float, spans: list[Span]) -> None:
        if self.slowest is None or duration > self.slowest[0]:
            self.slowest = (duration, spans)
        bisect.insort(self.durations, duration)
        if len(self.durations) > 2 * MAX_COLUMNS:
            self.durations = self.durations[::2]
        median = self.durations[len(self.durations) // 2]
        if self.typical is None or abs(duration - median) < abs(self.typical[0] - median):
            self.typical = (duration, spans)
        bad = [span for span in spans if _nonfinite(span)]
        if bad or any(span.error is not None for span in spans):
            self.flagged_total += 1
            if len(self.flagged) < _CHOSEN_CAP:
                self.flagged.append(spans)
            if bad:
                first = min(bad, key=lambda span: (span.end_ns, span.start_ns))  # children end before parents
                self.provenance.append(
                    {
                        "trace": spans[0].trace_id,
                        "column": self.finished - 1,
                        "module": _layer(first) or first.name,
                        "span": first.span_id,
                        "message": first.error or "",
                        "in_timeline": len(self.flagged) <= _CHOSEN_CAP and self.flagged[-1] is spans,
                    }
                )
                del self.provenance[: -_CHOSEN_CAP * 10]

    def _column(self, index: int, step: Span | None, spans: list[Span], drifted: dict[str, float]) -> None:
        values: dict[str, dict[int, float]] = {stat: {} for stat in _STATS}
        nonfinite: list[int] = []
        drift: dict[int, float] = {}  # row -> the highest drift score of its calls, those at 1.0 or above
        for span in spans:
            layer = _layer(span)
            if layer is None:
                continue
            row = self.layers.setdefault(layer.removesuffix(" backward"), len(self.layers))
            for stat, key in _STATS.items():
                value = _number(span.attributes.get(key))
                if value is not None:
                    values[stat][row] = value
            if _nonfinite(span):
                nonfinite.append(row)
            if span.span_id in drifted:
                drift[row] = max(drift.get(row, 0.0), round(drifted[span.span_id], 3))
        label = f"step {step.attributes.get(STEP)}" if step is not None else f"#{index}"
        column = {"label": label, "values": values, "nonfinite": sorted(set(nonfinite))}
        if drift:
            column["drift"] = drift
        self.columns.append(column)

    def timeline(self, parts: Sequence[Path]) -> list[dict[str, Any]]:
        chosen: dict[str, tuple[str, list[Span]]] = {}  # trace id -> why, spans
        for why, spans in [
            *([("slowest", self.slowest[1])] if self.slowest is not None else []),
            *([("typical", self.typical[1])] if self.typical is not None else []),
            *(("error / NaN", spans) for spans in self.flagged),
        ]:
            chosen.setdefault(spans[0].trace_id, (why, spans))
        if len(self.ranks) > 1 and chosen:
            # the ranks of one step share its trace, and may be in several files read one after the other: read
            # the chosen traces' spans again, every rank's (a line naming none of them is skipped unparsed)
            gathered: dict[str, list[Span]] = {trace: [] for trace in chosen}
            for span in TraceReader(parts, progress=False, traces=chosen):
                if span.torchtrace:
                    gathered[span.trace_id].append(span)
            for trace, spans in gathered.items():
                if spans:
                    spans.sort(key=lambda span: (span.start_ns, -span.end_ns))
                    chosen[trace] = (chosen[trace][0], spans)
        return [_timeline_trace(why, spans) for why, spans in chosen.values()]


_STEP_KEY = STEP


def _lanes(spans: list[Span]) -> dict[str, str]:
    """span id -> lane of a training step's trace ("step", "data wait", "forward", "backward", "optimizer",
    "all-reduce", "other"), for its step spans and their children; {} for a trace of forwards only. The nested
    spans (module calls, module backwards) have no lane."""
    steps = {span.span_id: span for span in spans if _STEP_KEY in span.attributes and _PATH_KEY not in span.attributes}
    per_rank = any(span.name != "train_step" for span in steps.values())  # "rank N" under rank 0's train_step
    lanes: dict[str, str] = {}
    for span in spans:
        if span.span_id in steps:
            if not (per_rank and span.name == "train_step"):
                lanes[span.span_id] = "step"
        elif span.parent_span_id in steps:
            if _PATH_KEY in span.attributes:
                lanes[span.span_id] = "forward"  # an outermost forward of the step
            elif span.name == "backward":
                lanes[span.span_id] = "backward"
            elif span.name == DATA_WAIT:
                lanes[span.span_id] = "data wait"
            elif span.name == "optimizer.step":
                lanes[span.span_id] = "optimizer"
            elif COMM_BUCKET in span.attributes:
                lanes[span.span_id] = "all-reduce"
            else:
                lanes[span.span_id] = "other"
    return lanes


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6


def _timeline_trace(why: str, spans: list[Span]) -> dict[str, Any]:
    origin = min(span.start_ns for span in spans)
    lanes = _lanes(spans)
    ranks: list[dict[str, Any]] = []
    if lanes:  # a training step: per rank, its step time and the time its all-reduce buckets took (waiting)
        by_rank: dict[int | None, list[Span]] = {}
        for span in spans:
            if span.span_id in lanes:
                by_rank.setdefault(span.rank, []).append(span)
        for rank in sorted(by_rank, key=lambda rank: -1 if rank is None else rank):
            own = by_rank[rank]
            step = [span for span in own if lanes[span.span_id] == "step"]
            comm = [(span.start_ns, span.end_ns) for span in own if lanes[span.span_id] == "all-reduce"]
            step_ms = sum(span.end_ns - span.start_ns for span in step) / 1e6
            comm_ms = _union_ms(comm)
            ranks.append({"rank": rank, "step_ms": step_ms, "comm_ms": comm_ms, "busy_ms": step_ms - comm_ms})
    return {
        "why": why,
        "trace": spans[0].trace_id,
        "step": next((span.attributes[_STEP_KEY] for span in spans if _STEP_KEY in span.attributes), None),
        "ranks": ranks,
        "spans": [
            {
                "id": span.span_id,
                "parent": span.parent_span_id,
                "name": span.name,
                "rank": span.rank,
                "lane": lanes.get(span.span_id),
                "start": (span.start_ns - origin) / 1e6,
                "ms": (span.end_ns - span.start_ns) / 1e6,
                "bad": _nonfinite(span) or span.error is not None,
            }
            for span in spans
        ],
    }


def _page_data(
    reader: TraceReader, losses: dict[str, int] | None = None, baseline: Baseline | None = None
) -> dict[str, Any]:
    data = _ReportData(_Drift(baseline) if baseline is not None else None)

    def spans() -> Iterator[Span]:
        for span in reader:
            data.add(span)
            yield span

    summary = summary_from_spans(spans())
    data.close()
    if not reader.torchtrace_spans:
        raise reader.nothing_read("torchtrace spans")
    rows = sorted(summary.rows(), key=lambda row: row.total_ms, reverse=True)
    return {
        "overview": {
            "files": [str(part) for part in reader.parts],
            "models": sorted(data.models),
            "services": sorted(data.services),
            "ranks": sorted(data.ranks),
            "start_ns": data.start_ns,
            "end_ns": data.end_ns,
            "forwards": data.forwards,
            "steps": data.steps,
            "spans": reader.spans,
            "torchtrace_spans": reader.torchtrace_spans,
            "error_spans": data.errors,
            "flagged_traces": data.flagged_total,
            "unreadable_lines": reader.bad_lines,
            "losses": losses,  # a live handle's dropped / failed counts; None from files, which do not record them
        },
        "summary": [asdict(row) for row in rows],
        "layers": list(data.layers),
        "columns": data.columns,
        "stride": data.stride,
        "traces_read": data.finished,
        "timeline": data.timeline(reader.parts),
        "provenance": data.provenance,
        "drift": data.drift.page() if data.drift is not None else None,
    }


def _vendored(name: str) -> str:
    return resources.files("torchtrace._offline").joinpath("_vendor", "uplot", name).read_text(encoding="utf-8")


def _page(data: dict[str, Any]) -> str:
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    template = resources.files("torchtrace._offline").joinpath("report_page.html").read_text(encoding="utf-8")
    return (
        template.replace("/*UPLOT_CSS*/", _vendored("uPlot.min.css"))
        .replace("/*UPLOT_JS*/", _vendored("uPlot.iife.min.js").replace("</", "<\\/"))
        .replace("/*DATA*/", payload)
        .replace("<!--TITLE-->", html.escape(", ".join(data["overview"]["models"]) or "torchtrace"))
    )


def write_report(
    traces: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    losses: dict[str, int] | None = None,
    baseline: Baseline | str | os.PathLike[str] | None = None,
) -> TraceReader:
    """Writes the HTML report of ``traces`` to ``output``; returns the reader (what was read, what was not).

    ``losses``: what a live handle lost (``dropped_calls``, ``failed_spans``, ``sink_errors``), shown in the
    overview; trace files do not record these counts, so a report of files alone says so instead.
    ``baseline``: a ``Baseline`` or its file: the layers that drifted from it are marked (``BaselineError`` for a
    file that is not one).
    """
    if baseline is not None and not isinstance(baseline, Baseline):
        baseline = Baseline.load(baseline)  # before reading the traces: a bad file fails at once
    reader = TraceReader(traces)
    page = _page(_page_data(reader, losses, baseline))
    with replaced_when_complete(output) as partial:
        partial.write_text(page, encoding="utf-8")
    return reader


def report_command(traces: Sequence[str], output: str, baseline: str | None = None) -> int:
    """``torchtrace report``: returns the exit status; messages on stderr."""

    def write() -> tuple[TraceReader, str]:
        try:
            reader = write_report(traces, output, baseline=baseline)
        except BaselineError as error:
            raise TraceFileError(str(error)) from None
        return reader, f"report of {reader.spans} spans from {len(reader.parts)} file(s) written to {output}"

    return file_command("report", write)
