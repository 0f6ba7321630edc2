"""Sink: the per-layer summary table (calls, total / mean / p95 time, share of the forward)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from torchtrace._calls import ModuleCall

_RESERVOIR = 4096  # durations kept per layer for the p95: the latest ones, bounded


@dataclass(frozen=True)
class LayerSummary:
    path: str
    type_name: str
    calls: int
    total_ms: float
    mean_ms: float
    p95_ms: float
    share: float  # of the time spent in outermost (depth 0) calls


class SummarySink:
    """Aggregates durations per module path; ``rows()`` and ``table()`` read them."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = collections.Counter()
        self._total_ns: dict[str, int] = collections.Counter()
        self._recent: dict[str, collections.deque[int]] = {}
        self._types: dict[str, str] = {}
        self._root_ns = 0

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        for call in calls:
            duration = call.end_ns - call.start_ns
            name = call.name
            self._calls[name] += 1
            self._total_ns[name] += duration
            recent = self._recent.get(name)
            if recent is None:
                recent = self._recent[name] = collections.deque(maxlen=_RESERVOIR)
                self._types[name] = call.type_name
            recent.append(duration)
            if call.depth == 0:
                self._root_ns += duration

    def rows(self) -> list[LayerSummary]:
        rows = []
        for name, count in self._calls.items():
            ordered = sorted(self._recent[name])
            p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
            total = self._total_ns[name]
            rows.append(
                LayerSummary(
                    path=name,
                    type_name=self._types[name],
                    calls=count,
                    total_ms=total / 1e6,
                    mean_ms=total / count / 1e6,
                    p95_ms=p95 / 1e6,
                    share=total / self._root_ns if self._root_ns else 0.0,
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
        self.__init__()
