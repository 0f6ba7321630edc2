"""Reading the file exporter's OTLP JSON lines back: spans as a stream, in bounded memory.

A trace path is a file, a directory (every ``*.jsonl*`` in it) or a glob. A file named ``traces.jsonl`` brings its
rotated siblings (``traces.jsonl.1``, ``traces-<timestamp>.jsonl``...), and all parts are read oldest first (by
modification time, then name). Each line is one ``ExportTraceServiceRequest`` in OTLP/JSON (protobuf's JSON
mapping: hex ids, int64 as strings, attributes as AnyValue). A line that is not JSON is counted, not fatal: a killed
process leaves a truncated last line. Spans of other producers are read too (``Span.torchtrace`` says which are
torchtrace's).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from torchtrace._core.calls import ModuleCall
from torchtrace._sinks.summary import SummarySink
from torchtrace.attributes import MODULE_PATH, MODULE_TYPE, RANK

__all__ = [
    "Span",
    "TraceFileError",
    "TraceReader",
    "file_command",
    "summary_command",
    "summary_from_spans",
    "trace_parts",
]

_SCOPE = "torchtrace"  # instrumentation scope of torchtrace's spans
_PATH_KEY, _TYPE_KEY = MODULE_PATH, MODULE_TYPE
_STATUS_ERROR = 2


class TraceFileError(Exception):
    """No readable trace data at the given paths: the message says why, for the command line."""


@dataclass(slots=True)
class Span:
    """One span of a trace file, its AnyValue attributes decoded to Python values."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]  # shared by the spans of one resource
    scope: str
    error: str | None  # the status message of an ERROR span ("" when it has none)
    torchtrace: bool = field(default=False)

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", "unknown service"))

    @property
    def rank(self) -> int | None:
        rank = self.resource.get(RANK)
        return rank if isinstance(rank, int) else None


def _value(any_value: dict[str, Any]) -> Any:
    """Python value of an OTLP/JSON AnyValue."""
    for key, item in any_value.items():
        if key == "stringValue" or key == "boolValue":
            return item
        if key == "intValue":
            return int(item)
        if key == "doubleValue":
            return float(item)  # also "NaN", "Infinity", "-Infinity"
        if key == "arrayValue":
            return [_value(value) for value in item.get("values", ())]
        if key == "kvlistValue":
            return _attributes(item.get("values", ()))
        if key == "bytesValue":
            return item
    return None


