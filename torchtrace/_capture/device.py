"""Accelerator work started by the hooks and read back once the device has done it.

Two things must not happen inside a hook on a GPU: waiting for the device (``.item()``, ``.tolist()``,
``synchronize``), and timing with the host clock, which measures kernel launch, not execution. So:

- ``EventTimer`` marks module boundaries with timing events taken from a pool; durations are read when the
  events are complete, off the hot path, and the events go back to the pool.
- ``StatRows`` gives each tensor's statistics a row in preallocated device buffers; ``seal()`` copies the used
  rows to pinned host memory with one non-blocking copy per buffer and records an event; the values are read
  once that event is complete, and the buffers go back to their pool.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from torchtrace._capture.cuda_driver import DriverEvent, current_raw_stream, driver
from torchtrace._core import settings

try:
    from torchtrace._native import bind_slots as _bind_slots
    from torchtrace._native import elapsed_since as _elapsed_since
    from torchtrace._native import mark_event as _mark_event
except ImportError:  # not built: DriverEvent's ctypes calls
    _elapsed_since = _mark_event = _bind_slots = None

_logger = logging.getLogger(__name__)

# A row summed by the Triton kernel holds RAW_COLUMNS; one reduced with torch ops holds mean, std, min, max, norm
# in its first five columns (``finish_raw`` turns the first kind into the second).
RAW_COLUMNS = ("sum_d", "squares_d", "min", "max", "squares", "shift")
RAW_START = (0.0, 0.0, math.inf, -math.inf, 0.0, 0.0)
COUNT_COLUMNS = ("nan_count", "inf_count", "nonzero")
# Rows are padded to 32 bytes (8 float32, 4 int64): every row then starts 16-byte aligned, and Triton compiles one
# kernel variant per dtype instead of one per row alignment.
VALUE_WIDTH, COUNT_WIDTH = 8, 4
READ_AS_IS = (torch.float32, torch.float16, torch.bfloat16)  # dtypes reduced without a conversion first
BLOCK_ROWS = 256  # rows per buffer block; a forward needing more takes more blocks (kept for the next one)
MAX_ROWS = 1 << 16  # per forward or step: a step that is never closed must not grow pinned memory forever


class EventTimer:
    """Timing events on one device's current stream, recycled through a pool (creating one costs microseconds).

    A mark that cannot be recorded is None (the call keeps its host times) and is logged once: a timing event
    must never break the user's forward."""

    __slots__ = ("device", "_new_event", "_free", "_current_stream", "_failed")

    def __init__(self, device: torch.device, new_event: Callable[[], Any], current_stream: Callable[[], Any]) -> None:
        self.device = device
        self._new_event = new_event
        self._current_stream = current_stream
        self._free: deque = deque()  # append/pop are atomic: autograd threads and the worker share it
        self._failed = False

    def give_back(self, events: Iterable[Any]) -> None:
        """Events this timer marked, read: back to its pool."""
        self._free.extend(events)

    def mark(self) -> Any:
        try:  # not `if free:` then pop: another thread may take the last one in between
            event = self._free.pop()
        except IndexError:
            event = None
        try:
            if event is None:
                event = self._new_event()
            event.record(self._current_stream())
        except Exception as error:
            if event is not None:
                self._free.append(event)
            if not self._failed:
                self._failed = True
                _logger.warning("torchtrace: a CUDA timing event failed (%s); such calls keep host times", error)
            return None
        return event


class DriverEventTimer(EventTimer):
    """An ``EventTimer`` of the driver's events (``DriverEvent``): a pooled event recorded on the current device in
    one C call (``_native.mark_event``; the general ``mark``'s Python costs ~2 us more a mark on an H200 host, twice
    a call). ``marking``: what that call reads, also read by ``_native.traced_call`` for a call's end event."""

    __slots__ = ("marking",)

    def __init__(self, device: torch.device, cuda: Any) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        super().__init__(device, lambda: DriverEvent(device, cuda), current_raw_stream(device))
        self.marking = (self._free, cuda.record_address, index, _current_device, _current_raw_stream)

    def mark(self) -> Any:
        event = _mark_event(self.marking) if _mark_event is not None else None
        # None: the pool empty, another device current, or the record refused: the general path makes a new event,
        # records on the event's device, or says why it failed
        return event if event is not None else EventTimer.mark(self)


