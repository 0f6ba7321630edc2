"""Prometheus metrics from the record stream: a ``Sink`` that aggregates, a Collector that exposes at scrape time.

Nothing here runs in a hook. The dispatcher hands each batch of ``ModuleCall``s to ``MetricsSink`` on its
worker thread; the sink folds them into plain counters under one lock per batch. prometheus_client calls
``collect()`` on a scrape and gets samples built from that state, so the hot path has no ``observe()`` at all.

Cardinality is bounded by design (see docs/metrics.md):

- the duration histogram is labelled by module *type*, never by module path: buckets x paths x ranks is what
  explodes, and types are few;
- per-module series (call count, time, errors, NaN/Inf counts, output statistics) are one series each, for at
  most ``max_module_labels`` paths; later paths share the label value ``OVERFLOW_MODULE`` (counters only:
  a "latest value" of a mix of layers means nothing, so overflowed modules get no output-statistic gauges), by
  their type for at most ``max_module_labels`` types, then under ``OVERFLOW_MODULE`` as their type too;
- types are bounded the same way: the duration histogram has at most ``max_module_labels`` types, then
  ``OVERFLOW_MODULE``. So N = ``max_module_labels`` bounds a model's per-module series at 2N + 1 and its
  histograms at N + 1 per rank, however many paths and classes the model has.

With step tracing: the step duration histogram (exemplars link to the step's trace), the latest gradient norm
per module (from its backward span), and how often each module was the first to produce NaN/Inf.

Under ``Training(rank_detail="auto")`` (large jobs) a rank outside ``detail_ranks`` sends the module spans of the
steps it explains (a straggler, a NaN's first rank), but its series must not grow with them: over a long job every
rank is detailed now and then, and series live on. ``instrument()`` sets ``rank_detail``: on such a rank only the
model-level series and the model root's own row are kept (its forward every step: its time, errors and output
NaN/Inf), and every auto rank counts the steps it was detailed in, by reason (a NaN that started there included).
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from torchtrace._core.calls import DATA_WAIT, ModuleCall, NonFiniteError
from torchtrace._core.ranks import rank_info
from torchtrace.attributes import (
    COMM_SECONDS,
    GRAD_OUTPUT_PREFIX,
    OUTPUT_PREFIX,
    RANK_DETAIL,
    WORLD_SIZE,
    main_output_prefix,
)

__all__ = ["DEFAULT_DURATION_BUCKETS", "DETAIL_REASONS", "OVERFLOW_MODULE", "OUTPUT_STATS", "MetricsSink"]

OVERFLOW_MODULE = "__other__"
# Module calls range from a few microseconds (an activation) to seconds (a whole model on CPU).
DEFAULT_DURATION_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# span statistic -> (metric name part, unit, help); gauges of the latest value per module
OUTPUT_STATS: dict[str, tuple[str, str, str]] = {
    "mean": ("output_mean", "", "Mean of the module's main output tensor, latest call."),
    "std": ("output_std", "", "Standard deviation (unbiased) of the module's main output tensor, latest call."),
    "abs_max": ("output_abs_max", "", "Largest absolute value of the module's main output tensor, latest call."),
    "zero_fraction": ("output_zero", "ratio", "Fraction of zeros in the module's main output tensor, latest call."),
}
# why a rank sent its module spans of a step under rank_detail="auto" (the step span's torchtrace.rank.detail)
DETAIL_REASONS = ("rank", "straggler", "nonfinite", "raised")
# MetricsSink.rank_detail: under rank_detail="auto", a rank of detail_ranks (every series), or any other rank
# (model-level series and the model root's row only)
DETAIL_RANK, MODEL_ONLY = "detail", "model"
_OUTPUT_PREFIX = OUTPUT_PREFIX
_GRAD_OUTPUT_PREFIX = GRAD_OUTPUT_PREFIX + "."


@dataclass(slots=True)
class _ModuleState:
    """Aggregates of one module label value (a path, or the overflow of one module type)."""

    module_type: str
    calls: int = 0
    seconds: float = 0.0
    errors: int = 0
    nan_values: int = 0
    inf_values: int = 0
    nonfinite_first: int = 0  # calls marked as the first producer of NaN/Inf (forward or backward)
    grad_norm: float | None = None  # L2 norm of the gradient at the module's output, latest traced backward
    latest: dict[str, float] = field(default_factory=dict)  # OUTPUT_STATS key -> latest value


# (trace_id, span_id, seconds, end_ns) of a call: an exemplar, formatted only when scraped
_RawExemplar = tuple[int, int, float, int]


@dataclass(slots=True)
class _HistogramState:
    """One module type's duration histogram: per-bucket (not cumulative) counts and the latest exemplar each."""

    counts: list[int]
    exemplars: list[_RawExemplar | None]
    total_seconds: float = 0.0


