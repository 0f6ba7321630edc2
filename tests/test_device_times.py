"""The device-times thread: a forward's timing events read off the thread that resolves it, whoever comes first.

The reader is driven here with stand-ins for the two driver calls it makes (the wait for the root's end event, the
elapsed-time reads); tests/test_device.py runs it with the driver stubbed in C, tests/test_cuda.py on a GPU.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

from torchtrace._pipeline import device_times
from torchtrace._pipeline.device_times import DeviceTimesReader


class Gate:
    """The compiled read of a forward's events: its wait held shut for the last events named until opened; each
    read noted by its origin's handle; an event's time is its handle."""

    def __init__(self) -> None:
        self.shut: set[int] = set()
        self.opened = threading.Event()
        self.waiting = threading.Event()
        self.reads: list[int] = []
        self.error: str | None = None

    def read_events(self, query: int, elapsed: int, origin: int, last: int, starts: list, ends: list):
        if last in self.shut:
            self.waiting.set()
            self.opened.wait(10)
        if self.error:
            raise RuntimeError(self.error)
        self.reads.append(origin)
        return [event.handle - origin for event in starts], [event.handle - origin for event in ends]


@pytest.fixture
def gate(monkeypatch):
    gate = Gate()
    monkeypatch.setattr(device_times, "_read_events", gate.read_events)
    return gate


def event(handle: int):
    return types.SimpleNamespace(handle=handle, _driver=types.SimpleNamespace(query_address=1, elapsed_address=2))


def forward(first: int):
    """A forward of two calls whose events' handles start at ``first``: starts first, first + 1; ends first + 3
    (the child), first + 4 (the root, recorded last)."""
    return types.SimpleNamespace(
        start_events={0: event(first), 1: event(first + 1)},
        end_events={1: event(first + 3), 0: event(first + 4)},
        event_offsets=None,
    )


def settle(reader: DeviceTimesReader, *forwards, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(f.event_offsets in (None, device_times._READING) for f in forwards) and time.monotonic() < deadline:
        time.sleep(0.001)


def test_the_reader_reads_a_submitted_forwards_offsets_for_whoever_resolves_it(gate):
    reader = DeviceTimesReader()
    f = forward(100)
    reader.submit(f)
    settle(reader, f)
    assert reader.take(f) == ([0, 1], [3, 4])  # from the first start event, in the events' order
    assert reader.take(f) == ([0, 1], [3, 4])  # a forward resolved again (a retry) finds them still
    assert gate.reads == [100]  # once


def test_a_forward_its_resolving_thread_reaches_first_is_read_there_and_left_by_the_reader(gate):
    reader = DeviceTimesReader()
    first, second = forward(100), forward(200)
    gate.shut.add(104)  # the first forward still runs on the device
    reader.submit(first)
    reader.submit(second)
    assert gate.waiting.wait(10)
    assert reader.take(second) is None  # the caller reads it: the reader waits on the first one
    gate.opened.set()
    settle(reader, first)
    time.sleep(0.05)  # time enough for the reader to come to the second one
    assert reader.take(first) == ([0, 1], [3, 4])
    assert gate.reads == [100]  # never the second one's
    assert reader.take(second) is None


def test_a_forward_being_read_is_waited_for(gate):
    reader = DeviceTimesReader()
    f = forward(100)
    gate.shut.add(104)
    reader.submit(f)
    assert gate.waiting.wait(10)
    taken = []
    resolving = threading.Thread(target=lambda: taken.append(reader.take(f)))
    resolving.start()
    resolving.join(0.05)
    assert resolving.is_alive() and taken == []  # waits while the reader has it
    gate.opened.set()
    resolving.join(10)
    assert taken == [([0, 1], [3, 4])]


def test_a_failed_read_leaves_the_forward_to_its_resolving_thread(gate, caplog):
    reader = DeviceTimesReader()
    f = forward(100)
    gate.error = "torchtrace: cuEventQuery failed with CUDA error 700"  # the caller's own read says so too
    with caplog.at_level("DEBUG", logger="torchtrace._pipeline.device_times"):
        reader.submit(f)
        settle(reader, f)
    assert reader.take(f) is None and gate.reads == []
    assert "CUDA error 700" in caplog.text


def test_the_thread_ends_when_idle_and_a_later_forward_starts_another(gate, monkeypatch):
    monkeypatch.setattr(device_times, "IDLE_S", 0.05)
    reader = DeviceTimesReader()

    def threads() -> int:
        return sum(thread.name == device_times.THREAD_NAME and thread.is_alive() for thread in threading.enumerate())

    before = threads()
    f = forward(100)
    reader.submit(f)
    settle(reader, f)
    deadline = time.monotonic() + 10
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads() == before and reader._thread is None
    g = forward(200)
    reader.submit(g)
    settle(reader, g)
    assert reader.take(g) == ([0, 1], [3, 4])
