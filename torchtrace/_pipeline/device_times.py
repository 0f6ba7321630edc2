"""The timing events of forwards with device work, read off the model's thread while it runs the next forward.

A traced CUDA forward records two timing events a call, and placing its calls on the device's timeline takes one
cuEventElapsedTime per event: ~3 us each on an H200 host, ~0.6 ms for a forward of 109 calls. Read where the
dispatcher reads such a forward (on the model's thread, at a later forward's end), that is host time the model's
next launches wait for. So the dispatcher hands each forward it buffers at its end to ``submit``: a native thread of
the compiled module (``_native.read_later``), which never takes the GIL, waits for the forward's root end event and
reads every event's offset from its first one. Whoever resolves the forward later ``take``s them; where the thread
has not started on them, it leaves them, and they are read there as before (a read in progress is waited for). A
read the driver refuses is left the same way (the resolving thread's own read then says why).

Only the driver's events through the compiled module take this path (not on Windows: no native thread there);
others are read where they are resolved.
"""

from __future__ import annotations

from typing import Any

from torchtrace._capture.cuda_driver import DriverEvent

try:
    from torchtrace._native import read_later as _read_later
except ImportError:  # not built, or no native thread here: forwards are read where they are resolved
    _read_later = None


def applies(forward: Any) -> bool:
    """Whether ``forward``'s events can be read off its thread: the driver's events, the compiled reader built."""
    return _read_later is not None and type(forward.start_events.get(0)) is DriverEvent and 0 in forward.end_events


def submit(forward: Any) -> None:
    """``forward`` (ended, its events all recorded) is read as soon as its device work is done."""
    origin = forward.start_events[0]
    driver = origin._driver
    forward.event_offsets = _read_later(
        driver.query_address,
        driver.elapsed_address,
        driver.capture_mode_address,
        origin.handle,
        forward.end_events[0].handle,
        list(forward.start_events.values()),
        list(forward.end_events.values()),
    )


def take(forward: Any) -> tuple[list[int], list[int]] | None:
    """(start offsets, end offsets) of ``forward``'s events (ns from its first event, in the order of its
    ``start_events`` and ``end_events``) where they were read off its thread; None where the caller is to read them
    (from then on the reader leaves them). Waits while they are being read."""
    read = forward.event_offsets
    return None if read is None else read.take()