@dataclass(slots=True)
class _OutputLayout:
    """Which attribute keys of a module's calls hold its NaN/Inf counts and main-output statistics.

    Computed once per path and again when the number of attributes changes, so a call costs a few dict lookups.
    """

    size: int
    nan_keys: tuple[str, ...]  # every output tensor counts for NaN/Inf, not just the main one
    inf_keys: tuple[str, ...]
    stat_keys: tuple[tuple[str, str], ...]  # (OUTPUT_STATS key, attribute key) of the main output

    @classmethod
    def of(cls, attributes: dict[str, Any], *, with_stats: bool) -> _OutputLayout:
        outputs = [key for key in attributes if key.startswith(_OUTPUT_PREFIX + ".")]
        prefix = main_output_prefix(attributes)
        return cls(
            size=len(attributes),
            nan_keys=tuple(key for key in outputs if key.endswith(".nan_count")),
            inf_keys=tuple(key for key in outputs if key.endswith(".inf_count")),
            stat_keys=tuple((stat, f"{prefix}.{stat}") for stat in OUTPUT_STATS) if with_stats else (),
        )


@dataclass(slots=True)
class _PathEntry:
    state: _ModuleState
    histogram: _HistogramState
    state_is_named: bool  # False for an overflowed path: it adds to counters, never to the latest-value gauges
    layout: _OutputLayout | None = None


class InstrumentedModels(Collector):
    """What ``instrument(metrics=True)`` registers on prometheus_client's global registry, once: a registry takes
    each metric name once, so the MetricsSink of every model instrumented that way is exposed through this one
    collector, families merged by name (each sink's samples carry its own ``model`` label)."""

    def __init__(self) -> None:
        self._sinks: list[MetricsSink] = []
        self._retired: weakref.WeakSet[MetricsSink] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered = False

    def add(self, sink: MetricsSink, registry: CollectorRegistry = REGISTRY) -> None:
        """Adds a sink. A retired sink (its handle removed) of the same model makes way: instrumenting a model
        again starts its counters anew, as after a restart. A second live model of the same class is labelled
        ``<class>#2`` (and so on): two sinks with one ``model`` label would expose the same series twice."""
        with self._lock:
            self._sinks = [other for other in self._sinks if not (other.model == sink.model and other in self._retired)]
            taken = {other.model for other in self._sinks}
            name, number = sink.model, 1
            while sink.model in taken:
                number += 1
                sink.model = f"{name}#{number}"
            self._sinks.append(sink)
            if not self._registered:
                registry.register(self)
                self._registered = True

    def retire(self, sink: MetricsSink) -> None:
        """Its handle is removed: its last values stay exposed (a final scrape after training still sees them)
        until its model is instrumented again."""
        with self._lock:
            self._retired.add(sink)

    def describe(self) -> list[Metric]:
        return list(MetricsSink(registry=None, model="model", rank="0")._families())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            sinks = list(self._sinks)
        merged: dict[str, Metric] = {}
        for sink in sinks:
            for family in sink.collect():
                first = merged.setdefault(family.name, family)
                if first is not family:
                    first.samples.extend(family.samples)
        return list(merged.values())


INSTRUMENTED_MODELS = InstrumentedModels()


