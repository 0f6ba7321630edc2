"""``torchtrace perfetto``: trace files as Chrome trace-event JSON, which ui.perfetto.dev and chrome://tracing open.

Each span is a complete ("X") slice; a process per service and rank (its "M" ``process_name``), a thread per trace
(or per the span's ``thread.id`` attribute when it has one), so a forward's module spans nest as they do in Jaeger.
Spans that overlap a sibling (a module's backward spans can) go on a further thread of the trace, nested there.
Times are microseconds from the first span's start (whole second), kept in ``otherData.time_origin_unix_ns``;
attributes (the statistics), ids and an error's message are the slice's args. Written as the spans are read: memory
does not grow with the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any, TextIO

from torchtrace._core.files import replaced_when_complete
from torchtrace._offline.reader import Span, TraceReader, file_command

__all__ = ["write_perfetto", "perfetto_command"]

_THREAD_KEY = "thread.id"
_RECENT_GROUPS = 1 << 12  # traces (or threads) whose tracks are kept: a trace's spans come in one or a few lines
_MAX_TRACKS = 16  # per trace


def _arg(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list):
        return [_arg(item) for item in value]
    if isinstance(value, dict):
        return {key: _arg(item) for key, item in value.items()}
    return value


class _Lanes:
    """The tracks (Perfetto threads) of one trace: a span goes on the first track where it nests under its parent
    as a viewer nests slices (inside the innermost open slice, which is its parent); a span that overlaps a sibling
    (module backward spans can) opens another track, where it and its descendants nest again."""

    __slots__ = ("stacks", "placed")

    def __init__(self) -> None:
        self.stacks: list[list[tuple[str, int]]] = []  # per track: open (span id, end) slices, innermost last
        self.placed: dict[str, int] = {}  # span id -> track

    def place(self, span: Span) -> int:
        parent_track = self.placed.get(span.parent_span_id)
        order = range(len(self.stacks)) if parent_track is None else [parent_track, *range(len(self.stacks))]
        for track in order:
            stack = self.stacks[track]
            while stack and stack[-1][1] <= span.start_ns:
                stack.pop()
            top = stack[-1] if stack else None
            fits = (top is None and parent_track != track) or (
                top is not None and top[0] == span.parent_span_id and span.end_ns <= top[1]
            )
            if fits:
                break
        else:
            track = len(self.stacks)
            self.stacks.append([])
        self.stacks[track].append((span.span_id, span.end_ns))
        self.placed[span.span_id] = track
        return track


class _ChromeTraceWriter:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.origin_ns: int | None = None
        self.processes: dict[tuple[str, int | None], int] = {}
        self.lanes: dict[tuple[int, str], _Lanes] = {}  # (pid, thread or trace): recent ones, bounded
        self.named_threads: set[tuple[int, int]] = set()
        self.events = 0
        out.write('{"traceEvents":[\n')

    def _event(self, event: dict[str, Any]) -> None:
        if self.events:
            self.out.write(",\n")
        self.out.write(json.dumps(event, separators=(",", ":"), allow_nan=False))
        self.events += 1

    def _pid(self, span: Span) -> int:
        key = (span.service, span.rank)
        pid = self.processes.get(key)
        if pid is None:
            pid = self.processes[key] = len(self.processes) + 1
            name = span.service if span.rank is None else f"{span.service} rank {span.rank}"
            self._event({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            order = span.rank if span.rank is not None else pid
            self._event({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": order}})
        return pid

    def _tid(self, pid: int, span: Span) -> int:
        thread = span.attributes.get(_THREAD_KEY)
        group = f"thread {thread}" if isinstance(thread, int) else f"trace {span.trace_id}"
        lanes = self.lanes.pop((pid, group), None) or _Lanes()
        self.lanes[(pid, group)] = lanes  # most recent last
        if len(self.lanes) > _RECENT_GROUPS:
            del self.lanes[next(iter(self.lanes))]
        track = lanes.place(span)
        base = thread if isinstance(thread, int) else int(span.trace_id[-6:] or "0", 16)
        tid = base * _MAX_TRACKS + min(track, _MAX_TRACKS - 1) + 1
        if (pid, tid) not in self.named_threads:
            if len(self.named_threads) > _RECENT_GROUPS * 4:
                self.named_threads.clear()  # a repeated name is harmless, only redundant
            self.named_threads.add((pid, tid))
            name = group if track == 0 else f"{group} ({track + 1})"
            self._event({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        return tid

    def batch(self, spans: list[Span]) -> None:
        for span in sorted(spans, key=lambda span: (span.start_ns, -span.end_ns)):
            self.span(span)

    def span(self, span: Span) -> None:
        if self.origin_ns is None:
            self.origin_ns = span.start_ns - span.start_ns % 1_000_000_000
        pid = self._pid(span)
        tid = self._tid(pid, span)
        args: dict[str, Any] = {key: _arg(value) for key, value in span.attributes.items()}
        args["trace_id"] = span.trace_id
        args["span_id"] = span.span_id
        if span.parent_span_id:
            args["parent_span_id"] = span.parent_span_id
        if span.error is not None:
            args["error"] = span.error or "error"
        self._event(
            {
                "ph": "X",
                "name": span.name,
                "cat": span.scope or "otlp",
                "pid": pid,
                "tid": tid,
                "ts": (span.start_ns - self.origin_ns) / 1000,
                "dur": (span.end_ns - span.start_ns) / 1000,
                "args": args,
            }
        )

    def close(self) -> None:
        other = {"time_origin_unix_ns": self.origin_ns or 0, "producer": "torchtrace perfetto"}
        self.out.write('\n],"displayTimeUnit":"ns","otherData":' + json.dumps(other) + "}\n")


def write_perfetto(reader: TraceReader, output: str | os.PathLike[str]) -> int:
    """Writes every span ``reader`` yields to ``output`` (replaced only once complete); returns the span count."""
    spans = 0
    with replaced_when_complete(output) as partial:
        with open(partial, "w", encoding="utf-8") as out:
            writer = _ChromeTraceWriter(out)
            for batch in reader.batches():
                writer.batch(batch)
                spans += len(batch)
            writer.close()
        if spans == 0:
            raise reader.nothing_read()
    return spans


def perfetto_command(traces: Sequence[str], output: str) -> int:
    """``torchtrace perfetto``: returns the exit status; messages on stderr."""

    def convert() -> tuple[TraceReader, str]:
        reader = TraceReader(traces)
        spans = write_perfetto(reader, output)
        return (
            reader,
            f"{spans} spans from {len(reader.parts)} file(s) written to {output} (open it in https://ui.perfetto.dev)",
        )

    return file_command("perfetto", convert)
