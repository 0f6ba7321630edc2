"""Layer drift at run time: each traced call's main-output statistics scored against a ``Baseline``, off the model's
thread (a sink, on the worker), over a sliding window of the layer's calls.

The score, per layer and statistic (docs/drift.md): each new value is placed among the baseline's values, as its
mid-rank ``u`` in [0, 1] (values closer than the baseline's tolerance count as ties, half). In distribution ``u`` is
uniform; the mean ``u`` over the layer's last ``window`` calls is the Mann-Whitney statistic of the window against
the baseline, 0.5 with variance (n + m + 1) / (12 n m) for n baseline and m window values. The score is its distance
from 0.5 in standard deviations (a z value), divided by ``threshold``: 1.0 is the alert. Ranks make it free of the
statistic's scale and shape, and one odd batch moves a window of 32 by at most 1/64.

Vectorised per forward: the series (layer, statistic) a forward's calls feed are found once per call layout
(``_Plan``), then one numpy pass ranks, windows and scores them all.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtrace._core.baseline import DRIFT_STATS, Baseline
from torchtrace._core.calls import CallBatch, ModuleCall
from torchtrace.attributes import DRIFT_FIRST, DRIFT_SCORE, DRIFT_STATISTIC, main_output_prefix

__all__ = ["DriftScorer", "DriftStatus", "LayerDrift"]

# Call layouts whose plans are kept: a model has one or a few (training / eval, generate's first step / the next);
# each plan holds its entries' sketches (2 x 101 float32s an entry: ~0.4 MB for a 6-layer BERT).
_MAX_PLANS = 16


@dataclass(frozen=True)
class LayerDrift:
    """A layer statistic's drift: ``score`` (1.0 is the alert threshold) over its last window of calls, and
    ``since`` (epoch seconds) when it went over the threshold, or None while it is under."""

    module: str
    statistic: str
    score: float
    since: float | None = None


@dataclass(frozen=True)
class DriftStatus:
    """``handle.drift()``: every scored layer statistic, highest score first, and ``first``: of the layers over the
    threshold, the earliest in execution order (the first to finish in a forward, as for NaN provenance), with
    its statistic and since when it is over. ``first`` is None while no layer is over."""

    layers: tuple[LayerDrift, ...]
    first: LayerDrift | None
    window: int
    threshold: float

    @property
    def drifted(self) -> tuple[LayerDrift, ...]:
        """The layer statistics over the threshold."""
        return tuple(layer for layer in self.layers if layer.score >= 1.0)


@dataclass(slots=True)
class _Plan:
    """Where one call layout's statistics go: per entry, the index of its value in the flat attributes, its series
    and its call's position; the layout's call order by end time is the forward's, read per forward."""

    counts: tuple
    keys: tuple
    value_index: list[int]
    series: np.ndarray
    positions: np.ndarray
    repeats: bool  # a series fed twice in one forward (a module called twice): ranked one call at a time
    order: dict[str, int]  # each layer's place in the forward's execution order (post-order: by end time)
    read: Callable[[Sequence[Any]], Any]  # the entries' values out of the flat attribute values, at once
    low: np.ndarray  # each entry's baseline sketch minus its tolerance, a column each (see _mid_ranks)
    high: np.ndarray  # plus its tolerance