if _bind_slots is not None:
    _bind_slots(DriverEventTimer, "timer")


_current_device = getattr(torch._C, "_cuda_getDevice", None)  # CUDA builds of torch only, as the driver's events
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_timers: dict[torch.device, EventTimer] = {}


def recycle(events: Iterable[Any]) -> None:
    """Timing events back to the pool of the device each was recorded on (a step's may come from several)."""
    for event in events:
        if event is not None:
            _timers[event.device]._free.append(event)


def capturing_cuda_graph() -> bool:
    """Whether this thread's current CUDA stream is being captured into a graph (False where CUDA was never used:
    asking would initialise it). Timing events are not allowed there, and work queued there runs only at replay."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def event_timer(device: torch.device | None) -> EventTimer | None:
    """The timer of a CUDA device (None elsewhere: the host clock is the device's clock there)."""
    if device is None or device.type != "cuda":
        return None
    timer = _timers.get(device)
    if timer is None:
        cuda = driver()
        if cuda is not None:  # events that keep the GIL (see cuda_driver)
            timer = DriverEventTimer(device, cuda)
        else:
            timer = EventTimer(
                device, lambda: torch.cuda.Event(enable_timing=True), lambda: torch.cuda.current_stream(device)
            )
        _timers[device] = timer
    return timer


def completion_event(device: torch.device) -> Any:
    """An event recorded now on the device's current stream (None where work is synchronous: the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_ns(start: Any, end: Any) -> int:
    return int(start.elapsed_time(end) * 1_000_000)  # milliseconds -> nanoseconds


def elapsed_since(origin: Any, events: list) -> list[int]:
    """Nanoseconds from ``origin`` to each of ``events`` (all complete, of origin's device): the driver's events in
    one C call, others one by one."""
    if _elapsed_since is not None and type(origin) is DriverEvent:
        return _elapsed_since(origin._driver.elapsed_address, origin.handle, events)  # their handles read in C
    return [elapsed_ns(origin, event) for event in events]


class _Block:
    __slots__ = (
        "values",
        "counts",
        "host_values",
        "host_counts",
        "start",
        "values_address",
        "counts_address",
        "_views",
    )

    def __init__(self, device: torch.device) -> None:
        # Normal tensors, also when made under inference_mode: blocks are pooled, and a later forward outside it
        # (training after a validation pass) resets them in place, which torch refuses on inference tensors.
        with torch.inference_mode(False):
            # filled on the device: torch.tensor(RAW_START, device=...) would be a synchronizing host-to-device copy
            self.start = torch.zeros((BLOCK_ROWS, VALUE_WIDTH), dtype=torch.float32, device=device)
            for column, value in enumerate(RAW_START):
                if value:
                    self.start[:, column] = value
            self.values = torch.empty((BLOCK_ROWS, VALUE_WIDTH), dtype=torch.float32, device=device)
            self.counts = torch.empty((BLOCK_ROWS, COUNT_WIDTH), dtype=torch.int64, device=device)
            pinned = device.type == "cuda"  # non_blocking copies need pinned host memory
            self.host_values = torch.empty(self.values.shape, dtype=torch.float32, pin_memory=pinned)
            self.host_counts = torch.empty(self.counts.shape, dtype=torch.int64, pin_memory=pinned)
        # the kernel's C launch takes a row's addresses; a row's views (a first launch, torch ops) are made when
        # first asked for and kept: indexing a tensor costs ~3 us a view on an H100 host, all 256 rows' ~1 ms
        self.values_address, self.counts_address = self.values.data_ptr(), self.counts.data_ptr()
        self._views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * BLOCK_ROWS

    def views(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(float row, count row) of row ``row``, as tensors."""
        views = self._views[row]
        if views is None:
            with torch.inference_mode(False):  # normal views, as the block's tensors (see __init__)
                views = self._views[row] = (self.values[row], self.counts[row])
        return views

    def row_addresses(self, row: int) -> tuple[int, int]:
        """(float row, count row) of row ``row``, as addresses (what the batch kernel takes)."""
        return self.values_address + row * VALUE_WIDTH * 4, self.counts_address + row * COUNT_WIDTH * 8

    def reset(self) -> None:
        """Two launches per block and forward: the Triton kernel adds into its row."""
        self.values.copy_(self.start)
        self.counts.zero_()


if _bind_slots is not None:  # the compiled hot path reads and writes its slots by offset
    _bind_slots(_Block, "block")


class StatRows:
    """Statistics rows of one forward (or of one step's gradients) on one device.

    ``reserve`` may be called from several threads (autograd runs backward on one thread per device).
    """

    __slots__ = ("device", "_pool", "_blocks", "_used", "_lock", "done", "sealed", "_host")

    def __init__(self, device: torch.device, pool: RowPool) -> None:
        self.device = device
        self._pool = pool
        self._blocks: list[_Block] = []
        self._used = 0
        self._lock = threading.Lock()
        self.done: Any = None  # event after the copy to the host; None where copies are synchronous (CPU)
        self.sealed = False
        self._host: tuple[np.ndarray, np.ndarray] | None = None

    def reserve(self) -> tuple[int, _Block, int] | None:
        """(index, block, row in the block) of a row to reduce one tensor into; None when MAX_ROWS are used."""
        with self._lock:
            index = self._used
            if index >= MAX_ROWS:
                return None
            self._used += 1
            self._block_for(index)
        block_index, row = divmod(index, BLOCK_ROWS)
        return index, self._blocks[block_index], row

    def grow(self) -> None:
        """The block of the next row, where it is not made yet (``_native.launch_taken`` reserves rows in made
        blocks only)."""
        with self._lock:
            if self._used < MAX_ROWS:
                self._block_for(self._used)

    def _block_for(self, index: int) -> None:
        """Makes the block that row ``index`` is in, if it is the next one (the lock held)."""
        if index // BLOCK_ROWS == len(self._blocks):
            block = self._pool.block(self.device)
            block.reset()
            self._blocks.append(block)

    def seal(self) -> Any:
        """Starts the copy of the used rows to the host; returns the event marking its completion (or None)."""
        left = self._used
        # Only CUDA has the event that says when a non-blocking copy is done: other accelerators (MPS, XPU) copy
        # synchronously, once per forward or step.
        non_blocking = self.device.type == "cuda"
        for block in self._blocks:
            rows = min(left, BLOCK_ROWS)
            if rows <= 0:
                break
            block.host_values[:rows].copy_(block.values[:rows], non_blocking=non_blocking)
            block.host_counts[:rows].copy_(block.counts[:rows], non_blocking=non_blocking)
            left -= rows
        self.done = completion_event(self.device)
        self.sealed = True
        return self.done

    def row(self, index: int) -> tuple[list[float], list[int]]:
        """One row's values; waits for the copy if it is still running (the dispatcher waits for ``done`` first)."""
        values, counts = self.host_rows()
        return values[index, : len(RAW_COLUMNS)].tolist(), counts[index, : len(COUNT_COLUMNS)].tolist()

    def host_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, counts) of every used row, as copied to the host; waits for the copy if it is still running."""
        if self._host is None:
            if not self.sealed:
                raise RuntimeError("torchtrace: statistics rows read before their copy to the host was started")
            if self.done is not None and not self.done.query():  # query: no sync when done (the worker's case)
                self.done.synchronize()
            used = self._used
            self._host = (
                np.concatenate([block.host_values.numpy() for block in self._blocks])[:used],
                np.concatenate([block.host_counts.numpy() for block in self._blocks])[:used],
            )
        return self._host

    def release(self) -> None:
        """Gives the buffers back once every row was read."""
        blocks, self._blocks = self._blocks, []
        self._pool.give_back(self.device, blocks)


if _bind_slots is not None:
    _bind_slots(StatRows, "rows")


@dataclass(slots=True)
class DeviceWork:
    """What a forward (or a step's backward) left running on a device, and what goes back to the pools after."""

    rows: list[StatRows]
    timer: EventTimer | None = None
    done: list = field(default_factory=list)  # events whose completion makes timings and statistics readable

    def __post_init__(self) -> None:
        self.done.extend(rows.done for rows in self.rows if rows.done is not None)

    def ready(self) -> bool:
        return all(event.query() for event in self.done)

    def wait(self) -> None:
        for event in self.done:
            if not event.query():
                event.synchronize()

    def release(self, timing_events: Iterable[Any] = ()) -> None:
        for rows in self.rows:
            rows.release()
        self.rows = []
        recycle(timing_events)


class RowPool:
    """Device and pinned host buffers, reused forward after forward."""

    def __init__(self) -> None:
        self._free: dict[torch.device, deque] = {}

    def block(self, device: torch.device) -> _Block:
        try:  # threads share the pool (autograd's device threads, a server's request threads)
            return self._free.setdefault(device, deque()).pop()
        except IndexError:
            return _Block(device)

    def give_back(self, device: torch.device, blocks: list[_Block]) -> None:
        self._free.setdefault(device, deque()).extend(blocks)


ROW_POOL = RowPool()


_triton: Any = None  # the triton_stats module once imported; False when Triton is not installed


def fused_kernel(x: torch.Tensor) -> Any:
    """The Triton kernel's module when it can reduce ``x`` (a CUDA tensor, Triton installed), else None."""
    global _triton
    if not x.is_cuda:
        return None
    if _triton is None:
        try:
            _triton = (
                importlib.import_module("torchtrace._capture.triton_stats") if settings.current().triton else False
            )
        except ImportError:  # CPU builds of torch do not ship Triton; the torch-op path is used
            _triton = False
    return _triton if _triton and x.dtype in READ_AS_IS and _triton.applies(x) else None


# as _native.launch_taken reserves a row: rows a block, rows at most, bytes a row (float32 and int64 columns)
ROW_GEOMETRY = (BLOCK_ROWS, MAX_ROWS, VALUE_WIDTH * 4, COUNT_WIDTH * 8)


def launch_plan(x: torch.Tensor, n: int, stride: int, counted: bool) -> tuple | None:
    """How ``_native.launch_taken`` launches the statistics of tensors of ``x``'s kind from C (``x``: one the fused
    kernel has just reduced), or None where it cannot: see ``triton_stats.launch_plan``."""
    return _triton.launch_plan(x, n, stride, counted, ROW_GEOMETRY) if _triton else None


def kernel_works() -> bool:
    """Whether the Triton kernels are in use (imported for a CUDA tensor, and none has failed)."""
    return bool(_triton)


def launch_batch(key: tuple, stream: Any, members: list[tuple[int, int, int, int]]) -> None:
    """One launch of the batch kernel: see ``triton_stats.launch_batch``."""
    _triton.launch_batch(key, stream, members)


def raw_stream(x: torch.Tensor) -> int:
    """The raw current stream of a device tensor's device, as the kernels launch on it (0 under the interpreter)."""
    return _triton.raw_stream(x.get_device())


def reduce(
    x: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, counted: bool, stride: int = 1, taken: bool = False
) -> bool:
    """Reduces a real tensor (every ``stride``-th element) into one row without reading anything back; True when
    the row holds raw sums. ``taken``: a tensor of a dtype, shape and layout the fused kernel took before (its
    checks are skipped)."""
    global _triton
    kernel = (_triton or None) if taken else fused_kernel(x)
    if kernel is not None:
        try:
            kernel.reduce_row(x, values, counts, counted, stride)
            return True
        except Exception as error:  # Triton too old for the kernel, an unsupported GPU: compile or launch failed
            kernel.forget_compiled()
            _triton = False
            _logger.warning("torchtrace: the Triton statistics kernel failed (%s); using torch ops from now on", error)
    x = every_nth(x, stride)
    reduce_into(x if x.dtype == torch.float32 else x.float(), values, counts, counted)
    return False


def every_nth(x: torch.Tensor, stride: int) -> torch.Tensor:
    """The evenly spaced sample of a sampled tensor (a view of contiguous data), or the tensor itself."""
    return x.reshape(-1)[::stride] if stride > 1 else x


def finish_raw(values: list[float], n: int, nan_count: int, inf_count: int) -> tuple[float, float, float, float, float]:
    """(mean, std, min, max, norm) of a row of raw sums, with torch's answers for data holding NaN or Inf."""
    sum_d, squares_d, low, high, squares, shift = values
    if nan_count:
        return math.nan, math.nan, math.nan, math.nan, math.nan
    mean = shift + sum_d / n  # Inf, or NaN for Infs of both signs, as torch.mean gives
    if inf_count:
        return mean, math.nan, low, high, math.inf
    variance = (squares_d - sum_d * sum_d / n) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(max(variance, 0.0)), low, high, math.sqrt(squares)


def finish_raw_rows(values: np.ndarray, nan_count: np.ndarray, inf_count: np.ndarray, n: np.ndarray,
                    raw: np.ndarray) -> tuple[np.ndarray, ...]:  # fmt: skip
    """``finish_raw`` of many rows at once, in numpy (the rows of a forward, read once on the host): (mean, std, min,
    max, norm) columns of float64 ``values`` rows, raw sums where ``raw`` and torch ops' values elsewhere."""
    sum_d, squares_d, low, high, squares, shift = (values[:, column] for column in range(len(RAW_COLUMNS)))
    with np.errstate(all="ignore"):  # Inf - Inf is NaN here as in finish_raw, never a warning
        mean = shift + sum_d / n
        variance = np.where(n > 1, (squares_d - sum_d * sum_d / n) / np.maximum(n - 1, 1), 0.0)
        std = np.sqrt(np.maximum(variance, 0.0))
        norm = np.sqrt(squares)
    nans, infs = raw & (nan_count > 0), raw & (nan_count == 0) & (inf_count > 0)
    std[infs] = math.nan
    norm[infs] = math.inf
    mean, std, low, high, norm = (
        np.where(raw, column, values[:, position]) for position, column in enumerate((mean, std, low, high, norm))
    )
    for column in (mean, std, low, high, norm):
        column[nans] = math.nan
    return mean, std, low, high, norm


def reduce_into(x: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, counted: bool) -> None:
    """Reduces a float32 tensor into one row with torch ops (about ten launches), without reading anything back.

    ``counted``: whether the non-zero count (for zero_fraction) is wanted; it costs two more passes. Derived values
    (abs-max, zero fraction) are computed on the host from the row.
    """
    n = x.numel()
    torch.mean(x, out=values[0])
    torch.std(x, correction=1 if n > 1 else 0, out=values[1])  # one element: 0, as on the host path
    torch.aminmax(x, out=(values[2], values[3]))
    torch.linalg.vector_norm(x, out=values[4])
    dims = tuple(range(x.dim()))
    torch.sum(torch.isnan(x), dims, out=counts[0])
    torch.sum(torch.isinf(x), dims, out=counts[1])
    if counted:
        torch.sum(x != 0, dims, out=counts[2])
