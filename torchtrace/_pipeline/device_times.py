"""The timing events of forwards with device work, read on a thread of their own while the model runs on.

A traced CUDA forward records two timing events a call, and placing its calls on the device's timeline takes one
cuEventElapsedTime per event: ~3 us each on an H200 host, ~0.6 ms for a forward of 109 calls. Read where the
dispatcher reads such a forward (on the model's thread, at a later forward's end), that is host time the model's
next launches wait for. Here one thread waits for each submitted forward's root end event and reads its events'
offsets from its first event, in one C call that lets the GIL go for both (``_native.read_events``): it holds the GIL
for a few microseconds a forward, and whoever resolves the forward later finds its offsets read
(``take``). Whoever comes first reads them: a forward the resolving thread reaches before the reader is read there
(the reader then leaves it); one the reader is reading is waited for (its reads hold no GIL). A read that fails (an
event on another stream not complete yet, a driver error) leaves the forward to be read where it is resolved, as
without this thread.

Only the driver's events through the compiled module take this path; others are read where they are resolved. The
thread ends after ``IDLE_S`` without a forward (the next one starts another), and a forked child starts its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

from torchtrace._capture.cuda_driver import DriverEvent, tolerate_graph_captures

try:
    from torchtrace._native import read_events as _read_events
except ImportError:  # not built: forwards are read where they are resolved
    _read_events = None

_logger = logging.getLogger(__name__)

THREAD_NAME = "torchtrace-device-times"
IDLE_S = 10.0
_READING = object()  # RawForward.event_offsets while the reader reads them
_CLAIMED = object()  # ... once the resolving thread took them, or the reader failed: read where resolved


class DeviceTimesReader:
    """The process's reader thread and its queue of forwards (``submit``), and ``take`` for whoever resolves them."""

    def __init__(self) -> None:
        self.after_fork()

    def after_fork(self) -> None:
        """A fresh state: a forked child has none of its parent's threads (and may inherit a lock held)."""
        self._condition = threading.Condition(threading.Lock())
        self._queue: deque = deque()
        self._thread: threading.Thread | None = None

    @staticmethod
    def applies(forward: Any) -> bool:
        """Whether ``forward``'s events can be read here: the driver's events, the compiled module built."""
        origin = forward.start_events.get(0)
        return _read_events is not None and type(origin) is DriverEvent and 0 in forward.end_events

    def submit(self, forward: Any) -> None:
        """``forward`` (ended, its events all recorded) is read as soon as its device work is done."""
        with self._condition:
            self._queue.append(forward)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
            else:
                self._condition.notify()

    def take(self, forward: Any) -> tuple[list[int], list[int]] | None:
        """(start offsets, end offsets) of ``forward``'s events (ns from its first event, in the order of its
        ``start_events`` and ``end_events``) where the reader read them; None where they are to be read by the
        caller (from now on the reader leaves them). Waits while the reader reads them."""
        with self._condition:
            while forward.event_offsets is _READING:
                self._condition.wait()
            offsets = forward.event_offsets
            if offsets is None:
                forward.event_offsets = _CLAIMED
            return offsets if type(offsets) is tuple else None

    def _run(self) -> None:
        tolerate_graph_captures()  # its queries must not invalidate a graph another thread captures
        while True:
            with self._condition:
                if not self._queue and not self._condition.wait_for(lambda: self._queue, IDLE_S):
                    self._thread = None
                    return
                forward = self._queue.popleft()
                if forward.event_offsets is not None:  # taken by its resolving thread already
                    continue
                forward.event_offsets = _READING
            offsets: Any = _CLAIMED
            try:
                offsets = self._read(forward)
            except Exception as error:  # read where resolved instead, which logs what fails there
                _logger.debug("torchtrace: a forward's events were not read off the model's thread: %s", error)
            with self._condition:
                forward.event_offsets = offsets
                self._condition.notify_all()

    @staticmethod
    def _read(forward: Any) -> tuple[list[int], list[int]]:
        # waits until the device gets to the root's end (its resolving thread waited for that before ``take``)
        origin, last = forward.start_events[0], forward.end_events[0]
        driver = origin._driver
        starts, ends = list(forward.start_events.values()), list(forward.end_events.values())
        return _read_events(driver.query_address, driver.elapsed_address, origin.handle, last.handle, starts, ends)


READER = DeviceTimesReader()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=READER.after_fork)
