"""CUDA timing events through the driver API, called with the GIL held.

torch's ``Event.record``, ``query`` and ``elapsed_time`` each release the GIL around a call that takes a
microsecond or two. With the worker thread reading events while the model's thread records them, every release
hands the GIL to the other thread and back: on a host-bound forward that cost many times the marks themselves
(benchmarks/gpu_host_costs.py: torch's event against the driver's, idle and beside a busy thread). These calls never
block, so they are made through ``ctypes.PyDLL``, which keeps the GIL; only ``synchronize`` (a wait) lets it go.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any

import torch

try:
    from torchtrace._native import bind_slots as _bind_slots
    from torchtrace._native import driver_call as _driver_call
    from torchtrace._native import elapsed_ms as _elapsed_ms
except ImportError:  # not built (no C compiler at install): ctypes makes the same calls, slower
    _driver_call = _elapsed_ms = _bind_slots = None

_logger = logging.getLogger(__name__)

_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE
_LIBRARIES = ("libcuda.so.1", "nvcuda.dll")


def _load(kind: type[ctypes.CDLL]) -> ctypes.CDLL | None:
    for name in _LIBRARIES:
        try:
            return kind(name)
        except OSError:
            continue
    return None


class _Driver:
    """The driver entry points used here: one handle that keeps the GIL, one that releases it (for waits)."""

    def __init__(self, holding: ctypes.CDLL, releasing: ctypes.CDLL) -> None:
        self.create = holding.cuEventCreate
        self.record = holding.cuEventRecord
        self.query = holding.cuEventQuery
        self.elapsed = getattr(holding, "cuEventElapsedTime", None) or holding.cuEventElapsedTime_v2
        self.destroy = getattr(holding, "cuEventDestroy_v2", None) or holding.cuEventDestroy
        self.synchronize = releasing.cuEventSynchronize  # blocks until the device gets there: the GIL goes
        self.exchange_capture_mode = holding.cuThreadExchangeStreamCaptureMode  # never blocks
        self.record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]  # event, stream
        for function in (self.query, self.destroy, self.synchronize):
            function.argtypes = [ctypes.c_void_p]
        self.create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self.elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        # the entry points' addresses, for the compiled module's calls (no ctypes conversion per call)
        self.record_address = ctypes.cast(self.record, ctypes.c_void_p).value
        self.elapsed_address = ctypes.cast(self.elapsed, ctypes.c_void_p).value
        self.query_address = ctypes.cast(self.query, ctypes.c_void_p).value
        self.capture_mode_address = ctypes.cast(self.exchange_capture_mode, ctypes.c_void_p).value
        self.launch_address = ctypes.cast(holding.cuLaunchKernel, ctypes.c_void_p).value
        self.param_info = getattr(holding, "cuFuncGetParamInfo", None)  # CUDA 12.4 and later
        if self.param_info is not None:
            self.param_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                        ctypes.POINTER(ctypes.c_size_t)]  # fmt: skip


_driver: _Driver | None | bool = None  # False: no driver library here


def driver() -> _Driver | None:
    """The CUDA driver's entry points, or None where the library cannot be loaded."""
    global _driver
    if _driver is None:
        holding, releasing = _load(ctypes.PyDLL), _load(ctypes.CDLL)
        try:
            _driver = _Driver(holding, releasing) if holding is not None and releasing is not None else False
        except AttributeError as error:  # a driver without these entry points
            _logger.debug("torchtrace: CUDA driver entry points missing: %s", error)
            _driver = False
    return _driver or None


def kernel_param_sizes(function: int) -> tuple[int, ...] | None:
    """The widths in bytes of a loaded kernel's parameters, as the driver reads them (None where it cannot say:
    no driver, or one older than CUDA 12.4)."""
    cuda = driver()
    if cuda is None or cuda.param_info is None:
        return None
    sizes = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    for index in range(64):
        result = cuda.param_info(function, index, ctypes.byref(offset), ctypes.byref(size))
        if result == _INVALID_VALUE:  # past the last parameter
            return tuple(sizes)
        if result:
            return None
        sizes.append(size.value)
    return None


def _check(result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"torchtrace: {what} failed with CUDA error {result}")


class DriverEvent:
    """A timing event of one device, with the interface of ``torch.cuda.Event`` that torchtrace uses.

    ``record`` takes the stream as a raw handle (``torch._C._cuda_getCurrentRawStream``)."""

    __slots__ = ("device", "handle", "_index", "_driver")

    def __init__(self, device: torch.device, cuda: _Driver) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._driver = cuda
        handle = ctypes.c_void_p()
        with torch.cuda.device(self._index):  # made in the device's (primary) context
            _check(cuda.create(ctypes.byref(handle), 0), "cuEventCreate")  # 0: CU_EVENT_DEFAULT, timing on
        self.handle = handle.value

    def record(self, stream: int) -> None:
        if torch._C._cuda_getDevice() == self._index:
            _check(self._record(stream), "cuEventRecord")
            return
        with torch.cuda.device(self._index):  # stream 0 is the legacy default stream of the current context
            _check(self._record(stream), "cuEventRecord")

    def _record(self, stream: int) -> int:
        if _driver_call is not None:
            return _driver_call(self._driver.record_address, self.handle, stream)
        return self._driver.record(self.handle, stream)

    def query(self) -> bool:
        result = self._driver.query(self.handle)
        if result == _NOT_READY:
            return False
        _check(result, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        _check(self._driver.synchronize(self.handle), "cuEventSynchronize")

    def elapsed_time(self, end: DriverEvent) -> float:
        """Milliseconds from this event to ``end``, both complete."""
        if _elapsed_ms is not None:
            result, elapsed = _elapsed_ms(self._driver.elapsed_address, self.handle, end.handle)
            _check(result, "cuEventElapsedTime")
            return elapsed
        milliseconds = ctypes.c_float()
        _check(self._driver.elapsed(ctypes.byref(milliseconds), self.handle, end.handle), "cuEventElapsedTime")
        return milliseconds.value

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the library may be gone already
            self._driver.destroy(self.handle)


if _bind_slots is not None:  # the compiled hot path reads its handle by offset
    _bind_slots(DriverEvent, "event")


def current_raw_stream(device: torch.device) -> Any:
    """A callable returning the raw handle of ``device``'s current stream (a C call, no Stream object made)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch._C._cuda_getCurrentRawStream
    return lambda: current(index)


THREAD_LOCAL_CAPTURE = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL


def exchange_capture_mode(mode: int) -> int | None:
    """Sets the calling thread's CUDA stream-capture mode; returns the mode it had, or None where there is no driver
    (or it refused: logged)."""
    cuda = driver()
    if cuda is None:
        return None
    exchanged = ctypes.c_int(mode)
    result = cuda.exchange_capture_mode(ctypes.byref(exchanged))
    if result:
        _logger.debug("torchtrace: cuThreadExchangeStreamCaptureMode returned %d", result)
        return None
    return exchanged.value


def tolerate_graph_captures() -> None:
    """Puts the calling thread in CUDA's thread-local stream-capture mode, as torch's NCCL watchdog does: in the
    default (global) mode, an event query from any thread invalidates a CUDA graph that another thread is
    capturing. The worker only queries events recorded before, and outside, any capture."""
    exchange_capture_mode(THREAD_LOCAL_CAPTURE)
