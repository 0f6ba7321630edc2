"""Sink: the per-layer summary table (calls, total / mean / p95 time, share of the forward)."""

from __future__ import annotations

import math
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import sub

import numpy as np

from torchtrace._core.calls import CallBatch, Calls, ModuleCall, call_name

_RESERVOIR = 1024  # durations kept per layer for the p95: the latest ones, 8 bytes each (a 129-layer model: 1 MiB)
_FOLD_AT = 64  # forwards whose durations wait, as rows, before they are added to their layers (or until read)
_FIRST = (0,)
_INT64 = 8  # bytes


@dataclass(frozen=True)
class LayerSummary:
    path: str
    type_name: str
    calls: int
    total_ms: float
    mean_ms: float
    p95_ms: float
    share: float  # of the time spent in outermost (depth 0) calls


class _Layer:
    __slots__ = ("type_name", "calls", "total_ns", "sum_ns", "recent", "_next")

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        self.calls = 0
        self.total_ns = 0  # time inside the layer (a recursive call's inner calls count once, inside the outer)
        self.sum_ns = 0  # the sum of every call's duration: for the mean
        self.recent = array("q")  # for the p95: a ring of the latest _RESERVOIR durations
        self._next = 0  # where the next duration goes once the ring is full

    def keep(self, duration: int) -> None:
        recent = self.recent
        if len(recent) < _RESERVOIR:
            recent.append(duration)
        else:
            recent[self._next] = duration
            self._next = (self._next + 1) % _RESERVOIR

    def keep_all(self, durations: np.ndarray) -> None:
        """``keep`` of each (int64), in order, as slice writes (forwards give each layer a run of durations at once)."""
        durations = durations[-_RESERVOIR:]
        recent = self.recent
        room = _RESERVOIR - len(recent)
        if room > 0:
            recent.frombytes(durations[:room].tobytes())
            durations = durations[room:]
        while len(durations):
            at = self._next
            run = durations[: _RESERVOIR - at]
            recent[at : at + len(run)] = array("q", run.tobytes())
            self._next = (at + len(run)) % _RESERVOIR
            durations = durations[len(run) :]


