"""One dispatch worker thread per process, shared by every handle's ``Dispatcher``.

Started by the first handle, ended when the last one leaves: ``remove()``, or its handle collected without one
(dispatchers are held weakly, so a dropped handle keeps neither the thread nor anything it references alive).
Each dispatcher keeps its own ``export_interval_ms``: the worker sleeps until the earliest due one, drains each
due one under that dispatcher's own lock (one handle's batches stay in order), and schedules its next drain an
interval after that drain ended. A drain that raises is logged; the other handles' drains go on.

In between, every ``RESOLVE_INTERVAL_S`` while forwards keep coming (backing off to ``_IDLE_RESOLVE_INTERVAL_S``
when they stop), and at once when a handle's buffer holds a backlog (``RecordBuffer.backlog_calls`` calls in
``backlog_forwards`` forwards: ``resolve_soon``), it resolves them (``Dispatcher.resolve``): the forwards the hooks
left (a few tracked objects each: their columns, and a summaries dict where an output is not a bare tensor) then die
young. Left for a whole export interval they would outlive the collector's young generations, be promoted, and
trigger full collections of the whole heap, each a long pause in a torch process (benchmarks/latency.py counts
them and their pauses, traced against untraced). The backlog bound keeps a model of small, fast forwards
(thousands a second) below the young generation's threshold (700 allocations) between ticks. Forwards with device
work are the exception when they come back to back: the model's thread resolves them itself at later forwards' ends;
the worker never starts while a forward runs (``Dispatcher.worker_defers``), so as not to take the GIL beside a
host-bound forward, and takes them between forwards (a server between requests), at its next tick.

After ``os.fork()`` the child has no worker thread: ``_fork`` calls :meth:`DispatchWorker.after_fork`, then adds its
live handles back, which starts the child's own worker.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from torch.cuda import is_initialized as cuda_initialized

from torchtrace._capture.cuda_driver import tolerate_graph_captures

_logger = logging.getLogger(__name__)
THREAD_NAME = "torchtrace-dispatch"
_JOIN_TIMEOUT_S = 10.0  # a stalled export is bounded by the exporter's own timeout; this only caps the wait
# While forwards keep coming: well under the young generations' lifetime (~50 ms between gen1 collections, traced),
# and small batches (the worker holds the GIL for less than a forward's worth at a time). Idle: back off.
RESOLVE_INTERVAL_S = 0.005
_IDLE_RESOLVE_INTERVAL_S = 0.1
_MAX_SLEEP_S = 3600.0  # any interval, however long, is a valid sleep (a lock's timeout has a maximum)


class DispatchWorker:
    """The process's dispatch thread and the dispatchers it serves (each with ``interval_s``, ``next_drain``,
    ``drain(wait=False)``, ``resolve()``, ``has_unresolved()`` and ``worker_defers()``)."""

    def __init__(self) -> None:
        self.after_fork()

    def after_fork(self) -> None:
        """A fresh, empty state: no members, no thread, a lock nobody holds (a forked child inherits it held
        when the parent's worker had it at the fork)."""
        # Reentrant: a member's weakref callback may run in the thread holding it (a collection while it is held).
        self._condition = threading.Condition(threading.RLock())
        self._members: dict[int, weakref.ref] = {}  # id(dispatcher) -> weak reference
        self._thread: threading.Thread | None = None
        self._resolve_now = False  # a buffer's backlog asked for a resolution before the next tick

    def add(self, dispatcher: Any) -> None:
        """Serve ``dispatcher`` from now on (its first drain one interval from now); starts the thread if needed."""
        with self._condition:
            dispatcher.next_drain = time.monotonic() + dispatcher.interval_s
            self._members[id(dispatcher)] = weakref.ref(dispatcher, self._on_collected)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._condition.notify()

    def discard(self, dispatcher: Any) -> None:
        """Stop serving ``dispatcher``. The last one out ends the thread and waits for it (its drain in progress,
        if any, finishes first), unless called on the worker thread itself."""
        with self._condition:
            ref = self._members.get(id(dispatcher))
            if ref is not None and ref() is dispatcher:
                del self._members[id(dispatcher)]
            thread = self._thread if not self._live_members() else None
            self._condition.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_JOIN_TIMEOUT_S)

    def resolve_soon(self) -> None:
        """A buffer reached its backlog: resolve what waits now, not at the next tick (called by the model's
        thread once per backlog, not per forward)."""
        with self._condition:
            self._resolve_now = True
            self._condition.notify()

    @property
    def thread(self) -> threading.Thread | None:
        """The running worker thread, if any."""
        return self._thread

    def _on_collected(self, _: weakref.ref) -> None:
        with self._condition:  # wake the worker: it prunes the dead reference and ends if nothing is left
            self._condition.notify()

    def _live_members(self) -> list:
        """Strong references to the live members; dead references pruned. Called holding the lock."""
        live = []
        for key, ref in list(self._members.items()):
            dispatcher = ref()
            if dispatcher is None:
                del self._members[key]
            else:
                live.append(dispatcher)
        return live

    def _run(self) -> None:
        capture_safe = False
        condition = self._condition
        next_resolve = 0.0
        resolve_interval = RESOLVE_INTERVAL_S
        while True:
            with condition:
                live = self._live_members()
                if not live:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                now = time.monotonic()
                due = [dispatcher for dispatcher in live if dispatcher.next_drain <= now]
                young = []
                if now >= next_resolve or self._resolve_now:
                    self._resolve_now = False
                    young = [d for d in live if d.next_drain > now and d.has_unresolved()]
                    busy = young or any(d.has_unresolved() for d in due)
                    resolve_interval = (
                        RESOLVE_INTERVAL_S if busy else min(2 * resolve_interval, _IDLE_RESOLVE_INTERVAL_S)
                    )
                    next_resolve = now + resolve_interval
                    # not while a forward runs, nor just after a back-to-back one (the model's thread reads those)
                    young = [d for d in young if not d.worker_defers()]
                if not due and not young:
                    wake = min(next_resolve, *(dispatcher.next_drain for dispatcher in live))
                    del live  # hold no member while asleep: a dropped handle must be collectable
                    condition.wait(min(wake - now, _MAX_SLEEP_S))
                    continue
                del live
            if not capture_safe and cuda_initialized():  # before the first event query
                tolerate_graph_captures()
                capture_safe = True
            for dispatcher in young:
                try:
                    dispatcher.resolve()
                except Exception:  # one handle's failure must not stop the others' exports
                    _logger.exception("torchtrace: a background drain failed; it is retried at the next interval")
            for dispatcher in due:
                try:
                    dispatcher.drain(wait=False)
                except Exception:
                    _logger.exception("torchtrace: a background drain failed; it is retried at the next interval")
                dispatcher.next_drain = time.monotonic() + dispatcher.interval_s
            del due, young, dispatcher


WORKER = DispatchWorker()