class DriftScorer:
    """A sink scoring each forward's calls against ``baseline`` (``instrument(model, baseline=...)`` makes one)."""

    def __init__(self, baseline: Baseline, window: int = 32, threshold: float = 6.0) -> None:
        self.baseline = baseline
        self.window = window
        self.threshold = threshold
        keys = sorted(baseline.references)
        self._series: dict[tuple[str, str], int] = {key: index for index, key in enumerate(keys)}
        self._keys = keys
        sketches = np.array([baseline.references[key].quantiles for key in keys], dtype=np.float64).reshape(
            len(keys), -1
        )
        tolerance = np.array([baseline.tolerance(*key) for key in keys], dtype=np.float64)[:, None]
        # a value within the tolerance of a baseline value ties with it; float32 resolves far finer than that
        self._low = (sketches - tolerance).astype(np.float32)
        self._high = (sketches + tolerance).astype(np.float32)
        self._counts = np.array([baseline.references[key].count for key in keys], dtype=np.float64)
        size = len(keys)
        self._ranks = np.zeros((size, window))  # each series' last ``window`` ranks, a ring (0 where not yet fed)
        self._fed = np.zeros(size, dtype=np.int64)  # values each series took
        self._scores = np.zeros(size)
        self._since = np.full(size, np.nan)  # epoch seconds it went over the threshold; NaN while under
        self._order: dict[str, int] = {}  # layer path -> its place by end time in the last forward that called it
        self._series_of_path: dict[str, list[tuple[str, int]]] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._lock = threading.Lock()  # the worker writes, a scrape or handle.drift() reads
        self.scored_forwards = 0

    # -- the sink: on the dispatcher's worker (or a flush) ------------------------------------------------------------

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        for segment in getattr(calls, "segments", (calls,)):
            if isinstance(segment, CallBatch) and segment.kind == "forward" and len(segment):
                self._score(segment)

    def _score(self, batch: CallBatch) -> None:
        counts, keys, values = batch.flat_attributes()
        lo, hi = batch.lo, batch.hi
        modules = batch.module[lo:hi]
        plan_key = (id(counts), id(keys), lo, tuple(modules))
        plan = self._plans.get(plan_key)
        if plan is None or plan.counts is not counts or plan.keys is not keys:
            plan = self._plans[plan_key] = self._plan(batch, counts, keys)
            if len(self._plans) > _MAX_PLANS:  # ever-new layouts (dynamic routing): start over rather than grow
                self._plans = {plan_key: plan}
        with self._lock:
            self.scored_forwards += 1
            self._order.update(plan.order)
            if not plan.value_index:
                return
            observed = _numbers(plan.read(values), len(plan.value_index))
            known = ~np.isnan(observed)  # NaN is NaN provenance's to name, not a rank
            if known.all():
                series, positions, low, high = plan.series, plan.positions, plan.low, plan.high
            else:
                series, positions, observed = plan.series[known], plan.positions[known], observed[known]
                low, high = plan.low[:, known], plan.high[:, known]
            if not len(series):
                return
            ranks = _mid_ranks(low, high, observed)
            scores = self._update(series, ranks, plan.repeats, lambda at: batch.end_ns[positions[at]])
            over = scores >= 1.0
            if over.any():
                self._mark(batch, series[over], positions[over], scores[over])

    def observe(self, path: str, attributes: Mapping[str, Any], end_ns: int) -> dict[str, float]:
        """Scores one forward call of layer ``path`` from its span attributes, ended at ``end_ns`` (epoch ns):
        {statistic: score} of the statistics the baseline has for it. For calls read back from trace files
        (``torchtrace report --baseline``); the sink scores a forward's calls at once."""
        prefix = main_output_prefix(attributes)
        found = [(self._series[(path, stat)], _number(attributes.get(f"{prefix}.{stat}"))) for stat in DRIFT_STATS
                 if (path, stat) in self._series]  # fmt: skip
        found = [(one, value) for one, value in found if not math.isnan(value)]
        if not found:
            return {}
        series = np.array([one for one, _ in found], dtype=np.int64)
        ranks = _mid_ranks(self._low[series].T, self._high[series].T, np.array([value for _, value in found]))
        with self._lock:
            scores = self._update(series, ranks, False, lambda at: end_ns)
        return {self._keys[one][1]: float(score) for one, score in zip(series.tolist(), scores.tolist())}

    def _update(self, series: np.ndarray, ranks: np.ndarray, repeats: bool,
                end_ns_of: Callable[[int], int]) -> np.ndarray:  # fmt: skip
        """Puts new ranks into their series' windows (under the lock) and returns the series' scores; a series
        going over the threshold notes when (``end_ns_of(entry)``), one going under forgets it."""
        if repeats:
            for one, rank in zip(series, ranks):
                self._ranks[one, self._fed[one] % self.window] = rank
                self._fed[one] += 1
        else:
            self._ranks[series, self._fed[series] % self.window] = ranks
            self._fed[series] += 1
        fed = np.minimum(self._fed[series], self.window).astype(np.float64)
        mean_rank = self._ranks[series].sum(axis=1) / fed
        reference = self._counts[series]
        spread = np.sqrt((reference + fed + 1) / (12 * reference * fed))
        scores = np.abs(mean_rank - 0.5) / spread / self.threshold
        self._scores[series] = scores
        over = scores >= 1.0
        newly = over & np.isnan(self._since[series])
        if newly.any():
            self._since[series[newly]] = [end_ns_of(at) / 1e9 for at in np.nonzero(newly)[0].tolist()]
        self._since[series[~over]] = np.nan
        return scores

    def _mark(self, batch: CallBatch, series: np.ndarray, positions: np.ndarray, scores: np.ndarray) -> None:
        """The calls over the threshold get their highest score and its statistic; the first of them to finish,
        ``DRIFT_FIRST``."""
        best: dict[int, tuple[float, int]] = {}
        for one, position, score in zip(series.tolist(), positions.tolist(), scores.tolist()):
            if position not in best or score > best[position][0]:
                best[position] = (score, one)
        first = min(best, key=lambda position: (batch.end_ns[position], position))
        for position, (score, one) in best.items():
            extra: dict[str, Any] = {DRIFT_SCORE: score, DRIFT_STATISTIC: self._keys[one][1]}
            if position == first:
                extra[DRIFT_FIRST] = True
            batch.add_attributes(position, extra)

    def _plan(self, batch: CallBatch, counts: tuple, keys: tuple) -> _Plan:
        value_index: list[int] = []
        series: list[int] = []
        positions: list[int] = []
        at = 0
        for position, count in enumerate(counts):
            if batch.lo <= position < batch.hi:
                path = batch.modules[batch.module[position]].path
                own = self._series_of_path.get(path)
                if own is None:
                    own = self._series_of_path[path] = [
                        (stat, self._series[(path, stat)]) for stat in DRIFT_STATS if (path, stat) in self._series
                    ]
                if own:
                    names = keys[at : at + count]
                    prefix = main_output_prefix(dict.fromkeys(names))
                    for stat, one in own:
                        name = f"{prefix}.{stat}"
                        if name in names:
                            value_index.append(at + names.index(name))
                            series.append(one)
                            positions.append(position)
            at += count
        chosen = np.array(series, dtype=np.int64)
        read = operator.itemgetter(*value_index) if len(value_index) > 1 else _one_of(value_index)
        return _Plan(counts, keys, value_index, chosen, np.array(positions, dtype=np.int64),
                     len(set(series)) < len(series), _execution_order(batch), read,
                     np.ascontiguousarray(self._low[chosen].T), np.ascontiguousarray(self._high[chosen].T))  # fmt: skip

    # -- readers: handle.drift(), the metrics' scrape --------------------------------------------------------------

    def status(self) -> DriftStatus:
        with self._lock:
            scored = np.nonzero(self._fed)[0]
            layers = [self._layer(one) for one in scored]
            order = dict(self._order)
        layers.sort(key=lambda layer: (-layer.score, layer.module, layer.statistic))
        over = [layer for layer in layers if layer.score >= 1.0]
        first = None
        if over:  # the earliest layer in execution order, its highest statistic
            first = min(over, key=lambda layer: (order.get(layer.module, 1 << 30), -layer.score))
        return DriftStatus(tuple(layers), first, self.window, self.threshold)

    def _layer(self, one: int) -> LayerDrift:
        path, stat = self._keys[one]
        since = float(self._since[one])
        return LayerDrift(path, stat, float(self._scores[one]), None if math.isnan(since) else since)