class SummarySink:
    """Aggregates durations per module path; ``rows()`` and ``table()`` read them.

    Forwards that call each module once wait as rows of durations (per module sequence and root positions; the
    int64 bytes that resolution made, not a Python int per call) and are added to their layers ``_FOLD_AT`` forwards
    at a time, or when the summary is read: a module at a time, as slices, where a forward at a time cost ~0.5 us a
    call (the worker often resolves one forward at a time)."""

    def __init__(self) -> None:
        self._layers: dict[str, _Layer] = {}
        self._root_ns = 0  # time in outermost forward calls: the denominator of "share"
        # (module sequence, root positions, the calls' kind) -> (modules, rows of durations as int64 bytes)
        self._waiting: dict[tuple, tuple[Sequence, list[bytes]]] = {}
        self._waiting_rows = 0
        self._lock = threading.Lock()  # the worker adds, the user's thread reads (and folds what waits)

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        with self._lock:
            for segment in calls.segments if isinstance(calls, Calls) else [calls]:
                if isinstance(segment, CallBatch) and not segment.made:
                    self._add_columns(segment)
                else:
                    if any(call.kind == "forward" for call in segment):
                        self._fold()  # the latest durations stay the latest (a step's own spans: other layers)
                    self._add_calls(segment)
            if self._waiting_rows >= _FOLD_AT:
                self._fold()

    def _layer(self, name: str, type_name: str) -> _Layer:
        layer = self._layers.get(name)
        if layer is None:
            layer = self._layers[name] = _Layer(type_name)
        return layer

    def _add_calls(self, calls: Sequence[ModuleCall]) -> None:
        outermost: dict[str, tuple[int, int]] = {}  # name -> (trace id, end) of its latest call not nested in itself
        for call in calls:  # in start order within each forward
            self._add(
                self._layer(call.name, call.type_name),
                call.start_ns,
                call.end_ns,
                call.trace_id,
                call.name,
                outermost,
                call.depth == 0 and call.kind == "forward",
            )

    def _add_columns(self, batch: CallBatch) -> None:
        """A forward's calls from its columns. Forwards that call the same modules in the same order (a model's
        forwards, usually) wait as rows of durations, added together a module at a time (``_fold``; a Python step
        per call cost 0.36 us). A forward that calls a module twice (shared or recursive) takes the per-call loop,
        which counts only the calls not nested in a call of the same module toward its total."""
        lo, hi = batch.lo, batch.hi
        if lo == hi:
            return
        whole = lo == 0 and hi == len(batch.module)
        sequence = tuple(batch.module) if whole else tuple(batch.module[lo:hi])
        parents = batch.parent if whole else batch.parent[lo:hi]
        kind = batch.kind
        if kind != "forward":
            roots: tuple[int, ...] = ()  # backward spans: layers of their own ("<path> backward"), not the forward's
        elif parents[0] == -1 and parents.count(-1) == 1:
            roots = _FIRST  # a whole forward: its outermost call
        else:
            roots = tuple(position for position, parent in enumerate(parents) if parent < 0)
        waiting = self._waiting.get((sequence, roots, kind))
        if waiting is None:
            if len(set(sequence)) < len(sequence):
                self._fold()
                self._add_repeated(batch)
                return
            waiting = self._waiting[sequence, roots, kind] = (batch.modules, [])
        durations = batch.durations
        if durations is None:  # columns resolved without the compiled module
            durations = array("q", map(sub, batch.end_ns[lo:hi], batch.start_ns[lo:hi])).tobytes()
        elif not whole:
            durations = durations[lo * _INT64 : hi * _INT64]
        waiting[1].append(durations)
        self._waiting_rows += 1

    def _fold(self) -> None:
        """Adds the durations that wait to their layers: per module sequence, its rows transposed."""
        layers = self._layers
        for (sequence, roots, kind), (info_of, rows) in self._waiting.items():
            durations = np.frombuffer(b"".join(rows), dtype=np.int64).reshape(len(rows), len(sequence))
            self._root_ns += int(durations[:, list(roots)].sum())
            for module, total, column in zip(sequence, durations.sum(axis=0).tolist(), durations.T.copy()):
                info = info_of[module]
                name = call_name(info.path, info.type_name, kind)
                layer = layers.get(name) or self._layer(name, info.type_name)
                layer.calls += len(rows)
                layer.sum_ns += total
                layer.total_ns += total  # no call nested in one of the same module: each counts
                layer.keep_all(column)
        self._waiting.clear()
        self._waiting_rows = 0

    def _add_repeated(self, batch: CallBatch) -> None:
        """A forward's calls from its columns (one trace), per call: the loop of ``_add``, inlined."""
        outermost: dict[str, int] = {}  # name -> end of its latest call not nested in itself
        modules, layers, kind = batch.modules, self._layers, batch.kind
        lo, hi = batch.lo, batch.hi
        for index, start, end, parent in zip(
            batch.module[lo:hi], batch.start_ns[lo:hi], batch.end_ns[lo:hi], batch.parent[lo:hi]
        ):
            info = modules[index]
            name = call_name(info.path, info.type_name, kind)
            layer = layers.get(name) or self._layer(name, info.type_name)
            duration = end - start
            layer.calls += 1
            layer.sum_ns += duration
            layer.keep(duration)
            if end > outermost.get(name, 0):
                outermost[name] = end
                layer.total_ns += duration  # a recursive call's inner calls are inside it: counted once
            if parent < 0 and kind == "forward":
                self._root_ns += duration

    def _add(self, layer: _Layer, start: int, end: int, trace_id: int, name: str, outermost: dict, root: bool) -> None:
        duration = end - start
        layer.calls += 1
        layer.sum_ns += duration
        layer.keep(duration)
        outer = outermost.get(name)
        if outer is None or outer[0] != trace_id or end > outer[1]:
            outermost[name] = (trace_id, end)
            layer.total_ns += duration  # a recursive call's inner calls are inside it: counted once
        if root:
            self._root_ns += duration

    def rows(self) -> list[LayerSummary]:
        with self._lock:
            self._fold()
            return self._rows()

    def _rows(self) -> list[LayerSummary]:
        rows = []
        for name, layer in self._layers.items():
            ordered = sorted(layer.recent)
            p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]  # nearest rank
            rows.append(
                LayerSummary(
                    path=name,
                    type_name=layer.type_name,
                    calls=layer.calls,
                    total_ms=layer.total_ns / 1e6,
                    mean_ms=layer.sum_ns / layer.calls / 1e6,
                    p95_ms=p95 / 1e6,
                    share=layer.total_ns / self._root_ns if self._root_ns else 0.0,
                )
            )
        return rows

    def table(self, limit: int | None = None) -> str:
        """A plain-text table, slowest layers first."""
        rows = sorted(self.rows(), key=lambda row: row.total_ms, reverse=True)[:limit]
        if not rows:
            return "torchtrace: no calls recorded"
        width = max(12, *(len(row.path) for row in rows))
        header = (
            f"{'layer':<{width}}  {'type':<24} {'calls':>7} {'total ms':>10} {'mean ms':>9} {'p95 ms':>9} {'share':>7}"
        )
        lines = [header, "-" * len(header)]
        for row in rows:
            lines.append(
                f"{row.path:<{width}}  {row.type_name[:24]:<24} {row.calls:>7} {row.total_ms:>10.3f} "
                f"{row.mean_ms:>9.4f} {row.p95_ms:>9.4f} {row.share:>7.1%}"
            )
        return "\n".join(lines)

    def clear(self) -> None:
        with self._lock:
            self._layers.clear()
            self._root_ns = 0
            self._waiting.clear()
            self._waiting_rows = 0
