"""A simulated CUDA device: torchtrace's CUDA host path (driver events, statistics rows, the C kernel launch) run
on CPU tensors, with C stubs standing in for the driver's cuEventRecord, cuEventElapsedTime and cuLaunchKernel.

What a traced CUDA forward costs the model's thread is host work: Python, the compiled module and three kinds of
driver call. This runs all of it but the driver (its stubs count their calls and return success), so the host work
can be counted where no GPU is (benchmarks/instructions.py's ``cuda_*`` variants, tests/test_device.py). The
statistics rows are never written (the stubs launch nothing): the values read back are the rows' start values.

Needs a C compiler (``cc``, or ``$CC``) to build the stubs, and Triton installed (the launch path's module imports
it): ``available()`` says why not.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch

STUBS = r"""
#include <stdint.h>
#include <time.h>
#define KEPT 4096
long records, launches, reads, tensors; /* tensors: those the launches reduce (a batch launch's grid rows) */
int64_t launched[KEPT][5]; /* the statistics kernel's parameters (x, values, counts, n, stride) of the first launches */
int record(void *event, void *stream) { (void)event; (void)stream; records++; return 0; }
int elapsed(float *ms, void *start, void *end) { (void)start; (void)end; *ms = 0.0f; reads++; return 0; }
/* a read that takes as long as the driver's does on a GPU host (spin_ns, set by the caller) */
long spin_ns;
int elapsed_spin(float *ms, void *start, void *end) {
    (void)start; (void)end;
    struct timespec begun, now;
    clock_gettime(CLOCK_MONOTONIC, &begun);
    do clock_gettime(CLOCK_MONOTONIC, &now);
    while ((now.tv_sec - begun.tv_sec) * 1000000000L + (now.tv_nsec - begun.tv_nsec) < spin_ns);
    *ms = 0.0f;
    reads++;
    return 0;
}
long queries;
int query(void *event) { (void)event; queries++; return 0; } /* complete */
long running; /* an event the device has not got to yet: query_running says CUDA_ERROR_NOT_READY for it */
int query_running(void *event) { queries++; return running && (long)event == running ? 600 : 0; }
int elapsed_refused(float *ms, void *start, void *end) { (void)ms; (void)start; (void)end; return 700; }
long exchanges;
int exchange(int *mode) { *mode = 0; exchanges++; return 0; } /* cuThreadExchangeStreamCaptureMode */
/* a clock for tests that check where each time lands: an event's time is its pool index (its handle / 16), in
   microseconds */
