"""Statistics of several device tensors reduced by one kernel launch (``Stats(batch=N)``, opt-in).

On a GPU a forward is often bound by its host: each launch costs the model's thread microseconds, and the per-tensor
statistics launch is a large part of what torchtrace adds to a call. Batching queues a tensor (a reference, its version
and its row) instead of launching, and reduces the queue with one launch of ``triton_stats._batch_kernel`` per ``N``
tensors, when the tensors queued hold ``bound`` bytes (they are kept alive until then), and when the forward ends.

A kernel launched later reads the values as they are then, not as the module returned them: an output changed in
place after its module returned (``out += identity``, ``ReLU(inplace=True)`` after a norm) would give wrong
statistics. So:

- only tensors with a version counter are queued (never inference tensors: ``inference_mode`` launches at once);
- a kind of tensor (dtype, shape, device, layout) is queued only after ``LEARNING_FORWARDS`` forwards in which every
  one of its tensors was summarised at once *and* found unchanged when the queue was next reduced; a kind found
  changed is summarised at once from then on;
- a queued tensor found changed when its batch is launched is not reduced: its statistics say so
  (``CHANGED_IN_PLACE``), and its kind is summarised at once from then on. Nothing wrong is ever reported.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torchtrace._capture import device

try:
    from torchtrace._native import bind_slots as _bind_slots
    from torchtrace._native import launch_queued as _launch_queued
except ImportError:  # not built: the queue is Python's (batching needs the compiled launch anyway)
    _launch_queued = _bind_slots = None

_logger = logging.getLogger(__name__)

LEARNING_FORWARDS = 2  # whole forwards a kind is checked in before its tensors are queued
CHANGED_IN_PLACE = (
    "changed in place after its module returned, before its batched statistics were read; "
    "tensors of its kind are summarised at once from now on"
)


def learning() -> list[int]:
    """A kind's batching state, shared by the C and Python paths: [forwards left to check; 0: queued; -1: never]."""
    return [LEARNING_FORWARDS]


class StatBatch:
    """The queue of one thread's forwards: ``entries`` of (tensor, version, its kind's state, its stats or None for
    a tensor only checked, batch kernel key, raw stream, address, values row address, counts row address, elements).
    ``_native.stats_taken`` appends to it and launches it as ``queue`` and ``launch`` do (one launch a kernel key and
    stream among the entries), in C where it can (every tensor unchanged, the kernels compiled), else by calling
    ``launch``; ``finish`` launches what is left at the forward's end the same way (``_native.launch_queued``)."""

    __slots__ = ("size", "bound", "limits", "entries", "bytes", "checked", "plan", "_failed")

    def __init__(self, size: int, bound: int) -> None:
        self.size = size  # tensors a launch reduces (at most triton_stats.BATCH)
        self.bound = bound  # bytes of queued tensors that launch the queue
        self.limits = (size, bound)  # both, read by C in one attribute read
        self.entries: list[tuple] = []
        self.bytes = 0
        self.checked: list[list[int]] = []  # states of kinds found unchanged since the forward began
        self.plan: tuple | None = None  # the C launch plan of the tensor that began the queue (set by C)
        self._failed = False

    def queue(self, entry: tuple, nbytes: int) -> None:
        """Queues one entry (see the class) holding ``nbytes``; launches the queue where it is then full."""
        self.entries.append(entry)
        self.bytes += nbytes
        if len(self.entries) >= self.size or self.bytes >= self.bound:
            self.launch()

    def launch(self) -> None:
        """Reduces the queued tensors unchanged since they were queued, ``size`` a launch; never raises (it runs in
        the user's forward)."""
        entries, self.entries, self.bytes = self.entries, [], 0
        groups: dict[tuple, list[tuple[int, int, int, int]]] = {}
        for tensor, version, state, stats, key, stream, address, values, counts, n in entries:
            if tensor._version != version:  # changed in place since: not read, and its kind no longer queued
                state[0] = -1
                if stats is not None:
                    stats.pop("_pending", None)
                    stats["stats_error"] = CHANGED_IN_PLACE
            elif stats is None:  # summarised at once, checked only
                self.checked.append(state)
            else:
                groups.setdefault((key, stream), []).append((address, values, counts, n))
        for (key, stream), members in groups.items():
            for first in range(0, len(members), self.size):
                self._launch(key, stream, members[first : first + self.size], entries)

    def _launch(self, key: tuple, stream: Any, members: list, entries: list[tuple]) -> None:
        try:
            device.launch_batch(key, stream, members)
        except Exception as error:  # a statistic must never break the user's forward
            refused = {member[1] for member in members}  # their rows, by address
            for _, _, state, stats, _, _, _, values, _, _ in entries:
                if stats is not None and values in refused:
                    stats.pop("_pending", None)
                    stats["stats_error"] = f"batched statistics launch failed: {error}"
                    state[0] = -1
            if not self._failed:
                self._failed = True
                _logger.warning("torchtrace: a batched statistics launch failed (%s); launching one by one", error)

    def finish(self) -> None:
        """The forward ended: the queue reduced, and kinds found unchanged all through it one forward closer to
        being queued."""
        if self.entries and not (_launch_queued is not None and _launch_queued(self)):
            self.launch()
        seen: set[int] = set()
        for state in self.checked:
            if id(state) not in seen and state[0] > 0:
                seen.add(id(state))
                state[0] -= 1
        self.checked = []


if _bind_slots is not None:  # the compiled hot path reads and writes its slots by offset
    _bind_slots(StatBatch, "batch")


def queue_tensor(batch: StatBatch, tensor: torch.Tensor, version: int, state: list[int], stats: dict[str, Any],
                 rows: device.StatRows, wanted: frozenset) -> bool:  # fmt: skip
    """Queues a contiguous device tensor of a kind queued from now on (``state`` 0) into the next row of ``rows``,
    its ``stats`` pending on that row (as ``device.device_stats`` leaves them): True; False where it is to be
    reduced at once (not 16-byte aligned; no row left, which the caller's path reports; the kernel failed before)."""
    address = tensor.data_ptr()
    if address % 16 or not device.kernel_works():
        return False
    reserved = rows.reserve()
    if reserved is None:
        return False
    index, block, row = reserved
    n = tensor.numel()
    stats["_pending"] = (rows, index, n, wanted, True, 1)
    entry = (tensor, version, state, stats, batch_key(tensor, wanted), device.raw_stream(tensor), address,
             *block.row_addresses(row), n)  # fmt: skip
    batch.queue(entry, n * tensor.element_size())
    return True


def check_later(batch: StatBatch, tensor: torch.Tensor, version: int, state: list[int], wanted: frozenset) -> None:
    """Queues a tensor just summarised at once, of a kind still checked (``state`` > 0): to be found unchanged or
    changed when the queue is next reduced."""
    entry = (tensor, version, state, None, batch_key(tensor, wanted), device.raw_stream(tensor), 0, 0, 0, 0)
    batch.queue(entry, tensor.numel() * tensor.element_size())


def batch_key(tensor: torch.Tensor, wanted: frozenset) -> tuple:
    """The batch kernel a tensor is reduced by: (device index, dtype, whether zeros are counted)."""
    return tensor.get_device(), tensor.dtype, "zero_fraction" in wanted
