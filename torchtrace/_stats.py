"""Tensor statistics, computed inside the post-hook: few torch ops, one host read on CPU, none on GPU.

Each tensor found in a module's output (or input) is summarised into a flat dict of OTel-ready values. On CPU the
values are read at once (a read, not a sync). On an accelerator they stay on the device in one small tensor and
are read once per forward, off the hot path (see ``resolve``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

_logger = logging.getLogger(__name__)

STAT_NAMES = (
    "shape",
    "dtype",
    "device",
    "mean",
    "std",
    "min",
    "max",
    "abs_max",
    "norm",
    "nan_count",
    "inf_count",
    "zero_fraction",
)
_METADATA = frozenset({"shape", "dtype", "device"})
_NUMERIC = tuple(name for name in STAT_NAMES if name not in _METADATA)

# A user statistic: tensor -> number (a 1-element tensor is read with .item()).
StatFunction = Callable[[torch.Tensor], "float | int | bool | torch.Tensor"]

MAX_NESTING = 4  # containers deeper than this are not searched for tensors


SMALL_TENSOR = 4096  # at most this many elements: copied in the hook, summarised in one batch per forward


class StatComputer:
    """Computes the chosen statistics of a tensor; keeps one result per tensor object while it is unchanged.

    Torch dispatch costs microseconds per op, so on CPU small tensors are not reduced one by one: the hook copies
    them (one op; a later in-place op cannot change the copy) and ``finish_forward`` reduces all copies of a
    forward with a handful of segmented ops. Larger tensors, where the data and not the dispatch dominates, are
    reduced at once.
    """

    __slots__ = ("wanted", "numeric", "extra", "_cache", "_pending", "_dtype_names")

    def __init__(self, wanted: Iterable[str], extra: Mapping[str, StatFunction]) -> None:
        self.wanted = frozenset(wanted)
        self.numeric = any(name in self.wanted for name in _NUMERIC)
        self.extra = dict(extra)
        # id(tensor) -> (weakref, version, stats): a container module usually returns its last child's output
        # unchanged, so the same tensor would otherwise be summarised at every level of nesting.
        self._cache: dict[int, tuple[Any, int, dict]] = {}
        self._pending: list[tuple[torch.Tensor, dict]] = []  # (copy, stats to fill) until finish_forward
        self._dtype_names: dict[torch.dtype, str] = {}

    def finish_forward(self) -> None:
        """Fills the statistics of every small tensor copied during this forward, then forgets the copies."""
        pending, self._pending = self._pending, []
        self._cache.clear()
        if pending:
            try:
                _batched_stats(pending, self.wanted)
            except Exception as error:  # a statistic must never break the user's forward
                for _, stats in pending:
                    stats["stats_error"] = f"{type(error).__name__}: {error}"

    def __call__(self, tensor: torch.Tensor) -> dict[str, Any]:
        if tensor.is_inference():
            # No version counter: an in-place op would go unnoticed, so the same object is never trusted twice.
            return self._compute(tensor)
        key = id(tensor)
        cached = self._cache.get(key)
        version = tensor._version
        if cached is not None and cached[0]() is tensor and cached[1] == version:
            return cached[2]
        stats = self._compute(tensor)
        with contextlib.suppress(TypeError):  # tensor subclasses without weakref support are not cached
            self._cache[key] = (weakref.ref(tensor), version, stats)
        return stats

    def _compute(self, tensor: torch.Tensor) -> dict[str, Any]:
        wanted = self.wanted
        stats: dict[str, Any] = {}
        if "shape" in wanted:
            stats["shape"] = tuple(tensor.shape)
        if "dtype" in wanted:
            name = self._dtype_names.get(tensor.dtype)
            if name is None:
                name = self._dtype_names[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
            stats["dtype"] = name
        if "device" in wanted:
            stats["device"] = "cpu" if tensor.is_cpu else str(tensor.device)
        if not (self.numeric or self.extra) or not _has_readable_values(tensor):
            return stats
        try:
            for name, function in self.extra.items():
                stats[name] = _user_stat(function, tensor)
            if self.numeric:
                x = tensor.detach() if tensor.requires_grad else tensor
                if x.is_cpu and x.numel() <= SMALL_TENSOR and not x.is_quantized:
                    self._pending.append((_as_real_float(x).clone() if x.dtype != torch.float64 else x.clone(), stats))
                else:
                    _numeric_stats(x, wanted, stats)
        except Exception as error:  # a statistic must never break the user's forward
            _logger.debug("torchtrace: statistics failed for a %s tensor: %s", tensor.dtype, error)
            stats["stats_error"] = f"{type(error).__name__}: {error}"
        return stats


_FLOAT_STATS = ("mean", "std", "min", "max", "abs_max", "norm", "zero_fraction")


def _batched_stats(pending: list[tuple[torch.Tensor, dict]], wanted: frozenset) -> None:
    """Reduces all small tensors of a forward a few ops per distinct shape; Python only zips the results."""
    groups: dict[tuple, list[tuple[torch.Tensor, dict]]] = {}
    for item in pending:
        copy = item[0]
        groups.setdefault((copy.shape, copy.dtype), []).append(item)
    keys = [key for key in _FLOAT_STATS if key in wanted]
    with_counts = "nan_count" in wanted or "inf_count" in wanted
    for (shape, _), items in groups.items():
        n = math.prod(shape)
        values = torch.stack([copy for copy, _ in items]).reshape(len(items), n).double()
        sums = values.sum(1)
        squares = (values * values).sum(1)
        lows, highs = torch.aminmax(values, dim=1)
        mean = sums / n
        centered = values - mean[:, None]
        columns = {
            "mean": mean,
            "std": ((centered * centered).sum(1) / max(n - 1, 1)).sqrt(),  # torch.std; 0 for one element
            "min": lows,
            "max": highs,
            "abs_max": torch.maximum(lows.abs(), highs.abs()),
            "norm": squares.sqrt(),
            "zero_fraction": 1 - torch.count_nonzero(values, dim=1) / n,
        }
        rows = torch.stack([columns[key] for key in keys], dim=1).tolist() if keys else [[]] * len(items)
        finite = bool(torch.isfinite(squares).all() & torch.isfinite(lows).all() & torch.isfinite(highs).all())
        if with_counts and not finite:
            counts = torch.stack([torch.isnan(values).sum(1), torch.isinf(values).sum(1)], dim=1).tolist()
        else:
            counts = [[0, 0]] * len(items)
        for (_, stats), row, (nan_count, inf_count) in zip(items, rows, counts):
            stats.update(zip(keys, row))
            if with_counts:
                if "nan_count" in wanted:
                    stats["nan_count"] = nan_count
                if "inf_count" in wanted:
                    stats["inf_count"] = inf_count


def _has_readable_values(tensor: torch.Tensor) -> bool:
    # meta tensors have no data; sparse and other layouts are described by shape/dtype only.
    return tensor.numel() > 0 and not tensor.is_meta and tensor.layout == torch.strided


def _as_real_float(x: torch.Tensor) -> torch.Tensor:
    if x.is_quantized:
        x = x.dequantize()
    if x.is_complex():
        return x.abs()  # statistics of the magnitude; documented
    if x.dtype in (torch.float32, torch.float64):
        return x
    if x.is_floating_point() or x.dtype == torch.bool:
        return x.float()  # half, bfloat16, fp8: accumulate in float32
    return x.double()  # integers: float64 holds them exactly up to 2**53


def _numeric_stats(tensor: torch.Tensor, wanted: frozenset, stats: dict[str, Any]) -> None:
    x = _as_real_float(tensor)
    n = x.numel()
    std, mean = torch.std_mean(x, correction=1 if n > 1 else 0)
    low, high = torch.aminmax(x)
    nonzero = torch.count_nonzero(x)
    if not x.is_cpu:
        # No host read inside the hook: one small device tensor, read once per forward by resolve().
        nan_count = torch.isnan(x).sum()
        inf_count = torch.isinf(x).sum()
        packed = torch.stack([mean, std, low, high]).double()
        counts = torch.stack([nonzero, nan_count, inf_count])
        stats["_pending"] = (packed, counts, n, wanted)
        return
    mean_v, std_v, low_v, high_v = torch.stack([mean, std, low, high]).double().tolist()
    nonzero_v = int(nonzero)
    if math.isfinite(mean_v) and math.isfinite(low_v) and math.isfinite(high_v):
        nan_v = inf_v = 0
    else:  # only now pay for the extra passes
        nan_v = int(torch.isnan(x).sum())
        inf_v = int(torch.isinf(x).sum())
        mean_v = float(x.mean())  # std_mean's mean is NaN where torch.mean gives +-inf
    _fill(stats, wanted, n, mean_v, std_v, low_v, high_v, nonzero_v, nan_v, inf_v)


def _fill(stats, wanted, n, mean, std, low, high, nonzero, nan_count, inf_count) -> None:
    values = {
        "mean": mean,
        "std": std,
        "min": low,
        "max": high,
        "abs_max": max(abs(low), abs(high)) if not (math.isnan(low) or math.isnan(high)) else math.nan,
        "norm": _norm(n, mean, std, nan_count, inf_count),
        "nan_count": nan_count,
        "inf_count": inf_count,
        "zero_fraction": (n - nonzero) / n,
    }
    for name in _NUMERIC:
        if name in wanted:
            stats[name] = values[name]


def _norm(n: int, mean: float, std: float, nan_count: int, inf_count: int) -> float:
    if nan_count:
        return math.nan
    if inf_count:
        return math.inf
    # sum(x^2) = sum((x - mean)^2) + n * mean^2: the L2 norm without another pass over the tensor.
    return math.sqrt((n - 1) * std * std + n * mean * mean) if n > 1 else abs(mean)


def resolve(stats: dict[str, Any]) -> dict[str, Any]:
    """Reads statistics left on an accelerator (one host read per tensor, off the hot path)."""
    pending = stats.pop("_pending", None)
    if pending is not None:
        packed, counts, n, wanted = pending
        mean, std, low, high = packed.tolist()
        nonzero, nan_count, inf_count = counts.tolist()
        _fill(stats, wanted, n, mean, std, low, high, nonzero, nan_count, inf_count)
    return stats


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