class MetricsSink(Collector):
    """A torchtrace ``Sink`` that aggregates module calls into Prometheus metrics, exposed by a custom Collector.

    ``instrument(model, sinks=[MetricsSink()])``; serve with :func:`torchtrace.serve_metrics`. The collector is
    registered on ``registry`` at construction (``registry=None`` to register it yourself). One sink per model:
    its metric names can be registered once per registry.

    ``model`` names the model in the ``model`` label (default: the class name of the instrumented model, from
    the call of its root module or from :meth:`watch`). ``rank`` fills the ``rank`` label (default: ``RANK``
    from the environment, as torchrun sets it, else ``"0"``).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = REGISTRY,
        *,
        namespace: str = "torchtrace",
        model: str | None = None,
        rank: str | int | None = None,
        max_module_labels: int = 200,
        buckets: Iterable[float] = DEFAULT_DURATION_BUCKETS,
    ) -> None:
        if max_module_labels < 0:
            raise ValueError(f"max_module_labels must be >= 0, got {max_module_labels}")
        bounds = sorted(float(b) for b in buckets if b != float("inf"))
        if not bounds or bounds[0] <= 0:
            raise ValueError("buckets must be positive durations in seconds")
        self.namespace = namespace
        self.model = model
        if rank is None:
            info = rank_info()
            rank = info.rank if info is not None else os.environ.get("RANK", "0")
        self.rank = str(rank)
        self.max_module_labels = max_module_labels
        self.bucket_bounds: tuple[float, ...] = tuple(bounds)
        self._lock = threading.Lock()
        self._modules: dict[tuple[str, str], _ModuleState] = {}  # (module label, module type) -> state
        self._paths: dict[str, _PathEntry] = {}  # module path -> where its calls are counted
        self._named_modules = 0
        self._overflowed_paths = 0
        self._overflow_types = 0  # types with a series of their own under OVERFLOW_MODULE
        self._histograms: dict[str, _HistogramState] = {}
        slots = len(self.bucket_bounds) + 1  # + the +Inf bucket
        self._steps = _HistogramState([0] * slots, [None] * slots)
        self._comm_seconds = 0.0  # all-reduce time of traced steps (DDP): the straggler waits least
        self._data_wait_seconds = 0.0  # traced steps' time before their first forward: a rank waiting on input
        self._recorded = 0
        self._watched: list[_Watched] = []
        self._owner: weakref.ref | None = None  # the handle whose calls this sink aggregates
        self.drift: Any = None  # the handle's DriftScorer (instrument(baseline=)): its scores are exposed too
        # set by instrument() under Training(rank_detail="auto"): DETAIL_RANK or MODEL_ONLY (then module calls other
        # than the model root's are not aggregated, whatever steps they come from); None: every series
        self.rank_detail: str | None = None
        self._detail_steps = {reason: 0 for reason in DETAIL_REASONS}  # steps this rank was detailed in, by reason
        self._detail_exemplars: dict[str, _RawExemplar] = {}  # reason -> the latest such step's span
        if registry is not None:
            registry.register(self)

    # -- the sink: runs on the dispatcher's worker thread ---------------------------------------------------------

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        with self._lock:
            if self.model is None:
                self.model = next((c.type_name for c in calls if c.path == "" and c.kind == "forward"), None) or "model"
            model_only = self.rank_detail == MODEL_ONLY
            for call in calls:
                kind = call.kind
                if kind == "forward":
                    if not model_only or call.path == "":  # the model root: every step, detailed or not
                        self._add(call)
                elif kind == "backward":
                    if not model_only:  # a rank's module backward spans come with its detailed steps only
                        self._add_backward(call)
                elif kind == "step" and WORLD_SIZE not in call.attributes:  # not the all-ranks root
                    _observe(self._steps, self.bucket_bounds, call)
                    self._comm_seconds += call.attributes.get(COMM_SECONDS, 0.0)
                    detail = call.attributes.get(RANK_DETAIL)
                    if detail is not None:
                        self._count_detail(str(detail), call)
                elif kind == "phase" and call.name == DATA_WAIT:
                    self._data_wait_seconds += (call.end_ns - call.start_ns) / 1e9
            self._recorded += len(calls)

    def _count_detail(self, detail: str, step: ModuleCall) -> None:
        """A step span's ``torchtrace.rank.detail`` ("none", "rank", "straggler,nonfinite"...): counted by reason,
        the step's trace kept as the reason's exemplar."""
        for reason in detail.split(","):
            if reason in self._detail_steps:
                self._detail_steps[reason] += 1
                if step.trace_flags & 1:
                    self._detail_exemplars[reason] = (step.trace_id, step.span_id, 1.0, step.end_ns)

    def _path(self, call: ModuleCall) -> _PathEntry:
        path = self._paths.get(call.path)
        if path is None:
            path = self._paths[call.path] = self._new_path(call)
        return path

    def _add_backward(self, call: ModuleCall) -> None:
        state = self._path(call).state
        if isinstance(call.error, NonFiniteError):
            state.nonfinite_first += 1
        norm = next(  # the first output that got a gradient (a bare tensor is output "0")
            (v for k, v in call.attributes.items() if k.startswith(_GRAD_OUTPUT_PREFIX) and k.endswith(".norm")), None
        )
        if norm is not None:
            state.grad_norm = norm

    def _add(self, call: ModuleCall) -> None:
        path = self._path(call)
        seconds = (call.end_ns - call.start_ns) / 1e9
        state = path.state
        state.calls += 1
        state.seconds += seconds
        if isinstance(call.error, NonFiniteError):
            state.nonfinite_first += 1
        elif call.error is not None:
            state.errors += 1
        attributes = call.attributes
        layout = path.layout
        if layout is None or layout.size != len(attributes):  # the output's structure changed (or first call)
            layout = path.layout = _OutputLayout.of(attributes, with_stats=path.state_is_named)
        for key in layout.nan_keys:
            state.nan_values += int(attributes.get(key, 0))
        for key in layout.inf_keys:
            state.inf_values += int(attributes.get(key, 0))
        latest = state.latest
        for stat, key in layout.stat_keys:
            value = attributes.get(key)
            if value is not None:
                latest[stat] = value

        _observe(path.histogram, self.bucket_bounds, call)

    def _new_path(self, call: ModuleCall) -> _PathEntry:
        """State of a path seen for the first time: its own label while under the limit, else the overflow's."""
        type_name = call.type_name
        if self._named_modules < self.max_module_labels:
            self._named_modules += 1
            label = call.path or type_name  # the model itself: its class name, as its forward span's
        else:
            self._overflowed_paths += 1
            label = OVERFLOW_MODULE
            if (label, type_name) not in self._modules:
                if self._overflow_types < self.max_module_labels:
                    self._overflow_types += 1
                else:  # 10,000 generated classes must not make 10,000 series
                    type_name = OVERFLOW_MODULE
        state = self._modules.get((label, type_name))
        if state is None:
            state = self._modules[(label, type_name)] = _ModuleState(type_name)
        slots = len(self.bucket_bounds) + 1  # + the +Inf bucket
        if self.rank_detail == MODEL_ONLY:  # the root's row, no duration histogram: the step histogram is the rank's
            detached = _HistogramState([0] * slots, [None] * slots)
            return _PathEntry(state, detached, state_is_named=label != OVERFLOW_MODULE)
        if type_name not in self._histograms and len(self._histograms) >= self.max_module_labels:
            type_name = OVERFLOW_MODULE
        histogram = self._histograms.get(type_name)
        if histogram is None:
            histogram = self._histograms[type_name] = _HistogramState([0] * slots, [None] * slots)
        return _PathEntry(state, histogram, state_is_named=label != OVERFLOW_MODULE)

    def claim(self, handle: Any) -> None:
        """Called by ``instrument()`` for each MetricsSink among its sinks. Refuses a sink that already aggregates
        another live handle's calls: the calls carry no model, so two models would be merged into one series set
        (their module labels and types mixed). After that handle is removed, the sink may serve another."""
        with self._lock:
            owner = self._owner() if self._owner is not None else None
            if owner is not None and owner is not handle and not getattr(owner, "_removed", True):
                raise ValueError(
                    f"this MetricsSink already aggregates the calls of a live instrumented {owner.model_name}: give "
                    "each instrument() its own MetricsSink (each on its own registry, or registry=None and "
                    "register it yourself), or use metrics=True, which labels each model's series apart"
                )
            self._owner = weakref.ref(handle)

    # -- export health ------------------------------------------------------------------------------------------

    def watch(self, handle: Any) -> None:
        """Expose ``handle``'s drop and export counts (read at scrape time) as span counters.

        Reads ``handle.dropped_calls`` (calls lost to a full buffer) and the exporter's exported / failed span
        counts. The handle is held weakly; after it is gone its last counts stay exposed, so counters never go
        back. Also names the ``model`` label after the handle's model when no name was given.
        """
        with self._lock:
            if self.model is None:
                self.model = getattr(handle, "model_name", None)
            self._watched.append(_Watched(weakref.ref(handle), str(getattr(handle, "exporter", "unknown"))))

    # -- the collector: runs on the scraping thread ---------------------------------------------------------------

    def describe(self) -> list[Metric]:
        """The metric names, without samples, so a registry refuses a second sink with the same names."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snapshot = _Snapshot(
                model=self.model or "model",
                modules={key: _copy_state(state) for key, state in self._modules.items()},
                histograms={
                    name: _HistogramState(list(h.counts), list(h.exemplars), h.total_seconds)
                    for name, h in self._histograms.items()
                },
                steps=_HistogramState(list(self._steps.counts), list(self._steps.exemplars), self._steps.total_seconds),
                comm_seconds=self._comm_seconds,
                data_wait_seconds=self._data_wait_seconds,
                recorded=self._recorded,
                overflowed_paths=self._overflowed_paths,
                watched=list(self._watched),
                named={path for path, entry in self._paths.items() if entry.state_is_named},
                detail_steps=dict(self._detail_steps) if self.rank_detail is not None else None,
                detail_exemplars=dict(self._detail_exemplars),
            )
        if self.drift is not None:
            snapshot.drift = self.drift.status()
        return self._families(snapshot)

    def _families(self, snapshot: _Snapshot | None = None) -> list[Metric]:
        ns = self.namespace
        base = ["model", "rank"]
        per_module = [*base, "module", "module_type"]
        duration = HistogramMetricFamily(
            f"{ns}_module_call_duration",
            "Duration of module calls by module type; exemplars link to the trace of a call.",
            labels=[*base, "module_type"],
            unit="seconds",
        )
        step_duration = HistogramMetricFamily(
            f"{ns}_step_duration",
            "Duration of traced training steps; exemplars link to the step's trace.",
            labels=base,
            unit="seconds",
        )
        grad_norm = GaugeMetricFamily(
            f"{ns}_gradient_norm",
            "L2 norm of the gradient reaching the module's output (its first output that got one), latest traced "
            "backward.",
            labels=per_module,
        )
        comm_wait = CounterMetricFamily(
            f"{ns}_comm_wait",
            "Time this rank spent in DDP gradient all-reduce during traced steps. The rank waiting least is the "
            "one the others wait for: the straggler.",
            labels=base,
            unit="seconds",
        )
        data_wait = CounterMetricFamily(
            f"{ns}_data_wait",
            "Time this rank spent in traced training steps before their first forward (from the previous step's "
            "end): the data loader's next batch, above all. A rank waiting on input shows here.",
            labels=base,
            unit="seconds",
        )
        nonfinite = CounterMetricFamily(
            f"{ns}_nonfinite_first",
            "Times the module was the first to produce NaN/Inf in a forward or backward.",
            labels=per_module,
        )
        calls = CounterMetricFamily(f"{ns}_module_calls", "Calls of each module.", labels=per_module)
        seconds = CounterMetricFamily(
            f"{ns}_module_call", "Time spent in calls of each module (children included).", labels=per_module,
            unit="seconds",
        )  # fmt: skip
        errors = CounterMetricFamily(f"{ns}_module_call_errors", "Module calls that raised.", labels=per_module)
        nan = CounterMetricFamily(
            f"{ns}_output_nan_values", "NaN elements in the module's output tensors.", labels=per_module
        )
        inf = CounterMetricFamily(
            f"{ns}_output_inf_values", "Infinite elements in the module's output tensors.", labels=per_module
        )
        gauges = {
            stat: GaugeMetricFamily(f"{ns}_{name}", help_text, labels=per_module, unit=unit)
            for stat, (name, unit, help_text) in OUTPUT_STATS.items()
        }
        overflowed = GaugeMetricFamily(
            f"{ns}_metrics_overflowed_modules",
            f'Module paths past max_module_labels, counted under module="{OVERFLOW_MODULE}".',
            labels=base,
        )
        recorded = CounterMetricFamily(f"{ns}_spans_recorded", "Module calls recorded (one span each).", labels=base)
        exported = CounterMetricFamily(
            f"{ns}_spans_exported", "Spans the exporter delivered.", labels=[*base, "exporter"]
        )
        dropped = CounterMetricFamily(
            f"{ns}_spans_dropped",
            "Spans lost: buffer_full (export fell behind the model), export_failed (the backend refused or was down).",
            labels=[*base, "reason"],
        )
        sink_errors = CounterMetricFamily(
            f"{ns}_sink_errors",
            "Batches of calls a sink (exporter, records, metrics, user sink) raised on, and traced forwards that "
            "could not be read; logged with the traceback.",
            labels=base,
        )
        families: list[Metric] = [
            duration, calls, seconds, errors, nan, inf, *gauges.values(), overflowed, recorded, exported, dropped,
            sink_errors, step_duration, grad_norm, nonfinite, comm_wait, data_wait,
        ]  # fmt: skip
        if self.drift is not None:
            drift = GaugeMetricFamily(
                f"{ns}_layer_drift",
                "Drift of the module's output statistic from the baseline over its last window of calls; 1 is the "
                "alert threshold (see docs/drift.md).",
                labels=[*base, "module", "statistic"],
            )
            first = GaugeMetricFamily(
                f"{ns}_layer_drift_first_timestamp",
                "The first drifted layer: of the layers over the threshold, the earliest in execution order; the "
                "value is when it went over (Unix time). No sample while no layer is over.",
                labels=[*base, "module", "statistic"],
                unit="seconds",
            )
            families += [drift, first]
        if snapshot is None or snapshot.detail_steps is not None:  # described always, exposed under "auto"
            detail_steps = CounterMetricFamily(
                f"{ns}_rank_detail_steps",
                'Rank detail "auto": traced steps in which this rank sent its module spans, by reason: rank (one of '
                "detail_ranks), straggler (the others waited for it at the all-reduce), nonfinite (a NaN/Inf started "
                "on it), raised (its forward raised); exemplars link to the latest such step's trace.",
                labels=[*base, "reason"],
            )
            families.append(detail_steps)
        if snapshot is None:
            return families
        if snapshot.detail_steps is not None:  # every reason, 0 included: "never a straggler" is a value
            for reason, count in snapshot.detail_steps.items():
                raw = snapshot.detail_exemplars.get(reason)
                detail_steps.add_metric([snapshot.model, self.rank, reason], count,
                                        exemplar=_exemplar(raw) if raw else None)  # fmt: skip
        if snapshot.drift is not None:
            for layer in snapshot.drift.layers:  # bounded as the per-module series are: named paths only
                if layer.module in snapshot.named:
                    drift.add_metric([snapshot.model, self.rank, layer.module or snapshot.model, layer.statistic],
                                     layer.score)  # fmt: skip
            top = snapshot.drift.first
            if self.rank_detail == MODEL_ONLY and top is not None and top.module not in snapshot.named:
                top = None  # a rank without module series: the first drifted layer only if it is the root
            if top is not None and top.since is not None:
                first.add_metric([snapshot.model, self.rank, top.module or snapshot.model, top.statistic], top.since)

        model_rank = [snapshot.model, self.rank]
        bounds = [*(floatToGoString(b) for b in self.bucket_bounds), "+Inf"]
        for module_type, histogram in sorted(snapshot.histograms.items()):
            duration.add_metric([*model_rank, module_type], _buckets(bounds, histogram), histogram.total_seconds)
        step_duration.add_metric(model_rank, _buckets(bounds, snapshot.steps), snapshot.steps.total_seconds)
        comm_wait.add_metric(model_rank, snapshot.comm_seconds)
        data_wait.add_metric(model_rank, snapshot.data_wait_seconds)
        for (module, module_type), state in sorted(snapshot.modules.items()):
            labels = [*model_rank, module, module_type]
            calls.add_metric(labels, state.calls)
            seconds.add_metric(labels, state.seconds)
            errors.add_metric(labels, state.errors)
            nan.add_metric(labels, state.nan_values)
            inf.add_metric(labels, state.inf_values)
            nonfinite.add_metric(labels, state.nonfinite_first)
            if state.grad_norm is not None:
                grad_norm.add_metric(labels, state.grad_norm)
            for stat, value in state.latest.items():
                gauges[stat].add_metric(labels, value)
        overflowed.add_metric(model_rank, snapshot.overflowed_paths)
        recorded.add_metric(model_rank, snapshot.recorded)
        buffer_dropped = export_failed = failed_batches = 0
        exported_by: dict[str, int] = {}
        for watched in snapshot.watched:
            counts = watched.read()
            buffer_dropped += counts.dropped
            failed_batches += counts.sink_errors
            if counts.exported is not None:
                exported_by[watched.exporter] = exported_by.get(watched.exporter, 0) + counts.exported
                export_failed += counts.failed
        for exporter_name, count in sorted(exported_by.items()):
            exported.add_metric([*model_rank, exporter_name], count)
        # always present (0 included) so "no drops" is a value, not missing data, and an alert can see it
        dropped.add_metric([*model_rank, "buffer_full"], buffer_dropped)
        dropped.add_metric([*model_rank, "export_failed"], export_failed)
        sink_errors.add_metric(model_rank, failed_batches)
        return families


def _observe(histogram: _HistogramState, bucket_bounds: tuple[float, ...], call: ModuleCall) -> None:
    seconds = (call.end_ns - call.start_ns) / 1e9
    index = bisect.bisect_left(bucket_bounds, seconds)  # first bound >= seconds: Prometheus' "le"
    histogram.counts[index] += 1
    histogram.total_seconds += seconds
    if call.trace_flags & 1:  # only a sampled span is worth linking to; formatted at scrape time
        histogram.exemplars[index] = (call.trace_id, call.span_id, seconds, call.end_ns)


def _buckets(bounds: list[str], histogram: _HistogramState) -> list[tuple]:
    """Cumulative buckets with their exemplars, as HistogramMetricFamily takes them."""
    cumulative, buckets = 0, []
    for bound, count, exemplar in zip(bounds, histogram.counts, histogram.exemplars):
        cumulative += count
        buckets.append((bound, cumulative, _exemplar(exemplar)) if exemplar else (bound, cumulative))
    return buckets


@dataclass(slots=True)
class _Counts:
    dropped: int = 0
    exported: int | None = None  # None: the exporter keeps no count (sdk: the SDK's processor owns delivery)
    failed: int = 0
    sink_errors: int = 0


@dataclass(slots=True)
class _Watched:
    handle: weakref.ref
    exporter: str
    last: _Counts = field(default_factory=_Counts)

    def read(self) -> _Counts:
        """Current counts of the handle, or its last ones once it is gone."""
        handle = self.handle()
        if handle is not None:
            self.last = _Counts(handle.dropped_calls, handle.exported_spans, handle.failed_spans, handle.sink_errors)
        return self.last


@dataclass(slots=True)
class _Snapshot:
    model: str
    modules: dict[tuple[str, str], _ModuleState]
    histograms: dict[str, _HistogramState]
    steps: _HistogramState
    comm_seconds: float
    data_wait_seconds: float
    recorded: int
    overflowed_paths: int
    watched: list[_Watched]
    named: set[str] = field(default_factory=set)  # paths with series of their own (not the overflow's)
    drift: Any = None  # the DriftStatus at the scrape, with a baseline
    detail_steps: dict[str, int] | None = None  # rank_detail="auto": steps detailed, by reason
    detail_exemplars: dict[str, _RawExemplar] = field(default_factory=dict)


def _copy_state(state: _ModuleState) -> _ModuleState:
    return _ModuleState(
        state.module_type, state.calls, state.seconds, state.errors, state.nan_values, state.inf_values,
        state.nonfinite_first, state.grad_norm, dict(state.latest),
    )  # fmt: skip


def _exemplar(raw: _RawExemplar) -> Exemplar:
    trace_id, span_id, seconds, end_ns = raw
    return Exemplar({"trace_id": f"{trace_id:032x}", "span_id": f"{span_id:016x}"}, seconds, end_ns / 1e9)
