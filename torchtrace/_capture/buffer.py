"""The record buffer between the hot path and the sinks: whole forwards, bounded, drops counted."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torchtrace._core import signals as _signals

_logger = logging.getLogger(__name__)
_DROP_LOG_INTERVAL_S = 20.0
FULL = "record buffer full: export is slower than the model (raise max_pending_calls or sample)"


class RecordBuffer:
    """Finished forwards waiting for the dispatcher. ``put`` runs on the hot path: an append and two adds.

    ``on_backlog`` (if set) is called once when both the calls and the forwards waiting reach ``backlog_calls`` and
    ``backlog_forwards``, and again only after the next ``take_all``: it asks the worker to take them now (see
    ``worker``). Counting forwards too keeps a model of few, large forwards on the worker's own tick: waking the
    worker for every forward of a hundred calls made that model markedly dearer per call (benchmarks/overhead.py).
    """

    __slots__ = ("max_calls", "pending_calls", "dropped_calls", "backlog_calls", "backlog_forwards",
                 "on_backlog", "_signalled", "_forwards", "_last_drop_log", "_lock", "held_elsewhere")  # fmt: skip

    def __init__(self, max_calls: int, backlog_calls: int = 64, backlog_forwards: int = 8) -> None:
        self.max_calls = max_calls
        self.pending_calls = 0
        self.held_elsewhere = 0  # calls taken from here and not yet exported: the bound counts them too
        self.dropped_calls = 0
        self.backlog_calls = backlog_calls
        self.backlog_forwards = backlog_forwards
        self.on_backlog: Callable[[], None] | None = None
        self._signalled = False  # on_backlog called since the last take_all
        self._forwards: collections.deque = collections.deque()
        self._last_drop_log = 0.0
        self._lock = threading.Lock()  # once per forward: keeps the counters exact across threads

    @_signals.guarded
    def put(self, forward: Any, call_count: int) -> bool:
        """Queues one finished forward; drops it whole (counted) if the buffer is full.

        Guarded (``signals``): a SIGTERM landing while the model's thread holds the lock, which the flush at
        SIGTERM takes on a thread of its own, is handled once the forward is queued."""
        signal = False
        with self._lock:
            queued = self.pending_calls + self.held_elsewhere + call_count <= self.max_calls
            if queued:
                self._forwards.append(forward)
                self.pending_calls += call_count
                if (
                    not self._signalled
                    and self.pending_calls >= self.backlog_calls
                    and len(self._forwards) >= self.backlog_forwards
                ):
                    signal = self._signalled = True
        if not queued:
            self.drop(call_count, FULL)
            return False
        on_backlog = self.on_backlog
        if signal and on_backlog is not None:
            on_backlog()
        return True

    @_signals.guarded
    def drop(self, call_count: int, why: str) -> None:
        """Counts calls lost before reaching the buffer; logs at most once per 20 s. Guarded as ``put``."""
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
            self._signalled = False
        return taken

    def __len__(self) -> int:
        return len(self._forwards)
