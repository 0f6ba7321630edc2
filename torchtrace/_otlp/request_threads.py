"""Threads that run OTLP/HTTP requests for ``exporters._DeadlineTransport``, kept between requests.

A request runs on a thread other than its caller's so that the caller can stop waiting at the deadline whatever the
peer does (a socket timeout bounds each read, not the request). Starting a thread per request cost as much as the
request itself to a collector on the same host (benchmarks/overhead.py's OTLP export): a thread that finished
a request waits ``IDLE_S`` for the next one instead. A thread serves one request at a time; one whose request
outlived its caller's deadline stays with it until the peer gives up (the next request gets another thread), then
waits for work like the others. Shared by every transport of the process; daemons, so none holds the interpreter's
exit; at most ``MAX_IDLE`` wait at once, and none once a transport closes (the last handle removed leaves no thread
of torchtrace's behind; a transport still open starts one at its next request).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

THREAD_NAME = "torchtrace-otlp-http"
IDLE_S = 60.0  # longer than any sensible export interval: one thread serves a process that exports regularly
MAX_IDLE = 2


class _RequestThread:
    """One kept thread and the queue of its next request (one at a time)."""

    __slots__ = ("_pool", "jobs", "thread", "generation")

    def __init__(self, pool: RequestThreads) -> None:
        self._pool = pool
        self.generation = pool.generation  # a thread of an older one (busy at end_idle) ends after its request
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None: end
        self.thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                if self._pool.retire(self):
                    return
                continue  # handed a request as it timed out: it is in the queue
            if job is None:
                return
            job()
            if not self._pool.release(self):
                return


class RequestThreads:
    """The process's kept request threads: ``run(job)`` runs ``job`` (which must not raise) on an idle one, or on a
    new one when none is idle."""

    def __init__(self) -> None:
        self.after_fork()

    def after_fork(self) -> None:
        """A fresh, empty state: a forked child has none of its parent's threads (and may inherit the lock held)."""
        self._lock = threading.Lock()
        self._idle: list[_RequestThread] = []
        self.generation = 0

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _RequestThread(self)
            worker.thread.start()
        worker.jobs.put(job)

    def release(self, worker: _RequestThread) -> bool:
        """``worker`` finished its request: whether it is kept (False: enough wait already, it ends)."""
        with self._lock:
            if len(self._idle) >= MAX_IDLE or worker.generation != self.generation:
                return False
            self._idle.append(worker)
            return True

    def retire(self, worker: _RequestThread) -> bool:
        """``worker`` waited ``IDLE_S`` for nothing: whether it ends (False: ``run`` just handed it a request)."""
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False

    def end_idle(self) -> None:
        """Ends every thread that waits for a request; one running a request ends after it."""
        with self._lock:
            self.generation += 1
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.jobs.put(None)


REQUEST_THREADS = RequestThreads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=REQUEST_THREADS.after_fork)
