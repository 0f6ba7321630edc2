"""A forward's timing events read by the compiled module's native thread, off the thread that resolves the forward.

The driver's entry points are C stubs here (benchmarks/simulated_cuda.py): ``query_running`` says NOT_READY for the
one event the device has not got to (``running``), ``elapsed_by_handle`` gives an event's time as its handle / 16 in
microseconds. tests/test_device.py runs the reader inside traced forwards, tests/test_cuda.py on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from extras import load_simulated_cuda

ROOT = Path(__file__).resolve().parent.parent
native = pytest.importorskip("torchtrace._native")
if not hasattr(native, "read_later"):
    pytest.skip("no native reader thread on this platform: events are read where forwards are resolved", True)


@pytest.fixture
def stubs(tmp_path):
    simulation = load_simulated_cuda()
    if simulation._compiler() is None:
        pytest.skip("no C compiler to build the driver stubs")
    return simulation.Stubs(str(tmp_path))


def read_later(stubs, first: int, elapsed: str = "elapsed_by_handle"):
    """A forward of two calls whose events are ``first`` + 16 k: starts at 0 and 1 (time units), the child's end at
    3, the root's (the last event) at 4."""
    starts, ends = [first, first + 16], [first + 48, first + 64]
    return native.read_later(stubs.address("query_running"), stubs.address(elapsed), stubs.address("exchange"),
                             first, first + 64, starts, ends)  # fmt: skip


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_forwards_events_are_read_once_its_last_event_is_complete_while_its_thread_goes_on(stubs):
    stubs.set("running", 1600 + 64)  # the device has not got to the root's end yet
    started = time.monotonic()
    read = read_later(stubs, 1600)
    assert time.monotonic() - started < 0.05  # handed over: the caller does not wait for the device
    wait_for(lambda: stubs.count("queries") >= 20)
    assert stubs.count("reads") == 0  # nothing read before the device got there: queried every 200 us meanwhile
    stubs.set("running", 0)
    wait_for(lambda: stubs.count("reads") == 4)
    assert read.take() == ([0, 1000], [3000, 4000])  # ns from the first start event, in the lists' order
    assert read.take() == ([0, 1000], [3000, 4000])  # a forward resolved again (a retry) finds them still
    assert stubs.count("reads") == 4 and stubs.count("exchanges") <= 1  # thread-local capture mode, set once


def test_a_forward_taken_before_the_reader_got_to_it_is_left_to_its_caller(stubs):
    stubs.set("running", 1600 + 64)  # the first forward still runs on the device
    first = read_later(stubs, 1600)
    second = read_later(stubs, 3200)
    wait_for(lambda: stubs.count("queries") >= 2)
    assert second.take() is None  # the caller reads it (and may give its events back for reuse)
    stubs.set("running", 0)
    wait_for(lambda: stubs.count("reads") == 4)
    assert first.take() == ([0, 1000], [3000, 4000])
    time.sleep(0.05)  # time for the reader to come to the second one, and leave it
    assert stubs.count("reads") == 4 and second.take() is None


def test_a_forward_being_read_is_waited_for(stubs):
    stubs.set("running", 1600 + 64)
    read = read_later(stubs, 1600)
    wait_for(lambda: stubs.count("queries") >= 2)  # the reader has it
    taken = []
    resolving = threading.Thread(target=lambda: taken.append(read.take()))
    resolving.start()
    resolving.join(0.05)
    assert resolving.is_alive() and taken == []  # waits (without the GIL: this thread runs on) while it is read
    stubs.set("running", 0)
    resolving.join(10)
    assert taken == [([0, 1000], [3000, 4000])]


def test_a_read_the_driver_refuses_is_left_to_the_caller(stubs):
    read = read_later(stubs, 1600, elapsed="elapsed_refused")
    wait_for(lambda: stubs.count("queries") >= 1)
    time.sleep(0.01)
    assert read.take() is None  # its own read says why (the in-line read raises the driver's error)


def test_an_unread_forward_can_be_dropped_at_any_point(stubs):
    stubs.set("running", 1600 + 64)
    reads = [read_later(stubs, 1600), read_later(stubs, 3200), read_later(stubs, 4800)]
    wait_for(lambda: stubs.count("queries") >= 2)
    del reads[:]  # one being read, two queued: each freed by whoever holds it last, the queued ones never read
    stubs.set("running", 0)
    wait_for(lambda: stubs.count("reads") == 4)
    later = read_later(stubs, 6400)
    wait_for(lambda: stubs.count("reads") == 8)
    assert stubs.count("reads") == 8 and later.take() == ([0, 1000], [3000, 4000])  # the reader serves on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_reads_its_inherited_forwards_itself(stubs):
    stubs.set("running", 1600 + 64)
    read = read_later(stubs, 1600)
    wait_for(lambda: stubs.count("queries") >= 2)
    pid = os.fork()
    if pid == 0:  # the child has no reader thread: the forward is its caller's to read, at once
        os._exit(0 if read.take() is None and read_later(stubs, 3200) is not None else 1)
    _, status = os.waitpid(pid, 0)
    stubs.set("running", 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read.take() == ([0, 1000], [3000, 4000])  # the parent's reader goes on


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_the_reader_thread_ends_after_ten_idle_seconds_and_the_next_forward_starts_another(stubs, tmp_path):
    """In a process of its own (no other thread comes or goes): one native thread while forwards come, none after
    READER_IDLE_S (10 s) without one, a new one for the next."""
    script = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import simulated_cuda
from torchtrace import _native
stubs = simulated_cuda.Stubs({str(tmp_path)!r})

def threads():
    return len(os.listdir("/proc/self/task"))

def read(first, reads):
    done = _native.read_later(stubs.address("query"), stubs.address("elapsed_by_handle"), stubs.address("exchange"),
                              first, first + 64, [first, first + 16], [first + 48, first + 64])
    deadline = time.monotonic() + 10
    while stubs.count("reads") < reads and time.monotonic() < deadline:
        time.sleep(0.001)
    return done.take()

before = threads()
first = read(1600, 4)
during = threads()
time.sleep(10.5)
after = threads()
second = read(3200, 8)
print(before, during, after, threads(), first == second == ([0, 1000], [3000, 4000]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    before, during, after, again, read = result.stdout.split()
    assert (int(during), int(after), int(again)) == (int(before) + 1, int(before), int(before) + 1)
    assert read == "True"