def _execution_order(batch: CallBatch) -> dict[str, int]:
    """Each layer's place among the forward's calls by end time: a call ends after the calls nested in it and
    before the next one at its depth (post-order), whatever the clock said."""
    depth = batch.depth
    order: dict[str, int] = {}
    open_calls: list[int] = []

    def finish(position: int) -> None:
        order.setdefault(batch.modules[batch.module[position]].path, len(order))

    for position in range(batch.lo, batch.hi):
        while open_calls and depth[open_calls[-1]] >= depth[position]:
            finish(open_calls.pop())
        open_calls.append(position)
    while open_calls:
        finish(open_calls.pop())
    return order


def _mid_ranks(low: np.ndarray, high: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Each value's mid-rank among its column of baseline values, in [0, 1]: (values below it + values not above
    it) / 2, those within the tolerance (``low`` / ``high``: the sketch minus / plus it) counting half. Columns:
    summing down contiguous rows is several times faster than across each row."""
    value = observed.astype(np.float32)
    below = (high < value).sum(axis=0, dtype=np.int32)
    not_above = (low <= value).sum(axis=0, dtype=np.int32)
    return (below + not_above) / (2.0 * low.shape[0])


def _one_of(value_index: list[int]) -> Callable[[Sequence[Any]], tuple]:
    """The reader of a plan with zero or one entry (itemgetter of one index gives the value, not a tuple)."""
    return lambda values: tuple(values[index] for index in value_index)


def _numbers(values: tuple, count: int) -> np.ndarray:
    """The plan's values as floats at once; one by one (NaN for what is not a number) where that fails."""
    try:
        observed = np.array(values, dtype=np.float64)
        if observed.shape == (count,):
            return observed
    except (TypeError, ValueError):
        pass
    return np.array([_number(value) for value in values], dtype=np.float64)


def _number(value: Any) -> float:
    """An attribute value as a float; NaN for what is not a number (a statistic that failed)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan
