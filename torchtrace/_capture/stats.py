"""Tensor statistics, computed inside the post-hook: few torch ops, one host read on CPU, none on GPU.

Each tensor found in a module's output (or input) is summarised into a flat dict of OTel-ready values. On CPU the
values are read at once (a read, not a sync). On an accelerator they are reduced into a row of the forward's
device buffer (``device.StatRows``), copied to the host once per forward and read off the hot path (``resolve``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import sys
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from torchtrace._capture import device as _device
from torchtrace._capture.batched import StatBatch, check_later, learning, queue_tensor
from torchtrace._capture.device import (
    READ_AS_IS,
    ROW_POOL,
    StatRows,
    every_nth,
    finish_raw,
    finish_raw_rows,
    launch_plan,
    reduce,
)
from torchtrace._core.calls import error_text
from torchtrace._core.options import STAT_NAMES, StatFunction

try:
    from torchtrace._native import bind_slots as _bind_slots
    from torchtrace._native import copy as _copy
    from torchtrace._native import float_stats as _one_pass
    from torchtrace._native import launch_taken as _launch_taken
    from torchtrace._native import name_rows as _name_rows
    from torchtrace._native import pending_rows as _pending_rows
    from torchtrace._native import rows_table as _rows_table
    from torchtrace._native import stat_rows as _table_rows
    from torchtrace._native import stats_taken as _stats_taken
except ImportError:  # not built (no C compiler at install): numpy's and torch's passes, ctypes: the same values
    _one_pass = _table_rows = _launch_taken = _pending_rows = _name_rows = _rows_table = _bind_slots = None

    def _stats_taken(computer: StatComputer, tensor: torch.Tensor) -> None:
        return None  # the Python path below decides every tensor

    _copy = ctypes.memmove

_logger = logging.getLogger(__name__)

_METADATA = frozenset({"shape", "dtype", "device"})
_NUMERIC = tuple(name for name in STAT_NAMES if name not in _METADATA)
_ALL_NUMERIC = frozenset(_NUMERIC)

MAX_NESTING = 4  # containers deeper than this are not searched for tensors


SMALL_TENSOR = 4096  # at most this many elements: copied in the hook, summarised in one batch per forward
PIECE = 1 << 20  # elements: the most a CPU tensor's statistics copy or convert at once (a strided view, bfloat16)

# One tuple per shape seen: the collector untracks a long-lived tuple of ints, and a dict holding only untracked
# values stays untracked, so a call's statistics never enter the collector's generations (a fresh shape tuple
# makes its dict tracked). Sharing them cuts full collections with records kept (benchmarks/latency.py, linear8).
_SHAPES: dict[tuple, tuple] = {}
_MAX_SHAPES = 10_000  # ever-new shapes (a new sequence length per request) stop being shared past this


class StatComputer:
    """Computes the chosen statistics of a tensor; recognises the last two tensors it summarised while unchanged.

    Torch dispatch costs microseconds per op, so on CPU small tensors are not reduced one by one: the hook copies
    their values (a later in-place op cannot change the copy) and ``finish_forward`` reduces all copies of a
    forward together in numpy. Larger tensors, where the data and not the dispatch dominates, are reduced at once.
    """

    __slots__ = (
        "wanted", "numeric", "extra", "_shape", "_dtype", "_device", "_recent", "_staging", "_copies", "_filled",
        "_dtype_names", "_rows", "_rows_for", "sample", "_all_finite", "_columns", "_codes", "_staged", "_on_device",
        "in_step", "in_transform", "batch", "inference_mode",
    )  # fmt: skip

    def __init__(
        self,
        wanted: Iterable[str],
        extra: Mapping[str, StatFunction],
        rows_for: Callable[[torch.device], StatRows] | None = None,
        sample: int | None = None,
        batch: StatBatch | None = None,
    ) -> None:
        self.wanted = frozenset(wanted)
        self.numeric = any(name in self.wanted for name in _NUMERIC)
        self.extra = dict(extra)
        self._shape = "shape" in self.wanted
        self._dtype = "dtype" in self.wanted
        self._device = "device" in self.wanted
        # The last two tensors summarised, their versions and stats: a container module usually returns its last
        # child's output unchanged (or the one before: a pooled head after the encoder), so the same tensor would
        # otherwise be summarised at every level of nesting. One list of six (last tensor, its version, its stats,
        # then the one before's), not a dict of tuples: nothing is made per call for the garbage collector to track
        # (the stats dicts hold only untracked values); _native.stats_taken reads and shifts it by index.
        self._recent: list = [None, 0, {}, None, 0, {}]
        self._staging: dict[tuple[torch.dtype, int], _Staging] = {}  # small float tensors' values, until finish
        self._copies: list[np.ndarray] = []  # other small tensors' copies and the stats they fill, until finish
        self._filled: list[dict] = []
        self._dtype_names: dict[torch.dtype, str] = {}
        self._rows: dict[torch.device, StatRows] = {}  # this forward's device rows, one set per device
        self._rows_for = rows_for  # in training: the step's rows (copied once per step), else this forward's
        self.in_step = rows_for is not None  # the forward being summarised is part of a step (its rows are the step's)
        self.sample = sample  # summarise at most about this many elements per tensor (opt-in; None: all)
        self._all_finite = True  # no NaN or Inf counted in this forward so far (device rows: not known yet)
        self._columns, self._codes = _wanted_columns(self.wanted)  # of the forward's StatTable; the pass's codes
        # (dtype, shape, layout) of a plain CPU tensor -> (its stats before the values, its staging rows if it is
        # small, else None: the compiled pass): what every tensor of that kind gets, decided once, so the next one
        # costs a lookup and a copy
        self._staged: dict[tuple, tuple[dict, _Staging | None]] = {}
        # (dtype, shape, device index) of a contiguous device tensor the fused kernel took, or (dtype, shape, device
        # index, strides) of a permuted one (attention's transposed output) -> (its stats before the values, its
        # sampling stride, its device, its C launch plan, its batching state): see _remember_device_kind
        self._on_device: dict[tuple, tuple[dict, int, torch.device, tuple | None, list[int] | None]] = {}
        self.batch = batch  # device tensors' launches batched (Stats(batch=N)), else None
        self.in_transform = _in_transform  # what _native.stats_taken asks of a tensor before it reads its memory
        # the forward being summarised began under torch.inference_mode(): its tensors are taken for inference tensors
        # (no version counter) without asking each (its binding cost ~0.1 us a tensor); a tensor that is not one
        # only loses the recognition of an unchanged repeat and batching, never a statistic
        self.inference_mode = False

    def finish_forward(self) -> tuple[list[StatRows], bool, StatTable | None]:
        """Reduces every small tensor copied during this forward into the forward's ``StatTable`` (a row each, which
        its stats dict names), then forgets the copies; starts the copy of the device rows to the host and returns
        them (read by ``resolve`` once copied); and says whether no tensor of the forward is known to hold NaN or Inf
        (then nothing needs looking for its first producer)."""
        if self.batch is not None:  # the queued tensors reduced before the rows are copied
            self.batch.finish()
        self._forget_recent()
        all_finite, self._all_finite = self._all_finite, True
        staged = [staging for staging in self._staging.values() if staging.count]
        if not (staged or self._copies or self._rows):  # nothing copied (statistics off, large tensors only)
            return [], all_finite, None
        groups: list = [(staging, staging.filled) for staging in staged]
        if self._copies:
            groups += _size_groups(self._copies, self._filled)
            self._copies, self._filled = [], []
        table, finite = self._table_of(groups) if groups else (None, True)
        for staging in staged:
            staging.count, staging.filled = 0, []
        all_finite = finite and all_finite
        if any(staging.values.nbytes > _MAX_STAGING_BYTES for staging in staged):  # only a used one grows
            self._staging.clear()  # a forward with very many small tensors: its rows are not kept for the next
            self._staged.clear()
        if not self._rows:
            return [], all_finite, table
        rows = list(self._rows.values())
        self._rows = {}
        for device_rows in rows:
            device_rows.seal()
        return rows, False, table  # read once on the host

    def _table_of(self, groups: list[tuple[_Staging | np.ndarray, list[dict]]]) -> tuple[StatTable | None, bool]:
        """The forward's small tensors reduced group by group (a staging's rows, or other copies of one size) into
        one table, each stats dict given its row (None if every group failed); and whether no row holds NaN or Inf.
        A staging's rows go straight into the table in one compiled call where its rows are finite (skipping the
        general path's slicing and checks), else through ``_stat_rows``."""
        values = np.empty((sum(len(filled) for _, filled in groups), len(self._columns)))
        first, all_finite = 0, True
        for rows, filled in groups:
            staged = type(rows) is _Staging
            try:
                if not (staged and _table_rows is not None and self._staged_rows(rows, values, first)):
                    rows = rows.values[: rows.count] if staged else rows
                    values[first : first + len(filled)], finite = _stat_rows(rows, self._columns)
                    all_finite = finite and all_finite
            except Exception as error:  # a statistic must never break the user's forward
                for stats in filled:
                    stats.pop("_row", None)
                    stats["stats_error"] = error_text(error)
                continue
            # resolve puts the row's values in the place of "_row", the dict's last key; a staging's rows already
            # hold their index in the staging (set as they were copied): only a group after the first moves them
            if not staged:
                for row, stats in enumerate(filled, first):
                    stats["_row"] = row
            elif first:
                for stats in filled:
                    stats["_row"] += first
            first += len(filled)
        return (StatTable(values, self._columns) if first else None), all_finite

    def _staged_rows(self, staging: _Staging, table: np.ndarray, first: int) -> bool:
        """A staging's rows reduced by the compiled pass straight into the table's rows from ``first``; False
        (nothing reliable written) where a row is not finite."""
        return _table_rows(staging.address, staging.count, staging.size, staging.double, self._codes, table, first)

    def _device_rows(self, device: torch.device) -> StatRows:
        if self._rows_for is not None and self.in_step:
            return self._rows_for(device)
        rows = self._rows.get(device)
        if rows is None:
            rows = self._rows[device] = StatRows(device, ROW_POOL)
        return rows

    def __call__(self, tensor: torch.Tensor) -> dict[str, Any]:
        # The common case (a plain CPU tensor of a kind seen before: a lookup and a copy) without a frame of its
        # own (each Python call saved is ~0.15 us of a ~1.5 us call in a forward)
        inference = self.inference_mode or tensor.is_inference()
        if not inference:  # an inference tensor has no version counter: the same object is never trusted twice
            version = tensor._version
            recent = self._recent
            if tensor is recent[0]:
                if version == recent[1]:
                    return recent[2]
            elif tensor is recent[3] and version == recent[4]:
                return recent[5]
        staged = on_device = None
        if type(tensor) is torch.Tensor:
            if tensor.is_cpu:  # inline, not reduced_on_device(): a call costs ~1% of a traced CPU call
                staged = self._staged.get((tensor.dtype, tensor.shape, tensor.layout))
                if staged is None and self._on_device:  # CPU tensors reduced as on a device (tests/test_device.py)
                    if (stats := _stats_taken(self, tensor)) is not None:  # as for a device tensor, below
                        return stats
                    kind = (tensor.dtype, tensor.shape, -1)
                    on_device = self._on_device.get(kind if tensor.is_contiguous() else (*kind, tensor.stride()))
            else:
                # a kind the kernel took before: the rest of this method's path for it, in C (_native.stats_taken)
                if self._on_device and (stats := _stats_taken(self, tensor)) is not None:
                    return stats
                kind = (tensor.dtype, tensor.shape, tensor.get_device())
                on_device = self._on_device.get(kind if tensor.is_contiguous() else (*kind, tensor.stride()))
        if on_device is not None and not _in_transform(tensor):  # laid out as the kernel took it before
            stats = self._reduce_on_device(tensor, *on_device)
        # raw memory as numpy would read it: contiguous, no lazy negation (a neg view)
        elif staged is not None and tensor.is_contiguous() and not tensor.is_neg():
            head, staging = staged
            stats = head.copy()
            try:
                if staging is not None:  # a small tensor: a row of the forward's table
                    staging.add(tensor, stats)
                else:  # a large one of a kind the compiled pass took (checked when its head was kept)
                    one_pass_stats(tensor, tensor.numel(), self.wanted, stats)
                    if stats.get("nan_count") or stats.get("inf_count"):
                        self._all_finite = False
            except Exception as error:  # a statistic must never break the user's forward
                if _in_transform(tensor):  # its values have no memory of their own: see local_values
                    stats = self._compute_in_full(tensor)
                else:
                    stats["stats_error"] = error_text(error)
        else:
            stats = self._compute_in_full(tensor)
        if not inference:
            recent[3] = recent[0]  # the last becomes the one before
            recent[4] = recent[1]
            recent[5] = recent[2]
            recent[0] = tensor
            recent[1] = version
            recent[2] = stats
        return stats

    def _remember_device_kind(self, tensor: torch.Tensor, head: dict, stride: int) -> None:
        """A device tensor the fused kernel reduced as it is (a dtype it reads, one block of memory): the next one of
        its dtype, shape, device and layout gets the same stats before the values, and its row and launch, without
        the general path's checks (~5 us a call on an H200 host, where the device waits for the host). One that
        was converted first (float64, integer, complex) is not remembered: the short path launches on the tensor
        itself."""
        if len(self._on_device) < _MAX_STAGED_KINDS and tensor.dtype in READ_AS_IS:
            kind = (tensor.dtype, tensor.shape, tensor.get_device())
            layout = kind if tensor.is_contiguous() else (*kind, tensor.stride())
            n = -(-tensor.numel() // stride)
            plan = launch_plan(tensor, n, stride, "zero_fraction" in self.wanted) if _launch_taken else None
            batching = learning() if self.batch is not None and stride == 1 else None
            self._on_device[layout] = (head, stride, tensor.device, plan, batching)

    def _reduce_on_device(self, tensor: torch.Tensor, head: dict, stride: int, device: torch.device,
                          plan: tuple | None, batching: list[int] | None) -> dict:  # fmt: skip
        """A tensor of a kind the kernel took before: queued for a batched launch where its kind is (batched.py),
        else launched from C in one call (``_native.launch_taken``) where its ``plan`` applies, else through
        ``device_stats``; and queued to be checked where its kind is still checked for batching."""
        try:
            rows = self._device_rows(device)
            version = -1 if batching is None or tensor.is_inference() else tensor._version
            stats = head.copy() if version >= 0 and batching[0] == 0 else None
            if stats is not None and not queue_tensor(self.batch, tensor, version, batching, stats, rows, self.wanted):
                stats = None
            if stats is None:
                stats = _launch_taken(plan, rows, tensor, head, self.wanted) if plan is not None else None
                if stats is None:
                    stats = head.copy()
                    device_stats(tensor, rows, self.wanted, stats, stride, taken=True)
                if version >= 0 and batching[0] > 0:
                    check_later(self.batch, tensor, version, batching, self.wanted)
            self._all_finite = False
        except Exception as error:  # a statistic must never break the user's forward
            stats = head.copy()
            stats["stats_error"] = error_text(error)
        return stats

    def _forget_recent(self) -> None:
        """The forward is over: its tensors are not held any longer."""
        self._recent[:] = None, 0, {}, None, 0, {}

    def _compute_in_full(self, tensor: torch.Tensor) -> dict[str, Any]:
        plain_input = type(tensor) is torch.Tensor and not _in_transform(tensor)
        if not plain_input:
            tensor = local_values(tensor)
        stats: dict[str, Any] = {}
        if self._shape:
            # a jagged nested tensor's ragged dimension is symbolic: -1 there, as an int-array attribute must be
            shape = tuple(tensor.shape)
            if tensor.is_nested:
                shape = tuple(d if isinstance(d, int) else -1 for d in shape)
            stats["shape"] = _SHAPES.setdefault(shape, shape) if len(_SHAPES) < _MAX_SHAPES else shape
        dtype = tensor.dtype
        if self._dtype:
            name = self._dtype_names.get(dtype)
            if name is None:
                name = self._dtype_names[dtype] = str(dtype).removeprefix("torch.")
            stats["dtype"] = name
        is_cpu = tensor.is_cpu
        if self._device:
            stats["device"] = "cpu" if is_cpu else str(tensor.device)
        if not (self.numeric or self.extra):
            return stats
        n = tensor.numel()
        # meta tensors have no data; sparse and other layouts are described by shape/dtype/device only.
        if not n or tensor.layout is not torch.strided or (not is_cpu and tensor.is_meta):
            return stats
        for name, function in self.extra.items():
            try:
                stats[name] = _user_stat(function, tensor)
            except Exception as error:  # a user statistic that fails costs only itself
                stats["stats_error"] = f"{name}: {error_text(error)}"
        try:
            if self.numeric and _read_in_place(tensor, n, self.sample):  # an expanded view; a strided one sampled
                reduce_view(tensor.detach() if tensor.requires_grad else tensor, self.wanted, stats, self.sample,
                            self._device_rows)  # fmt: skip
                if "_pending" in stats or stats.get("nan_count") or stats.get("inf_count"):
                    self._all_finite = False
            elif self.numeric:
                stride = 1 if self.sample is None else sampling_stride(n, self.sample, stats)
                if stride == 1 and n <= SMALL_TENSOR and not reduced_on_device(tensor):
                    # raw memory as numpy would read it: a plain contiguous tensor, no lazy negation (a neg view)
                    plain = type(tensor) is torch.Tensor and tensor.is_contiguous() and not tensor.is_neg()
                    if dtype in _COPIED_AS_IS and plain:
                        staging = self._staging.get((dtype, n))
                        if staging is None:
                            staging = self._staging[dtype, n] = _Staging(dtype, n)
                        if not (self.extra or tensor.is_nested) and len(self._staged) < _MAX_STAGED_KINDS:
                            self._staged[dtype, tensor.shape, tensor.layout] = (dict(stats), staging)
                        staging.add(tensor, stats)
                    else:
                        self._copies.append(_numpy_copy(tensor.detach()))
                        self._filled.append(stats)
                else:
                    # the stats before the values, kept for the next CPU tensor of this kind (as a small one's)
                    head = dict(stats) if is_cpu and not (self.extra or tensor.is_nested) else None
                    if stride == 1 and plain_float_stats(tensor, self.wanted, stats):
                        if head is not None and len(self._staged) < _MAX_STAGED_KINDS:
                            self._staged[dtype, tensor.shape, tensor.layout] = (head, None)
                    else:
                        x = tensor.detach() if tensor.requires_grad else tensor
                        head = None if self.extra or not plain_input else dict(stats)
                        reduce_now(x, self.wanted, stats, stride, self._device_rows)
                        pending = stats.get("_pending")
                        if head is not None and pending is not None and pending[4]:  # the fused kernel took it
                            self._remember_device_kind(tensor, head, stride)
                    if "_pending" in stats or stats.get("nan_count") or stats.get("inf_count"):
                        self._all_finite = False
        except Exception as error:  # a statistic must never break the user's forward
            _logger.debug("torchtrace: statistics failed for a %s tensor: %s", dtype, error)
            stats["stats_error"] = error_text(error)
        return stats


if _bind_slots is not None:  # the compiled hot path reads and writes its slots by offset
    _bind_slots(StatComputer, "computer")


_functorch = getattr(torch._C, "_functorch", None)
_in_transform: Callable[[torch.Tensor], bool] = (
    _functorch.is_functorch_wrapped_tensor if _functorch is not None else lambda tensor: False
)


def local_values(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in this process's memory that holds what ``tensor`` stands for, summarised in its place: inside
    ``torch.func`` transforms (vmap, grad, jacrev...) the values the transforms compute on (under vmap, every batch
    entry: its shape has the batch dimension); a DTensor's (tensor / sequence parallelism, FSDP2) this rank's local
    shard, its shape the shard's: reducing the DTensor itself would run collectives inside a hook, which hang where
    another rank does not trace the same call. Anything else: itself."""
    while True:
        if _in_transform(tensor):
            tensor = _functorch.get_unwrapped(tensor)
        elif _is_dtensor(tensor):
            tensor = tensor._local_tensor  # to_local() without its autograd node
        else:
            return tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # only where DTensors can exist: never imported for it
    return module is not None and isinstance(tensor, module.DTensor)


_COPIED_AS_IS = frozenset((torch.float32, torch.float64))  # numpy reads them as they are (see _as_real_float)


_BATCH_AT_LEAST = 6  # tensors of one size worth the vectorised path (measured break-even: ~5)


def _one_stats(values: np.ndarray, wanted: Container[str], stats: dict[str, Any]) -> bool:
    """One small copy, reduced with a few numpy calls; False if it holds NaN or Inf."""
    values = values.astype(np.float64)
    n = values.size
    with np.errstate(all="ignore"):  # inf - inf is NaN, as in torch; never a warning in the user's process
        total, squares = float(values.sum()), float(values @ values)
        low, high = float(values.min()), float(values.max())
        mean = total / n
        centered_square = squares - total * mean  # as in _stat_rows: the second pass only where it cancels
        if not centered_square >= 0.5 * squares:
            centered = values - mean
            centered_square = float(centered @ centered)
        # torch.std; for one element 0 (NaN if that element is not finite, as torch's correction=0 gives)
        std = math.sqrt(max(centered_square, 0.0) / (n - 1)) if n > 1 else (0.0 if math.isfinite(total) else math.nan)
    nan_count = inf_count = 0
    if not math.isfinite(squares):
        nan_count, inf_count = int(np.isnan(values).sum()), int(np.isinf(values).sum())
    _fill(
        stats, wanted, n, mean, std, low, high, math.sqrt(squares), int(np.count_nonzero(values)), nan_count, inf_count
    )
    return not (nan_count or inf_count)


def _numpy_copy(x: torch.Tensor) -> np.ndarray:
    """A private flat copy of a small CPU tensor's values (a later in-place op must not change them)."""
    real = _as_real_float(x)
    values = _flat_values(real)
    return values.copy() if real is x else values  # a converted tensor is already a private copy


def _size_groups(copies: list[np.ndarray], filled: list[dict]) -> list[tuple[np.ndarray, list[dict]]]:
    """Flat copies of one forward grouped by size: one (rows, stats) pair per size."""
    groups: dict[int, tuple[list[np.ndarray], list[dict]]] = {}
    for values, stats in zip(copies, filled):
        group = groups.setdefault(values.size, ([], []))
        group[0].append(values)
        group[1].append(stats)
    return [(np.stack(rows), stats) for rows, stats in groups.values()]


def _stat_rows(values: np.ndarray, columns: tuple[str, ...]) -> tuple[np.ndarray, bool]:
    """The statistics ``columns`` of each row of ``values`` (the small tensors of one size of a forward), reduced
    together in numpy (a torch op's dispatch costs more than numpy's whole reduction of a small array): one row of
    float64 each (NaN and Inf counts too); and whether no row holds NaN or Inf.

    In one compiled pass a row (``_native.stat_rows``) where every row is finite; else (or without the module) in
    numpy, which counts NaN and Inf as torch does."""
    table = _table_in_one_pass(values, columns)
    if table is not None:
        return table, True
    if len(values) < _BATCH_AT_LEAST:  # a dozen vectorised calls cost more than a few scalar reductions
        rows, all_finite = [], True
        for row in values:
            stats: dict[str, Any] = {}
            all_finite = _one_stats(row, columns, stats) and all_finite
            rows.append([stats[name] for name in columns])
        return np.array(rows, dtype=np.float64).reshape(len(values), len(columns)), all_finite
    n = values.shape[1]
    values = values.astype(np.float64)  # one pass: exact for what _as_real_float leaves
    with np.errstate(all="ignore"):  # inf - inf is NaN, as in torch; never a warning in the user's process
        sums = values.sum(1)
        squares = _row_dots(values)
        lows, highs = values.min(1), values.max(1)
        mean = sums / n
        # sum((x - mean)^2) = |x|^2 - n mean^2 in float64, without a pass over the values; where the mean
        # carries half of |x|^2 or more (it would cancel) or a value is not finite: the exact second pass
        centered_squares = squares - sums * mean
        cancels = ~(centered_squares >= 0.5 * squares)
        if cancels.any():
            centered_squares[cancels] = _row_dots(values[cancels] - mean[cancels, None])
        all_finite = bool(np.isfinite(squares).all())  # a NaN or Inf anywhere makes its sum of squares so
        computed = {  # only the columns asked for are computed
            "mean": lambda: mean,
            "std": lambda: np.sqrt(np.maximum(centered_squares, 0.0) / max(n - 1, 1)),  # torch.std; 0 for one element
            "min": lambda: lows,
            "max": lambda: highs,
            "abs_max": lambda: np.maximum(np.abs(lows), np.abs(highs)),
            "norm": lambda: np.sqrt(squares),
            "nan_count": lambda: 0 if all_finite else np.isnan(values).sum(1),
            "inf_count": lambda: 0 if all_finite else np.isinf(values).sum(1),
            "zero_fraction": lambda: 1 - np.add.reduce(values != 0, axis=1, dtype=np.int32) / n,  # NaN counts, -0.0 not
        }
        table = np.empty((len(values), len(columns)))
        for index, name in enumerate(columns):
            table[:, index] = computed[name]()
    return table, all_finite


def _table_in_one_pass(values: np.ndarray, columns: tuple[str, ...]) -> np.ndarray | None:
    """The statistics table of a contiguous float32 / float64 array's rows from ``_native.stat_rows``, or None
    (not built, another dtype, or a row not finite)."""
    double = values.dtype == np.float64
    if _table_rows is None or not (double or values.dtype == np.float32) or not values.flags.c_contiguous:
        return None
    codes = _column_codes(columns)
    table = np.empty((len(values), len(columns)))
    if not _table_rows(values.ctypes.data, len(values), values.shape[1], double, codes, table, 0):
        return None
    return table


_COLUMN_CODES: dict[tuple[str, ...], bytes] = {}  # columns -> their positions in _NUMERIC: the compiled passes' codes


def _column_codes(columns: tuple[str, ...]) -> bytes:
    codes = _COLUMN_CODES.get(columns)
    if codes is None:
        codes = _COLUMN_CODES[columns] = bytes(_NUMERIC.index(name) for name in columns)
    return codes


class _Staging:
    """The values of a forward's small contiguous tensors of one dtype and size, one row each, copied in the hook
    with one memcpy (``_native.copy``; a numpy copy costs several times as much); kept and reused forward after
    forward."""

    __slots__ = ("values", "address", "row_bytes", "size", "double", "count", "filled")

    def __init__(self, dtype: torch.dtype, n: int) -> None:
        self.values = np.empty((16, n), dtype=_NUMPY_DTYPES[dtype])
        self.address = self.values.ctypes.data
        self.row_bytes = self.values.strides[0]
        self.size = n  # values a row
        self.double = dtype is torch.float64
        self.count = 0
        self.filled: list[dict] = []  # the stats each row fills

    def add(self, tensor: torch.Tensor, stats: dict) -> None:
        """Copies a contiguous CPU tensor of this dtype and size into the next row."""
        count = self.count
        if count == len(self.values):
            self.values = np.concatenate([self.values, np.empty_like(self.values)])
            self.address = self.values.ctypes.data
        _copy(self.address + count * self.row_bytes, tensor.data_ptr(), self.row_bytes)
        stats["_row"] = count  # its row in the staging (the table's, once finish_forward placed it)
        self.count = count + 1
        self.filled.append(stats)


if _bind_slots is not None:
    _bind_slots(_Staging, "staging")


class StatTable:
    """A forward's statistics of its small CPU tensors, reduced together when the forward ends: a row per tensor
    (float64; ``columns``: the numeric statistics asked for, in ``STAT_NAMES`` order). The tensor's stats dict holds
    its shape, dtype and device, then ``"_row"``: its row, whose values take that key's place (``fill``, or read
    straight from ``values_list()`` by ``resolve``). Held by the ``RawForward``; nothing per tensor on the hot
    path."""

    __slots__ = ("values", "columns", "width", "_list")

    def __init__(self, values: np.ndarray, columns: tuple[str, ...]) -> None:
        self.values = values
        self.columns = columns
        self.width = len(columns)
        self._list: list | None = None

    def values_list(self) -> list:
        """Every value, row after row, as Python values (floats; the NaN / Inf counts as ints): row ``i`` is
        ``[i * width : (i + 1) * width]``. Made once, one list (a list per row would be as many objects for the
        garbage collector to track while the forward's batch is resolved)."""
        if self._list is None:
            typed = self.values.astype(object)
            for index, name in enumerate(self.columns):
                if name in _COUNTS:
                    typed[:, index] = self.values[:, index].astype(np.int64)
            self._list = typed.ravel().tolist()
        return self._list

    def count_mask(self) -> bytes:
        """A byte per column, 1 for a count (NaN / Inf: ints in the attributes), what ``_native.output_call_values``
        reads the table's floats with."""
        mask = _COUNT_MASKS.get(self.columns)
        if mask is None:
            mask = _COUNT_MASKS[self.columns] = bytes(name in _COUNTS for name in self.columns)
        return mask

    def row(self, index: int) -> list:
        start = index * self.width
        return self.values_list()[start : start + self.width]

    def fill(self, stats: dict[str, Any]) -> dict[str, Any]:
        """A stats dict that names a row of this table, with the row's values in place of the name."""
        row = stats.pop("_row", None)
        if row is not None:
            stats.update(zip(self.columns, self.row(row)))
        return stats


# The placeholders a stats dict may end with (its last key; ``summaries`` reads them): a row of the forward's table,
# or a reduction still on a device. Spelled as literals on this file's hot path (a constant, not a global lookup).
ROW = "_row"
PENDING = "_pending"
_COUNTS = frozenset(("nan_count", "inf_count"))
_COUNT_MASKS: dict[tuple[str, ...], bytes] = {}  # a StatTable's columns -> its count_mask() (few: one per stats=)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
_MAX_STAGING_BYTES = 16 << 20  # rows kept between forwards at most per dtype and size
_MAX_STAGED_KINDS = 1024  # (dtype, shape) kinds remembered (a new sequence length per request: no more past this)


def _row_dots(rows: np.ndarray) -> np.ndarray:
    """Each row's dot product with itself: one batched BLAS call (2.7x faster than einsum on 80 x 1024 float64)."""
    return (rows[:, None, :] @ rows[:, :, None]).reshape(-1)


def _as_real_float(x: torch.Tensor) -> torch.Tensor:
    if x.is_quantized:
        x = x.dequantize()
    if x.is_complex():
        return x.abs()  # statistics of the magnitude; documented
    if x.dtype in _COPIED_AS_IS:
        return x
    if x.is_floating_point() or x.dtype == torch.bool:
        return x.float()  # half, bfloat16, fp8: accumulate in float32
    return x.double()  # integers: float64 holds them exactly up to 2**53


def reduced_on_device(tensor: torch.Tensor) -> bool:
    """Whether a tensor's statistics stay on its device until the forward (or step) ends: all but CPU tensors."""
    return not tensor.is_cpu


def sampling_stride(n: int, sample: int | None, stats: dict[str, Any]) -> int:
    """1, or the stride of an evenly spaced sample of at most ``sample`` of the ``n`` elements; a sampled tensor's
    statistics say how many elements they are of ("sampled")."""
    if sample is None or n <= sample:
        return 1
    stride = -(-n // sample)
    stats["sampled"] = -(-n // stride)
    return stride


def _read_in_place(tensor: torch.Tensor, n: int, sample: int | None) -> bool:
    """Whether a tensor is a view whose copy would cost more than its statistics need: expanded (a dimension of
    stride 0 repeats values: ``mask.expand(...)``, the gradient of a ``sum()``), or strided and sampled, unless the
    fused kernel reads it as one block of memory (a permutation of contiguous data, such as attention's transposed
    output): every n-th element in memory order is then as even a sample, read by one launch."""
    if tensor.is_contiguous() or tensor.is_nested or tensor.is_quantized or tensor.layout is not torch.strided:
        return False
    if 0 in tensor.stride():
        return True
    return sample is not None and n > sample and _device.fused_kernel(tensor) is None


def reduce_view(
    x: torch.Tensor,
    wanted: frozenset,
    stats: dict[str, Any],
    sample: int | None,
    device_rows: Callable[[torch.device], StatRows],
) -> None:
    """A tensor of any strides reduced where it lives, nothing materialised: an expanded view's distinct values are
    read once (each dimension of stride 0 cut to one) and their statistics scaled to how often each repeats, which
    is exact; a sample (``sample``: at most about that many values, as ``sampling_stride``) is read in place, every
    n-th element of contiguous data or evenly spaced along each dimension of a strided view. Memory: at most the
    distinct values or the sample (copied where a pass needs contiguous data)."""
    x, repeats = without_repeats(x)
    stride = sampling_stride(x.numel(), sample, stats)
    if stride > 1 and not x.is_contiguous():
        x, stride = evenly_spaced(x, stride), 1
        stats["sampled"] = x.numel()
    if repeats > 1 and "sampled" in stats:
        stats["sampled"] *= repeats  # the values read stand for this many elements
    if not (stride == 1 and plain_float_stats(x, wanted, stats)):
        reduce_now(x, wanted, stats, stride, device_rows, repeats)
        if "_pending" in stats:  # scaled when read (resolve)
            return
    if repeats > 1:
        scale_for_repeats(stats, repeats, -(-x.numel() // stride))


def without_repeats(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the distinct values of an expanded view: each dimension of stride 0 cut to size one, as a view; how many
    elements of ``x`` each stands for). A tensor without such a dimension: (itself, 1)."""
    sizes, strides = list(x.shape), x.stride()
    repeats = 1
    for dimension, (size, stride) in enumerate(zip(x.shape, strides)):
        if stride == 0 and size > 1:
            repeats *= size
            sizes[dimension] = 1
    if repeats == 1:
        return x, 1
    return x.as_strided(sizes, strides, x.storage_offset()), repeats


def evenly_spaced(x: torch.Tensor, stride: int) -> torch.Tensor:
    """A view of about ``x.numel() / stride`` elements of a strided tensor, evenly spaced along each dimension (the
    largest dimensions thinned first, each by about the same factor): a sample read in place, nothing copied."""
    steps = [1] * x.dim()
    left = float(stride)
    order = sorted(range(x.dim()), key=lambda dimension: -x.shape[dimension])
    for remaining, dimension in zip(range(len(order), 0, -1), order):
        step = max(1, min(x.shape[dimension], round(left ** (1 / remaining))))
        steps[dimension] = step
        left /= step
    return x[tuple(slice(None, None, step) for step in steps)]


def scale_for_repeats(stats: dict[str, Any], repeats: int, n: int) -> None:
    """Statistics of ``n`` values made those of the tensor in which each of them appears ``repeats`` times: mean,
    min, max, abs-max and the zero fraction are the same; counts are ``repeats`` times; the norm sqrt(repeats)
    times; the std (correction 1) that of n * repeats values with the same spread."""
    if "std" in stats and n * repeats > 1:
        stats["std"] *= math.sqrt((n - 1) * repeats / (n * repeats - 1))
    if "norm" in stats:
        stats["norm"] *= math.sqrt(repeats)
    for name in ("nan_count", "inf_count"):
        if name in stats:
            stats[name] *= repeats


def reduce_now(
    x: torch.Tensor,
    wanted: frozenset,
    stats: dict[str, Any],
    stride: int,
    device_rows: Callable[[torch.device], StatRows],
    repeats: int = 1,
) -> None:
    """One tensor (every ``stride``-th element), reduced where it lives: into a row of ``device_rows`` on an
    accelerator (``repeats``: how many elements each value stands for, applied when the row is read), with torch
    passes on the CPU."""
    if reduced_on_device(x):
        device_stats(x, device_rows(x.device), wanted, stats, stride, repeats)
    else:
        numeric_stats(every_nth(x, stride), wanted, stats)


def device_stats(
    tensor: torch.Tensor,
    rows: StatRows,
    wanted: frozenset,
    stats: dict[str, Any],
    stride: int = 1,
    repeats: int = 1,
    taken: bool = False,
) -> None:
    """Reduces a tensor (every ``stride``-th element) into a row of ``rows`` on its device; ``resolve`` reads the
    row once it is on the host (and scales it to ``repeats``, see ``scale_for_repeats``). ``taken``: a tensor of a
    kind the fused kernel took before (real, of a dtype it reads: no conversion, no checks)."""
    reserved = rows.reserve()
    if reserved is None:
        stats["stats_error"] = "device statistics rows full: close each training step with handle.step()"
        return
    index, block, row = reserved
    x = tensor.detach() if tensor.requires_grad else tensor  # torch ops (the kernel failed) refuse out= else
    if not taken:
        x = x.dequantize() if x.is_quantized else x
        if x.is_complex():
            x = x.abs()
        elif x.dtype not in READ_AS_IS:  # the rows are float32: float64 and integer data are read in float32
            x = x.float()
    raw = reduce(x, *block.views(row), "zero_fraction" in wanted, stride, taken)
    stats["_pending"] = (rows, index, -(-tensor.numel() // stride), wanted, raw, repeats)


def numeric_stats(tensor: torch.Tensor, wanted: frozenset, stats: dict[str, Any]) -> None:
    """One CPU tensor, reduced at once: in one pass (``_native.float_stats``) where its values are finite and
    contiguous, else in a torch sum and numpy's SIMD passes over the same memory, which count NaN and Inf as torch
    does. One that would be copied whole first (strided, or of a dtype read through a conversion) and holds more than
    ``PIECE`` elements is reduced piece by piece (``_stats_by_pieces``)."""
    if tensor.numel() > PIECE and not (tensor.dtype in _COPIED_AS_IS and tensor.is_contiguous()):
        _stats_by_pieces(tensor, wanted, stats)
        return
    x = _as_real_float(tensor)
    if not plain_float_stats(x, wanted, stats):
        _numpy_stats(x, x.numel(), wanted, stats)


def _stats_by_pieces(tensor: torch.Tensor, wanted: frozenset, stats: dict[str, Any]) -> None:
    """The statistics of a large CPU tensor from those of its pieces of at most ``PIECE`` elements, each copied (or
    converted) alone: memory bounded by a piece, not the tensor (a transposed 1 GB activation copied whole costs 1
    GB more inside the hook). Merged as the whole would give them: counts and the zero fraction add up, the mean
    weighs each piece by its size, the std combines the pieces' spreads about the overall mean (Chan et al.'s
    pairwise update, no cancellation), the norm is the pieces' norms' hypotenuse; NaN and Inf as torch gives them."""
    parts = []
    for piece in _pieces(tensor.detach(), PIECE):
        part: dict[str, Any] = {}
        numeric_stats(piece.contiguous(), _ALL_NUMERIC, part)
        parts.append((piece.numel(), part))
    n = sum(count for count, _ in parts)
    nan_count = sum(part["nan_count"] for _, part in parts)
    inf_count = sum(part["inf_count"] for _, part in parts)
    mean = sum(count * part["mean"] for count, part in parts) / n
    if nan_count or inf_count:
        std = math.nan  # as torch.std of NaN / Inf data
    else:
        spread = sum((count - 1) * part["std"] ** 2 + count * (part["mean"] - mean) ** 2 for count, part in parts)
        std = math.sqrt(spread / (n - 1)) if n > 1 else 0.0
    if nan_count:
        low = high = math.nan  # as torch.min / torch.max
    else:
        low, high = min(part["min"] for _, part in parts), max(part["max"] for _, part in parts)
    norm = math.hypot(*(part["norm"] for _, part in parts))
    nonzero = sum(round(count * (1 - part["zero_fraction"])) for count, part in parts)
    _fill(stats, wanted, n, mean, std, low, high, norm, nonzero, nan_count, inf_count)


def _pieces(x: torch.Tensor, limit: int) -> Iterable[torch.Tensor]:
    """Views of ``x`` of at most ``limit`` elements each that together hold every element once: slices of its
    first dimension, or of each of its rows where one row is larger."""
    if x.numel() <= limit or x.dim() == 0:
        yield x
        return
    rows = x.shape[0]
    per_row = x.numel() // rows
    if per_row > limit:
        for row in range(rows):
            yield from _pieces(x[row], limit)
        return
    step = limit // per_row
    for start in range(0, rows, step):
        yield x[start : start + step]


def plain_float_stats(x: torch.Tensor, wanted: frozenset, stats: dict[str, Any]) -> bool:
    """The statistics of a plain contiguous float32 / float64 CPU tensor, from one compiled pass over its memory (or,
    where it finds NaN or Inf, from numpy's passes); False (``stats`` untouched) for any other tensor.

    The compiled pass reads the memory once (numpy's and torch's passes read it five times), adding in double, and
    writes the statistics into ``stats`` itself; the std takes its exact second pass there too where the mean carries
    half of the sum of squares or more (as ``_std`` does). A NaN or Inf makes its sum of squares non-finite, and so
    does, for float32, a sum of squares past float32's range (torch's float32 norm is inf there). What a hook calls
    first for a tensor of more than ``SMALL_TENSOR`` elements (activations and gradients of a training step): no
    detached view, no layers of calls. A strided tensor (a transpose; the expanded gradient of a ``sum()`` loss) of
    at most ``PIECE`` elements is copied contiguous first (a larger one: False, for ``numeric_stats``'s pieces):
    numpy's passes copy it too (flattening), and then take 2-10x as long.
    """
    if _one_pass is None or type(x) is not torch.Tensor:
        return False
    dtype = x.dtype
    if not (dtype is torch.float32 or dtype is torch.float64) or reduced_on_device(x) or x.is_neg() or x.is_nested:
        return False
    n = x.numel()
    if not n:
        return False
    if not x.is_contiguous():
        if n > PIECE:  # a copy of a large view: numeric_stats takes it piece by piece
            return False
        x = x.detach().contiguous()
    one_pass_stats(x, n, wanted, stats)
    return True


def one_pass_stats(x: torch.Tensor, n: int, wanted: frozenset, stats: dict[str, Any]) -> None:
    """The compiled pass of ``plain_float_stats`` over a tensor known to take it (a plain contiguous float32 /
    float64 CPU tensor of ``n`` values): for a hook that already checked its kind."""
    names, codes = _wanted_columns(wanted)
    if not _one_pass(x.data_ptr(), n, x.dtype is torch.float64, codes, names, stats):
        _numpy_stats(x.detach(), n, wanted, stats)  # NaN, Inf, or float32 squares past its range


def numeric_columns(wanted: frozenset) -> tuple[str, ...]:
    """The numeric statistics of ``wanted``, in the order spans and tables show them (``_NUMERIC``)."""
    return _wanted_columns(wanted)[0]


def _wanted_columns(wanted: frozenset) -> tuple[tuple[str, ...], bytes]:
    """``numeric_columns(wanted)`` and their codes for the compiled passes, made once per set."""
    pair = _WANTED_COLUMNS.get(wanted)
    if pair is None:
        names = tuple(name for name in _NUMERIC if name in wanted)
        pair = _WANTED_COLUMNS[wanted] = (names, _column_codes(names))
    return pair


_WANTED_COLUMNS: dict[frozenset, tuple[tuple[str, ...], bytes]] = {}  # a set of wanted statistics -> _wanted_columns


def _numpy_stats(x: torch.Tensor, n: int, wanted: frozenset, stats: dict[str, Any]) -> None:
    """The statistics of a CPU float tensor's ``n`` values from numpy's passes (``_passes``)."""
    mean, squares, low, high, nonzero, nan_count, inf_count = _passes(x, n, "zero_fraction" in wanted)
    std = math.nan if nan_count or inf_count else _std(x, n, mean, squares, wanted)  # as torch.std of NaN / Inf data
    _fill(stats, wanted, n, mean, std, low, high, math.sqrt(squares), nonzero, nan_count, inf_count)


def _std(x: torch.Tensor, n: int, mean: float, squares: float, wanted: frozenset) -> float:
    """torch.std of finite values from their sum of squares (0 for one element; not computed unless wanted)."""
    if n < 2 or "std" not in wanted:  # gradients (GRAD_STATS) have no std: no second pass
        return 0.0
    # sum((x - mean)^2) = |x|^2 - n mean^2 needs no pass over x, but cancels when the mean carries much of
    # |x|^2: float32 sums of millions of squares are off by up to ~1e-3, which then becomes the whole variance.
    # Where the mean carries half or more, take the exact second pass.
    centered_square = squares - n * mean * mean
    if not math.isfinite(centered_square) or centered_square < 0.5 * squares:
        centered_square = float(torch.linalg.vector_norm(x.detach() - mean)) ** 2
        if not math.isfinite(centered_square):  # |x| past float32's square: float64
            centered_square = float(torch.linalg.vector_norm(x.detach().double() - mean)) ** 2
    return math.sqrt(max(centered_square, 0.0) / (n - 1))


def _passes(x: torch.Tensor, n: int, count_zeros: bool) -> tuple[float, float, float, float, int, int, int]:
    """(mean, sum of squares, min, max, non-zero count, NaN count, Inf count) of a CPU tensor's ``n`` values (the
    non-zero count is ``n`` unless ``count_zeros``), where the compiled pass did not take them: in numpy's passes, which
    give torch's answers for NaN and Inf. They take 248 us for 1M float32 (the compiled pass: 81): torch.aminmax 21
    us on 131K floats where numpy's min and max take 10; counting ``x != 0`` 7 us where sign(x) . sign(x) takes 21
    and torch's ``(x != 0).sum()`` 93; torch.std_mean is several times slower still."""
    values = _flat_values(x)
    mean = float(x.sum()) / n  # torch's cascade sum: numpy's float32 sum is slower here
    low, high = float(values.min()), float(values.max())  # NaN if any is NaN, as torch.aminmax
    with np.errstate(all="ignore"):  # a float32 square past 3.4e38 is inf, as in torch; never a warning
        squares = float(values @ values)
    if squares < _TINY_SQUARES and values.dtype != np.float64:
        # float32 squares of values below ~1e-19 lose precision, below ~1e-23 flush to zero (a vanishing gradient)
        squares = float(np.dot(values, values.astype(np.float64)))
    nan_count = inf_count = 0
    if not math.isfinite(squares):  # a NaN or Inf somewhere (or x*x overflowed): only now pay for the counts
        nan_count = int(np.count_nonzero(np.isnan(values)))
        inf_count = int(np.count_nonzero(np.isinf(values)))
    # NaN != 0, as count_nonzero counts it; -0.0 == 0
    nonzero = int(np.count_nonzero(values != 0)) if count_zeros else n
    return mean, squares, low, high, nonzero, nan_count, inf_count


_TINY_SQUARES = 1e-30  # a float32 sum of squares below this is taken again in float64


def _flat_values(x: torch.Tensor) -> np.ndarray:
    """The tensor's values as a flat numpy array: a view of its memory when contiguous (no copy)."""
    try:
        values = x.numpy()
    except (RuntimeError, TypeError):  # conjugate / negative views
        values = x.resolve_conj().resolve_neg().numpy()
    return values.reshape(-1)


def _fill(stats, wanted, n, mean, std, low, high, norm, nonzero, nan_count, inf_count) -> None:
    values = {
        "mean": mean,
        "std": std,
        "min": low,
        "max": high,
        "abs_max": max(abs(low), abs(high)) if not (math.isnan(low) or math.isnan(high)) else math.nan,
        "norm": norm,
        "nan_count": nan_count,
        "inf_count": inf_count,
        "zero_fraction": (n - nonzero) / n,
    }
    for name in _NUMERIC:
        if name in wanted:
            stats[name] = values[name]


def resolve(stats: dict[str, Any]) -> dict[str, Any]:
    """Fills statistics reduced on an accelerator from their row, once copied to the host (off the hot path)."""
    pending = stats.pop("_pending", None)
    if pending is not None:
        rows, index, n, wanted, raw, repeats = pending
        values, (nan_count, inf_count, nonzero) = rows.row(index)
        mean, std, low, high, norm = finish_raw(values, n, nan_count, inf_count) if raw else values[:5]
        if "zero_fraction" not in wanted:
            nonzero = n  # not counted on the device
        _fill(stats, wanted, n, mean, std, low, high, norm, nonzero, nan_count, inf_count)
        if repeats > 1:
            scale_for_repeats(stats, repeats, n)
    return stats


def device_table(summaries: Iterable[dict[str, Any]]) -> tuple[StatTable, bool] | None:
    """The statistics of a forward's tensors reduced on one device, finished together as one table (one compiled
    loop over the rows, or numpy a column without the module; not Python a call); each of their stats dicts then
    names its row (``_row``) in place of its pending row. Also whether no statistic of ``summaries`` holds NaN or
    Inf. None, changing nothing, where they come from several devices or sets of statistics (``resolve`` reads them
    one by one)."""
    found = _pending_rows(summaries) if _pending_rows is not None else pending_rows(summaries)
    if found is None:
        return None
    filled, rows, wanted, index, n, raw, others_finite = found
    values, counts = rows.host_rows()
    names, codes = _wanted_columns(wanted)
    table = np.empty((len(filled), len(names)))
    if _rows_table is not None:
        finite = _rows_table(values, counts, index, n, raw, codes, "zero_fraction" in wanted, table)
    else:
        finite = _finish_rows(values, counts, index, n, raw, names, "zero_fraction" in wanted, table)
    if _name_rows is not None:
        _name_rows(filled)
    else:
        for row, stats in enumerate(filled):
            del stats[PENDING]
            stats[ROW] = row  # the last key, as a row of a CPU forward's table
    finite = others_finite and finite
    return StatTable(table, names), finite


def _finish_rows(values: np.ndarray, counts: np.ndarray, index: bytes, n: bytes, raw: bytes, names: tuple[str, ...],
                 counted: bool, table: np.ndarray) -> bool:  # fmt: skip
    """``_native.rows_table`` in numpy (the same values): rows ``index`` of the copied value and count rows, of ``n``
    elements each (raw sums where ``raw``), finished into ``table``'s columns ``names``; whether none counts NaN or
    Inf."""
    index, n, raw = np.frombuffer(index, np.intp), np.frombuffer(n, np.float64), np.frombuffer(raw, np.bool_)
    counts = counts[index]
    nan_count, inf_count = counts[:, 0], counts[:, 1]
    mean, std, low, high, norm = finish_raw_rows(values[index].astype(np.float64), nan_count, inf_count, n, raw)
    with np.errstate(invalid="ignore"):
        columns = {
            "mean": mean, "std": std, "min": low, "max": high, "abs_max": np.maximum(np.abs(low), np.abs(high)),
            "norm": norm, "nan_count": nan_count, "inf_count": inf_count,
            "zero_fraction": (n - counts[:, 2]) / n if counted else np.zeros(len(n)),
        }  # fmt: skip
    for position, name in enumerate(names):
        table[:, position] = columns[name]
    return not (nan_count.any() or inf_count.any())


def pending_rows(
    summaries: Iterable[dict[str, Any]],
) -> tuple[list[dict], StatRows, Any, bytes, bytes, bytes, bool] | None:
    """``device_table``'s pass over the stats dicts (``_native.pending_rows`` where it is built, with the same
    result): the dicts whose statistics wait in a device row, each once (a container's may be its child's), in
    order; their rows object and wanted statistics; their rows, element counts and raw flags as native intp,
    float64 and bool bytes; and whether no other dict is pending an expanded view's scaling or counts NaN or Inf.
    None where nothing is pending, or the rows or wanted statistics differ."""
    pending: dict[int, tuple[dict, tuple]] = {}  # by identity: one tensor's stats may be shared by several calls
    others_finite = True
    for stats in summaries:
        entry = stats.get(PENDING)
        if entry is None or entry[5] != 1:  # read, or an expanded view's (scaled when read: resolve)
            others_finite = others_finite and entry is None and not (stats.get("nan_count") or stats.get("inf_count"))
        else:
            pending[id(stats)] = (stats, entry)
    if not pending:
        return None
    entries = [entry for _, entry in pending.values()]
    rows, wanted = entries[0][0], entries[0][3]
    if any(entry[0] is not rows or (entry[3] is not wanted and entry[3] != wanted) for entry in entries):
        return None
    return (
        [stats for stats, _ in pending.values()], rows, wanted,
        np.array([entry[1] for entry in entries], np.intp).tobytes(),
        np.array([entry[2] for entry in entries], np.float64).tobytes(),
        np.array([bool(entry[4]) for entry in entries], np.bool_).tobytes(),
        others_finite,
    )  # fmt: skip


def _user_stat(function: StatFunction, tensor: torch.Tensor) -> Any:
    value = function(tensor)
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    return value


def find_tensors(value: Any, limit: int) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """Tensors inside a module output or input, with their names; and whether the limit cut the search short.

    Names: "" for a bare tensor; positions for tuples/lists ("0", "1.2"); keys for dicts and ModelOutput-like
    mappings ("logits"); field names for dataclasses and named tuples ("hidden_states").
    """
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, torch.Tensor):
        found.append(("", value))
        return found, False
    truncated = _walk(value, "", found, limit, 0)
    return found, truncated


def _walk(value: Any, name: str, found: list, limit: int, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        if len(found) >= limit:
            return True
        found.append((name, value))
        return False
    if depth >= MAX_NESTING or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return False
    if isinstance(value, Mapping):
        items: Iterable = ((str(key), item) for key, item in value.items())
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        items = zip(value._fields, value)
    elif isinstance(value, (tuple, list)):
        items = ((str(index), item) for index, item in enumerate(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((field.name, getattr(value, field.name)) for field in dataclasses.fields(value))
    else:
        return False
    truncated = False
    for key, item in items:
        truncated = _walk(item, f"{name}.{key}" if name else key, found, limit, depth + 1) or truncated
    return truncated