int elapsed_by_handle(float *ms, void *start, void *end) {
    *ms = (float)(((char *)end - (char *)start) / 16) / 1000.0f;
    reads++;
    return 0;
}
int launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
           void *stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream; (void)extra;
    tensors += gy;
    if (launches < KEPT) {
        for (int i = 0; i < 3; i++) launched[launches][i] = *(int64_t *)params[i];
        for (int i = 3; i < 5; i++) launched[launches][i] = *(int32_t *)params[i];
    }
    launches++;
    return 0;
}
/* a launch the driver refuses (CUDA_ERROR_LAUNCH_FAILED), counted */
long refused;
int refuse(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
           void *stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream; (void)params;
    (void)extra;
    refused++;
    return 719;
}
"""
KEPT = 4096  # launches whose parameters the stubs keep
# pooled events made up front, so a mark never makes one (cuEventCreate is not stubbed): enough for 100 forwards of
# instructions.py's model held unread (its worker held off)
EVENTS = 1 << 15
DEVICE = torch.device("cpu")  # where the simulated device's tensors and events are
INDEX = -1  # its device index, as CPU tensors give it (``get_device()``)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which(sysconfig.get_config_var("CC") or "gcc")


def available() -> str | None:
    """None where the simulation can run here, else why not."""
    if _compiler() is None:
        return "no C compiler (cc or $CC) to build the driver stubs"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "Triton is not installed"
    try:
        importlib.import_module("torchtrace._native")
    except ImportError:
        return "torchtrace._native is not built"
    return None


class Stubs:
    """The compiled stubs: each entry point's address and how often it was called."""

    def __init__(self, directory: str) -> None:
        # a directory of its own: a second library at a path already loaded would be the first one again
        directory = tempfile.mkdtemp(prefix="stubs-", dir=directory)
        source, library = os.path.join(directory, "stubs.c"), os.path.join(directory, "stubs.so")
        with open(source, "w") as out:
            out.write(STUBS)
        subprocess.run([_compiler(), "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
        self._library = ctypes.CDLL(library)

    def address(self, name: str) -> int:
        return ctypes.cast(getattr(self._library, name), ctypes.c_void_p).value

    def count(self, name: str) -> int:
        return ctypes.c_long.in_dll(self._library, name).value

    def set(self, name: str, value: int) -> None:
        """Sets one of the stubs' ``long`` variables (``spin_ns``)."""
        ctypes.c_long.in_dll(self._library, name).value = value

    def counts(self) -> dict[str, int]:
        return {name: self.count(name) for name in ("records", "launches", "reads", "tensors")}

    def launched(self) -> list[tuple[int, ...]]:
        """(x, values row, counts row, n, stride) of each statistics launch so far (the first ``KEPT``)."""
        kept = (ctypes.c_int64 * 5 * KEPT).in_dll(self._library, "launched")
        return [tuple(kept[index]) for index in range(min(self.count("launches"), KEPT))]


def install(setattr: Callable[[Any, str, Any], None], directory: str | None = None) -> Stubs:
    """Routes torchtrace's CUDA host path through the stubs for CPU tensors, from now on (tests pass pytest's
    ``monkeypatch.setattr``, which undoes it; a benchmark's child process the builtin ``setattr``). Returns the
    stubs, to read their call counts."""
    from torchtrace._capture import device as device_module
    from torchtrace._capture import recorder, stats, steps
    from torchtrace._capture.cuda_driver import DriverEvent
    from torchtrace._capture.device import READ_AS_IS, DriverEventTimer, EventTimer

    triton_stats = importlib.import_module("torchtrace._capture.triton_stats")
    stubs = Stubs(directory or tempfile.mkdtemp(prefix="torchtrace-stubs-"))
    current_device = INDEX.__int__  # a C call returning the simulated device's index, as torch's is
    current_stream = (0).__mul__  # a C call taking the device index, giving the null stream (0)

    # statistics: every tensor through device rows and the C launch of the compiled kernel
    pool = device_module.RowPool()
    setattr(device_module, "ROW_POOL", pool)
    for module in (stats, steps):
        setattr(module, "reduced_on_device", lambda tensor: True)
        setattr(module, "ROW_POOL", pool)
    setattr(device_module, "_triton", triton_stats)
    setattr(
        device_module,
        "fused_kernel",
        lambda x: triton_stats if x.dtype in READ_AS_IS and triton_stats.applies(x) else None,
    )
    setattr(triton_stats, "_current_device", current_device)
    setattr(triton_stats, "_current_raw_stream", current_stream)
    direct = triton_stats.DirectLaunch(stubs.address("launch"), 0xF00, 128, 0, bytes(triton_stats._ARGUMENT_SIZES))
    compiled = {
        (INDEX, dtype, aligned, counted, contiguous): direct
        for dtype in READ_AS_IS
        for aligned in (True, False)
        for counted in (True, False)
        for contiguous in (True, False)
    }
    setattr(triton_stats, "_direct", compiled)
    batch_direct = triton_stats.DirectLaunch(
        stubs.address("launch"), 0xBA7, 128, 0, bytes(triton_stats.BATCH_ARGUMENT_SIZES)
    )
    batched = {(INDEX, dtype, counted): batch_direct for dtype in READ_AS_IS for counted in (True, False)}
    setattr(triton_stats, "_batch_direct", batched)

    # timing: the driver's events, recorded from C through the stub
    driver = types.SimpleNamespace(
        record_address=stubs.address("record"),
        elapsed_address=stubs.address("elapsed"),
        query_address=stubs.address("query"),
        capture_mode_address=stubs.address("exchange"),
        query=lambda handle: 0,  # complete
        synchronize=lambda handle: 0,
        destroy=lambda handle: 0,
    )
    timer = object.__new__(DriverEventTimer)
    EventTimer.__init__(timer, DEVICE, lambda: None, lambda: 0)
    timer.marking = (timer._free, driver.record_address, INDEX, current_device, current_stream)
    events = []
    for handle in range(1, EVENTS + 1):
        event = object.__new__(DriverEvent)
        event.device, event.handle, event._index, event._driver = DEVICE, handle * 16, INDEX, driver
        events.append(event)
    timer.give_back(events)
    setattr(device_module, "_timers", {DEVICE: timer})
    setattr(recorder, "event_timer", lambda device: timer)
    return stubs
