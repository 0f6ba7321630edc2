"""SIGTERM: deliver what was recorded, then end the process as the signal would have.

docker, Kubernetes, systemd and torchrun's elastic agent stop a process with SIGTERM. Its default action ends the
process at once, so spans still in torchtrace's buffer (up to one export interval) and in the exporter would be
lost. While at least one holder (a live handle, ``torchtrace run``) wants it, a handler is installed that flushes
every holder within ``SIGTERM_FLUSH_TIMEOUT_S`` and then hands the signal on: to the handler the application had
installed before, or, where that was the default action, by restoring it and sending the signal again, so the
exit status is the signal's. A SIGTERM the application ignores stays ignored (nothing is installed).

``signal.signal`` works only on the main thread: holders taken elsewhere install nothing (their spans are
delivered at exit as before, or lost to the signal as before).

A SIGTERM that lands while the main thread runs a ``guarded`` function (one that holds a lock the flush needs: the
records and the summary taking a forward at its end) is handled when that function returns: the
flush, on its own thread, would otherwise wait for that lock until its deadline, and lose every span.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SIGTERM_FLUSH_TIMEOUT_S", "guarded", "hold", "release", "stop_time_left"]

_logger = logging.getLogger(__name__)

SIGTERM_FLUSH_TIMEOUT_S = 5.0  # docker stop waits 10 s, Kubernetes 30 s before SIGKILL: well inside both

Flush = Callable[[float], Any]  # seconds left -> flushes what it holds

_holders: dict[int, Flush] = {}  # id(token) -> flush, in the order taken
pending: Any = None  # (signum, frame) of a SIGTERM that landed inside one, until the outermost one returns
_previous: Any = None  # the handler that was installed before ours; None while ours is not installed
_lock = threading.Lock()


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def hold(token: object, flush: Flush) -> None:
    """``flush(seconds)`` runs on SIGTERM until ``release(token)``; the first holder installs the handler."""
    global _previous
    with _lock:
        _holders[id(token)] = flush
        if _previous is not None or not _on_main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current is signal.SIG_IGN or current is _on_sigterm:
            return  # ignored by the application: stays ignored
        signal.signal(signal.SIGTERM, _on_sigterm)
        _previous = signal.SIG_DFL if current is None else current  # None: installed from C, treated as default


def release(token: object) -> None:
    """Drops a holder; the last one puts the application's handler back (if ours is still the installed one)."""
    global _previous
    with _lock:
        _holders.pop(id(token), None)
        if _holders or _previous is None or not _on_main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _previous)
        _previous = None


def installed() -> bool:
    """Whether torchtrace's SIGTERM handler is the installed one."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm


def _flush_all(timeout_s: float) -> None:
    """Every holder's flush, on a thread of its own: the main thread may have been interrupted holding a lock the
    flush needs (inside a hook), and a stalled endpoint must not hold the stop beyond the deadline."""
    deadline = time.monotonic() + timeout_s
    flushes = list(_holders.values())

    def run() -> None:
        for flush in flushes:
            try:
                flush(max(0.0, deadline - time.monotonic()))
            except Exception:
                _logger.exception("torchtrace: flushing at SIGTERM failed")

    worker = threading.Thread(target=run, name="torchtrace-sigterm-flush", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        _logger.warning("torchtrace: SIGTERM: spans not delivered within %.3gs are lost", timeout_s)


def guarded(function: Callable) -> Callable:
    """``function``, with a SIGTERM landing inside it (or in what it calls) handled as it returns or raises."""

    @functools.wraps(function)
    def guarded_call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        # Handled by the outermost guarded call on the main thread (Python runs handlers there): an inner one returns
        # while its caller may still hold the lock. Nothing that can take a signal follows the check (Python handles
        # signals at calls and loops).
        finally:
            if pending is not None and _on_main_thread() and not _inside_guarded(sys._getframe(1)):
                _run_pending()

    return guarded_call


_GUARDED_CALL = guarded(lambda: None).__code__  # the wrapper's code: every guarded call runs it


def _run_pending() -> None:
    """Handles the SIGTERM that landed inside a guarded function."""
    global pending
    landed, pending = pending, None
    if landed is not None:
        _stop(*landed)


def _inside_guarded(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code is _GUARDED_CALL:
            return True
        frame = frame.f_back
    return False


def _on_sigterm(signum: int, frame: Any) -> None:
    global pending
    if _inside_guarded(frame):
        pending = (signum, frame)
    else:
        _stop(signum, frame)


_stop_deadline: float | None = None  # time.monotonic() by which a stop that began with SIGTERM must be done


def stop_time_left(limit_s: float) -> float:
    """Seconds the rest of a stop may take: ``limit_s``, or less where a SIGTERM began the stop (its flush and what
    follows, the application's handler and the exit's delivery, share one deadline: SIGTERM_FLUSH_TIMEOUT_S)."""
    if _stop_deadline is None:
        return limit_s
    return max(0.0, min(limit_s, _stop_deadline - time.monotonic()))


def _stop(signum: int, frame: Any) -> None:
    global _stop_deadline
    previous = _previous if _previous is not None else signal.SIG_DFL
    if _stop_deadline is None:
        _stop_deadline = time.monotonic() + SIGTERM_FLUSH_TIMEOUT_S
    _flush_all(stop_time_left(SIGTERM_FLUSH_TIMEOUT_S))
    if callable(previous):
        previous(signum, frame)  # the application's handler decides (sys.exit, graceful shutdown, ...)
        return
    # the default action: end the process with the signal itself, so the parent sees "killed by SIGTERM"
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
