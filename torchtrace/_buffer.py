"""The record buffer between the hot path and the sinks: whole forwards, bounded, drops counted."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

_logger = logging.getLogger(__name__)
_DROP_LOG_INTERVAL_S = 20.0


class RecordBuffer:
    """Finished forwards waiting for the dispatcher. ``put`` runs on the hot path: an append and two adds."""

    __slots__ = ("max_calls", "pending_calls", "dropped_calls", "_forwards", "_last_drop_log", "_lock")

    def __init__(self, max_calls: int) -> None:
        self.max_calls = max_calls
        self.pending_calls = 0
        self.dropped_calls = 0
        self._forwards: collections.deque = collections.deque()
        self._last_drop_log = 0.0
        self._lock = threading.Lock()  # once per forward: keeps the counters exact across threads

    def put(self, forward: Any, call_count: int) -> bool:
        """Queues one finished forward; drops it whole (counted) if the buffer is full."""
        with self._lock:
            if self.pending_calls + call_count <= self.max_calls:
                self._forwards.append(forward)
                self.pending_calls += call_count
                return True
        self.drop(call_count, "record buffer full: export is slower than the model (raise max_pending_calls or sample)")
        return False

    def drop(self, call_count: int, why: str) -> None:
        """Counts calls lost before reaching the buffer; logs at most once per 20 s."""
        with self._lock:
            self.dropped_calls += call_count
        now = time.monotonic()
        if now - self._last_drop_log > _DROP_LOG_INTERVAL_S:
            self._last_drop_log = now
            _logger.warning(
                "torchtrace: %s; %d calls dropped so far, %d pending", why, self.dropped_calls, self.pending_calls
            )

    def take_all(self) -> list:
        """Removes and returns every queued forward, oldest first."""
        with self._lock:
            taken = list(self._forwards)
            self._forwards.clear()
            self.pending_calls = 0
        return taken

    def __len__(self) -> int:
        return len(self._forwards)
