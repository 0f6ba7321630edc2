"""Sink: the in-memory records API (spikingjelly monitor style), bounded: it keeps statistics, not tensors."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence

from torchtrace._calls import ModuleCall

_logger = logging.getLogger(__name__)


class RecordStore:
    """The latest ``max_records`` calls, in call order, also indexed by module path (oldest dropped first)."""

    def __init__(self, max_records: int, on_drop: Callable[[ModuleCall], None] | None = None) -> None:
        self.max_records = max_records
        self.dropped = 0
        self._on_drop = on_drop  # e.g. gives a dropped call's captured tensors back to the capture budget
        self._records: collections.deque[ModuleCall] = collections.deque()
        self._by_path: dict[tuple[str, str], collections.deque[ModuleCall]] = {}  # (kind, path) -> calls

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        records, by_path = self._records, self._by_path
        for call in calls:
            records.append(call)
            by_path.setdefault((call.kind, call.path), collections.deque()).append(call)
        while len(records) > self.max_records:
            oldest = records.popleft()
            by_path[(oldest.kind, oldest.path)].popleft()  # the oldest of its path too: both are in call order
            if not self.dropped:
                _logger.info(
                    "torchtrace: more than max_records=%d calls: the oldest leave the records (handle.dropped_records);"
                    " exporters still get every call",
                    self.max_records,
                )
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop(oldest)

    def all(self) -> list[ModuleCall]:
        return list(self._records)

    def for_path(self, path: str, kind: str = "forward") -> list[ModuleCall]:
        return list(self._by_path.get((kind, path), ()))

    def clear(self) -> None:
        self._records.clear()
        self._by_path.clear()