def _attributes(pairs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {pair.get("key", ""): _value(pair.get("value", {})) for pair in pairs}


def _rotated_siblings(path: Path) -> list[Path]:
    """``traces.jsonl`` and its rotated parts: ``traces.jsonl.N``, ``traces-<anything>.jsonl[...]``."""
    stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    names = {path.name}
    for sibling in path.parent.glob(glob.escape(path.name) + ".*"):
        names.add(sibling.name)
    if path.name.endswith(".jsonl"):
        for sibling in path.parent.glob(glob.escape(stem) + "-*.jsonl*"):
            names.add(sibling.name)
    return [path.parent / name for name in names if (path.parent / name).is_file()]


def _oldest_first(paths: Iterable[Path]) -> list[Path]:
    def key(path: Path) -> tuple[int, int, str]:
        suffix = path.suffix[1:]
        rotation = -int(suffix) if suffix.isdigit() else 0  # on equal times: traces.jsonl.2, .1, then the current
        try:
            return (path.stat().st_mtime_ns, rotation, path.name)
        except OSError:
            return (0, rotation, path.name)

    return sorted(set(paths), key=key)


def trace_parts(arguments: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files named by ``arguments`` (files, directories, globs), each argument's parts oldest first."""
    parts: list[Path] = []
    for argument in arguments:
        text = os.fspath(argument)
        path = Path(text)
        if path.is_dir():
            found = [part for part in path.glob("*.jsonl*") if part.is_file()]
            if not found:
                raise TraceFileError(f"{text}: no *.jsonl trace files in this directory")
        elif path.is_file():
            found = _rotated_siblings(path)
        elif glob.has_magic(text):
            found = [Path(match) for match in glob.glob(text) if Path(match).is_file()]
            if not found:
                raise TraceFileError(f"{text}: no file matches")
        else:
            raise TraceFileError(f"{text}: no such file or directory")
        parts.extend(part for part in _oldest_first(found) if part not in parts)
    return parts


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = max(total, 1)
        self.enabled = self.stream.isatty()
        self._shown = -1

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        percent = min(100, done * 100 // self.total)
        if percent != self._shown:
            self._shown = percent
            bar = "#" * (percent // 4)
            self.stream.write(f"\rreading traces [{bar:<25}] {percent:3d}%")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._shown >= 0:
            self.stream.write("\n")
            self.stream.flush()


class TraceReader:
    """Iterates the spans of trace files; counts what could not be read (``bad_lines``, ``where_bad``)."""

    def __init__(
        self,
        arguments: Sequence[str | os.PathLike[str]],
        *,
        progress: bool = True,
        traces: Iterable[str] | None = None,
    ) -> None:
        if not arguments:
            raise TraceFileError("no trace file given")
        self.parts = trace_parts(arguments)
        self.progress = progress
        # only the spans of these trace ids (hex); a line naming none of them is skipped before it is parsed
        self.traces = None if traces is None else frozenset(traces)
        self._needles = None if traces is None else [trace.encode() for trace in self.traces]
        self.lines = 0
        self.bad_lines = 0
        self.where_bad: list[str] = []  # "file:line" of the first few bad lines
        self.spans = 0
        self.torchtrace_spans = 0

    def __iter__(self) -> Iterator[Span]:
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[Span]]:
        """The spans of each line (one export request)."""
        total = sum(part.stat().st_size for part in self.parts)
        progress = _Progress(total) if self.progress else None
        done = 0
        try:
            for part in self.parts:
                with open(part, "rb") as file:
                    for number, raw in enumerate(file, 1):
                        done += len(raw)
                        if progress is not None and number % 256 == 0:
                            progress.update(done)
                        if not raw.strip() or self._needles is not None and not any(n in raw for n in self._needles):
                            continue
                        self.lines += 1
                        try:
                            request = json.loads(raw)
                            spans = list(self._spans(request))
                        except (ValueError, TypeError, AttributeError, KeyError):
                            self._bad(part, number)
                            continue
                        self.spans += len(spans)
                        yield spans
                if progress is not None:
                    progress.update(done)
        finally:
            if progress is not None:
                progress.close()

    def _bad(self, part: Path, number: int) -> None:
        self.bad_lines += 1
        if len(self.where_bad) < 5:
            self.where_bad.append(f"{part}:{number}")

    def _spans(self, request: dict[str, Any]) -> Iterator[Span]:
        for resource_spans in request["resourceSpans"]:
            resource = _attributes(resource_spans.get("resource", {}).get("attributes", ()))
            for scope_spans in resource_spans.get("scopeSpans", ()):
                scope = scope_spans.get("scope", {}).get("name", "")
                for raw in scope_spans.get("spans", ()):
                    if self.traces is not None and raw["traceId"] not in self.traces:
                        continue
                    attributes = _attributes(raw.get("attributes", ()))
                    status = raw.get("status", {})
                    ours = scope == _SCOPE
                    self.torchtrace_spans += ours
                    yield Span(
                        trace_id=raw["traceId"],
                        span_id=raw["spanId"],
                        parent_span_id=raw.get("parentSpanId", ""),
                        name=raw.get("name", ""),
                        start_ns=int(raw.get("startTimeUnixNano", 0)),
                        end_ns=int(raw.get("endTimeUnixNano", 0)),
                        attributes=attributes,
                        resource=resource,
                        scope=scope,
                        error=status.get("message", "") if status.get("code") == _STATUS_ERROR else None,
                        torchtrace=ours,
                    )

    def nothing_read(self, what: str = "spans") -> TraceFileError:
        """The error for files that held no ``what``, with what was found instead."""
        names = ", ".join(str(part) for part in self.parts)
        found = [f"{self.spans} spans of other producers"] if self.spans else []
        found += [self.problems()] if self.bad_lines else []
        return TraceFileError(f"no {what} in {names}" + (f" ({'; '.join(found)})" if found else ""))

    def problems(self) -> str:
        """What could not be read, one sentence; "" when every line was read."""
        if not self.bad_lines:
            return ""
        where = ", ".join(self.where_bad)
        return f"{self.bad_lines} unreadable line(s) skipped (a killed process leaves a truncated last line): {where}"


_SEEN_FORWARDS = 1 << 16  # span ids of recent forward spans, to tell a nested call (depth > 0) from an outermost


def summary_from_spans(spans: Iterable[Span]) -> SummarySink:
    """The per-layer summary of torchtrace's spans, computed by the handle's own ``SummarySink``.

    Calls are fed per trace in start order, as the handle feeds them; a forward span whose parent is a forward span
    seen lately is nested (depth > 0), else outermost.
    """
    sink = SummarySink()
    forwards: dict[str, None] = {}  # insertion-ordered, bounded
    pending: list[ModuleCall] = []
    pending_trace = ""

    def flush() -> None:
        if pending:
            pending.sort(key=lambda call: call.start_ns)
            sink(pending)
            pending.clear()

    for span in spans:
        if not span.torchtrace:
            continue
        path = span.attributes.get(_PATH_KEY)
        kind = ("backward" if span.name.endswith(" backward") else "forward") if isinstance(path, str) else "step"
        depth = 0
        if kind == "forward":
            depth = 1 if span.parent_span_id in forwards else 0
            forwards[span.span_id] = None
            if len(forwards) > _SEEN_FORWARDS:
                del forwards[next(iter(forwards))]
        if span.trace_id != pending_trace:
            flush()
            pending_trace = span.trace_id
        type_name = span.attributes.get(_TYPE_KEY)
        pending.append(
            ModuleCall(
                path=path if isinstance(path, str) else span.name,
                type_name=type_name if isinstance(type_name, str) else span.name,
                depth=depth,
                trace_id=int(span.trace_id, 16),
                span_id=int(span.span_id, 16),
                parent_span_id=int(span.parent_span_id or "0", 16),
                start_ns=span.start_ns,
                end_ns=span.end_ns,
                kind=kind,
            )
        )
    flush()
    return sink


def file_command(name: str, action: Callable[[], tuple[TraceReader, str]]) -> int:
    """``torchtrace <name>`` over trace files: ``action`` reads them and returns its reader and the line to print.
    Returns the exit status: 1 where the files cannot be read (the error on stderr); lines that could not be read
    are a warning there."""
    try:
        reader, message = action()
    except (TraceFileError, OSError) as error:
        print(f"torchtrace {name}: error: {error}", file=sys.stderr)
        return 1
    if reader.bad_lines:
        print(f"torchtrace {name}: warning: {reader.problems()}", file=sys.stderr)
    print(message)
    return 0


def summary_command(traces: Sequence[str], limit: int | None) -> int:
    """``torchtrace summary``: returns the exit status; messages on stderr."""

    def summarise() -> tuple[TraceReader, str]:
        reader = TraceReader(traces)
        sink = summary_from_spans(reader)
        if not reader.torchtrace_spans:
            raise reader.nothing_read("torchtrace spans")
        return reader, sink.table(limit)

    return file_command("summary", summarise)
