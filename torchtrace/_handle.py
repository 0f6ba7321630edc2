"""``instrument(model)`` and the handle it returns: hooks in, records out, export wired up."""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace

from torchtrace._capture import replaced as _replaced
from torchtrace._capture.buffer import RecordBuffer
from torchtrace._capture.comm import is_ddp, unwatch_ddp, watch_ddp
from torchtrace._capture.copies import follow_copies
from torchtrace._capture.recorder import HookRecorder, warn_compiled_modules
from torchtrace._capture.selection import is_compiled_module, select_modules, type_name
from torchtrace._capture.steps import GRAD_STATS, StepRecord, StepTracker
from torchtrace._capture.traced_forward import can_wrap, compiled_call, wrap_compiled_call, wrap_forward
from torchtrace._core import settings
from torchtrace._core import signals as _signals
from torchtrace._core.baseline import DRIFT_STATS, Baseline, BaselineBuilder
from torchtrace._core.calls import ModuleCall, NonFiniteError
from torchtrace._core.options import (
    ENV_METRICS,
    Drift,
    Limits,
    Options,
    Records,
    Stats,
    TraceFile,
    Training,
    env_text,
    resolve_options,
)
from torchtrace._core.ranks import RankInfo, rank_info
from torchtrace._core.schedule import always, sampled
from torchtrace._pipeline.dispatcher import Dispatcher, first_nonfinite, resolve_forward
from torchtrace._pipeline.rank_detail import RankDetail, policy_for
from torchtrace._pipeline.step_bounds import StepBounds, job_store
from torchtrace._sinks.drift import DriftScorer, DriftStatus
from torchtrace._sinks.metrics_server import forget_unmetered, note_unmetered
from torchtrace._sinks.records import RecordStore
from torchtrace._sinks.sdk_spans import SdkSpanSink
from torchtrace._sinks.summary import SummarySink
from torchtrace.version import __version__

_logger = logging.getLogger(__name__)
REMOVE_WAIT_S = 1.0  # how long remove() waits for forwards running on other threads to finish traced
_instrumented: weakref.WeakKeyDictionary[torch.nn.Module, TraceHandle] = weakref.WeakKeyDictionary()
_live_handles: weakref.WeakSet[TraceHandle] = weakref.WeakSet()


class TraceHandle:
    """Returned by :func:`instrument`. A context manager; ``remove()`` is idempotent and leaves no hook behind."""

    def __init__(self, model: torch.nn.Module, options: Options) -> None:
        self.options = options
        selected = select_modules(model, options)
        self.monitored_layers: list[str] = [info.path for _, info in selected]
        self._monitored = frozenset(self.monitored_layers)
        self._warned_open_step = False
        modules = [info for _, info in selected]
        self._drift = _drift_scorer(options, model, modules)
        self.buffer = RecordBuffer(options.limits.max_pending_calls)
        self._steps = _step_tracker(options, model)
        rank = self._steps.rank if self._steps is not None else None
        auto = policy_for(options.training.rank_detail, rank) == "auto"
        training = options.training
        self._rank_detail = RankDetail(rank, training.detail_ranks, training.rotating_detail) if auto else None
        self._step_bounds = _step_bounds(rank)
        self._recorder = HookRecorder(modules, options, self.buffer, self._steps, resolve_forward)
        self._recorder.warned_compiled = is_compiled_module(model)  # select_modules said so already
        self._records = RecordStore(options.records.max_records, on_drop=self._recorder.release_capture)
        self._summary = SummarySink()
        self._hook_handles: list = []
        self._handles_by_index: dict[int, list] = {}  # a traced module's (index into modules) hooks and entries
        self._warned_replaced = False
        self._warned_compiled_after = False
        self._optimizer_hooks: list = []
        self._export_sinks: list = []
        self.metrics: Any = None
        self._losses_at_flush = (0, 0, 0)  # dropped calls, failed spans, sink errors: flush() reports news of them
        try:  # all or nothing: a failure part way takes down what was set up (hooks, DDP watch, senders, metrics)
            self._install(model, options, selected, modules)
        except BaseException:
            self._undo_partial(model)
            raise

    def _install(self, model: torch.nn.Module, options: Options, selected: list, modules: list[Any]) -> None:
        """Metrics, exporter, DDP and optimizer watches, module hooks, then the worker: anything may raise."""
        self.metrics = _metrics_sink(options.metrics, model)
        _claim_metrics_sinks([self.metrics, *options.sinks], self)  # before anything starts: a refusal leaks nothing
        self.exporter, self._export_sinks, self._flushers = _export_sinks(options)
        metrics_sinks = [self.metrics] if self.metrics is not None else []
        # OTLP / file exports go out in batches every export_interval_ms; SDK spans go to the provider's processors
        # at once (they batch): first, as they may write the provider's ids back into the calls
        export_sinks = self._export_sinks
        batched = export_sinks if self.exporter in ("otlp", "file") else []
        # drift first: the calls it marks reach every other sink and exporter marked
        drift = [self._drift] if self._drift is not None else []
        sinks = [*drift, *(export_sinks if not batched else []), self._records, self._summary, *metrics_sinks,
                 *options.sinks]  # fmt: skip
        metrics = sys.modules.get("torchtrace._sinks.metrics")  # imported once a MetricsSink exists
        for sink in [*metrics_sinks, *options.sinks]:
            if metrics is None or not isinstance(sink, metrics.MetricsSink):
                continue
            if self._drift is not None:
                sink.drift = self._drift  # exposes the drift scores
            # rank_detail="auto": a rank outside detail_ranks keeps its model-level series only, whatever steps it
            # sends module spans of (a straggler's, a NaN's): its series stay bounded however long the job runs
            sink.rank_detail = None
            if self._rank_detail is not None:
                detailed = self._rank_detail.rank in self._rank_detail.detail_ranks
                sink.rank_detail = metrics.DETAIL_RANK if detailed else metrics.MODEL_ONLY
        self._dispatcher = Dispatcher(
            self.buffer,
            modules,
            sinks,
            options.limits.export_interval_ms / 1000,
            batched,
            (self._records, self._summary),
        )
        self._recorder.deliver = self._dispatcher.deliver_at_forward_end
        self._dispatcher.forward_running = self._recorder.forward_running
        self._dispatcher.step_bounds = self._step_bounds
        if callable(options.stats.on_nonfinite):
            self._dispatcher.on_nonfinite = options.stats.on_nonfinite
        if is_ddp(model):
            hook, state = options.training.comm_hook or (None, None)
            watch_ddp(model, self._steps, hook, state)
        self._optimizer_hooks = _watch_optimizer(options.optimizer, self) if options.optimizer is not None else []
        with_kwargs = options.stats.inputs
        # the traced root (DDP's inner module, where DDP wraps it), if the selection traces it: see _hooks
        roots = [module for module, info in selected if not info.path]
        self._recorder.model_ref = weakref.ref(roots[0]) if roots else None
        # the root's hooks last: a forward other threads start meanwhile is traced whole or not at all (before
        # them, its submodules see its call on the stack: _inside_unseen_model_call)
        self._module_refs = [weakref.ref(module) for module, _ in selected]
        self._on_compile = weakref.WeakMethod(self._on_compiled)  # held weakly by each module's compile() watch
        for index, (module, info) in reversed(list(enumerate(selected))):
            self._trace(index, module, info, with_kwargs)
        _replaced.watch(model, self.monitored_layers, self._on_replaced)
        self._model_ref = weakref.ref(model)
        self.model_name = type_name(model)  # kept after the model is gone (summaries printed at exit)
        self._removed = False
        _instrumented[model] = self
        _live_handles.add(self)
        if self.metrics is not None:
            self.metrics.watch(self)
        # a model dropped without remove() must not leave the worker thread running
        weakref.finalize(model, _remove_if_alive, weakref.ref(self))
        self._dispatcher.start()
        if settings.current().handle_sigterm:
            _signals.hold(self, self._flush_within)

    def _trace(self, index: int, module: torch.nn.Module, info: Any, with_kwargs: bool) -> None:
        """Puts module ``index``'s tracing in: its traced forward, its compiled call or torch's hooks, and its
        instance entries (copies, ``compile()``)."""
        if info.path and compiled_call(module) is not None:  # module.compile(): around its compiled call (selection)
            added: list = [wrap_compiled_call(module, self._recorder.traced_compiled_call(index))]
            hook_ids: frozenset[int] = frozenset()
        # the model's root keeps torch's hooks: they run outside a torch.compile'd region (region-level spans)
        elif info.path and can_wrap(module):
            added = [wrap_forward(module, *self._recorder.traced_forward(index))]
            hook_ids = frozenset()
        else:
            pre = self._recorder.forward_pre_hook(index)
            post = self._recorder.forward_post_hook(index)
            added = [module.register_forward_pre_hook(pre, with_kwargs=with_kwargs),
                     module.register_forward_hook(post, always_call=True)]  # fmt: skip
            hook_ids = frozenset(handle.id for handle in added)
        # its copies run themselves: pickled or copied untraced, DataParallel's replicas traced; compile() followed
        watch = info.path and not is_compiled_module(module)  # the model's own compile() keeps its hooks
        added.append(follow_copies(module, hook_ids, self._on_compile if watch else None))
        self._hook_handles += added
        self._handles_by_index[index] = added

    def _on_compiled(self, module: torch.nn.Module) -> None:
        """``module.compile()`` on a traced module after instrument(): from its next call it is traced as a whole,
        around its compiled call, and the traced modules inside it no longer are (as where it was compiled before
        instrument(): see ``selection.compiled_alone``); warned once per handle."""
        index = next((i for i, ref in enumerate(self._module_refs) if ref() is module), None)
        if self._removed or index is None or index not in self._handles_by_index:
            return  # a copy of a traced module, or one no longer traced
        path = self._recorder.modules[index].path
        prefix = path + "."
        inside = [i for i, info in enumerate(self._recorder.modules) if info.path.startswith(prefix)]
        for stale in [index, *inside]:
            for handle in self._handles_by_index.pop(stale, ()):
                handle.remove()
        self._trace(index, module, self._recorder.modules[index], self.options.stats.inputs)
        if not self._warned_compiled_after:
            self._warned_compiled_after = True
            warn_compiled_modules([path], stacklevel=4, after=True)

    def _on_replaced(self, path: str, new: Any) -> None:
        """Another module was put where the traced one at ``path`` was: it and the traced modules under it stop
        being traced (see ``replaced``); warned once per handle."""
        prefix = path + "."
        stale = [index for index, info in enumerate(self._recorder.modules) if info.path == path or
                 info.path.startswith(prefix)]  # fmt: skip
        for index in stale:
            for handle in self._handles_by_index.pop(index, ()):
                handle.remove()
        if not self._warned_replaced and stale:
            self._warned_replaced = True
            _logger.warning(
                "torchtrace: %s (%s) of %s was replaced by %s.%s after instrument(): it is no longer traced (nor "
                "are the %d traced modules under it, nor what replaced it), as its spans would name a path that is "
                "no longer its own. Later replacements are not warned of again; remove() and instrument() again to "
                "trace the model as it is now.",
                path, self._recorder.modules[stale[0]].type_name, self.model_name, type(new).__module__,
                type(new).__qualname__, len(stale) - 1,
            )  # fmt: skip

    def _remove_hooks(self, model: torch.nn.Module | None) -> None:
        """Takes out every hook, traced forward and optimizer hook this handle put in, and stops watching the
        model's modules for replacement."""
        for handle in [*self._hook_handles, *self._optimizer_hooks]:
            handle.remove()
        self._hook_handles.clear()
        self._handles_by_index.clear()
        self._optimizer_hooks.clear()
        if model is not None:
            _replaced.unwatch(model, self.monitored_layers)

    def _flush_within(self, seconds: float) -> None:
        if self._rank_detail is not None:  # the steps waiting for their run: the process ends after this flush
            self._rank_detail.close(wait=datetime.timedelta(seconds=seconds / 2))
        self.flush(timeout_millis=int(seconds * 1000))

    def _undo_partial(self, model: torch.nn.Module) -> None:
        """instrument() failed part way: remove what it set up, so the model runs exactly as before."""
        self._removed = True  # a MetricsSink it claimed may serve another handle
        self._remove_hooks(model)
        if self._steps is not None and is_ddp(model):
            unwatch_ddp(model, self._steps)
        for sink in self._export_sinks:
            if hasattr(sink, "shutdown"):
                sink.shutdown()
        if self.options.metrics is True and self.metrics is not None:
            from torchtrace._sinks.metrics import INSTRUMENTED_MODELS

            INSTRUMENTED_MODELS.retire(self.metrics)
        if _instrumented.get(model) is self:
            del _instrumented[model]
        _live_handles.discard(self)

    # -- verbs ------------------------------------------------------------------------------------------------------

    def enable(self) -> None:
        """Resume recording (from the next outermost forward)."""
        self._recorder.enabled = True

    def disable(self) -> None:
        """Pause recording; hooks stay registered and cost one branch per call."""
        self._recorder.enabled = False

    @property
    def enabled(self) -> bool:
        return self._recorder.enabled

    def flush(self, timeout_millis: int = 30_000) -> bool:
        """Every call recorded so far reaches the sinks and exporters before this returns (under
        ``Training(rank_detail="auto")``, but the last few traced steps, which wait for their run of steps to be
        gathered from the ranks, or for ``remove()``).

        True only if everything recorded since the previous ``flush()`` was delivered: False when any of it was
        dropped (buffer full), failed to export (refused, timed out, unwritable file), or a sink raised on it.
        """
        self._recorder.close_interrupted()  # a forward Ctrl-C stopped (torch ran no hook for it) is delivered too
        self._dispatcher.drain()
        ok = True
        for flush in self._flushers:
            try:
                ok = flush(timeout_millis) is not False and ok
            except Exception:
                _logger.exception("torchtrace: flushing the exporter failed")
                ok = False
        losses = (self.dropped_calls, self.failed_spans, self.sink_errors)
        ok = ok and losses == self._losses_at_flush
        self._losses_at_flush = losses
        return ok

    def report(
        self, path: str | os.PathLike[str] = "report.html", baseline: Baseline | str | os.PathLike[str] | None = None
    ) -> Path:
        """Writes the HTML report (``torchtrace report``) of this handle's trace file, flushed first; returns its
        path. The file holds earlier runs appended to it too. Only for the file exporter. The overview shows this
        handle's ``dropped_calls``, ``failed_spans`` and ``sink_errors`` (trace files do not record them).
        ``baseline`` (a ``Baseline`` or its file) marks the layers that drifted from it, as ``--baseline``."""
        if self.exporter != "file":
            raise ValueError(
                f"handle.report() reads the trace file of the file exporter; this handle's is {self.exporter!r}"
            )
        from torchtrace._offline.report import write_report

        self.flush()
        losses = {"dropped_calls": self.dropped_calls, "failed_spans": self.failed_spans}
        losses["sink_errors"] = self.sink_errors
        write_report([self.options.trace_file.path], path, losses=losses, baseline=baseline)
        return Path(path)

    def remove(self) -> None:
        """Remove every hook, deliver what was recorded, stop the worker. Safe to call twice.

        No forward begins to be traced from the call on; forwards other threads are running then are waited for
        (up to ``REMOVE_WAIT_S``) so that each is traced whole, then the hooks come out."""
        if self._removed:
            return
        self._removed = True
        recorder = self._recorder
        recorder.enabled = False  # also for a copy that kept our forward (see TracedForward.__deepcopy__)
        deadline = time.monotonic() + REMOVE_WAIT_S
        while (running := recorder.running_elsewhere()) and time.monotonic() < deadline:
            time.sleep(0.001)
        if running:
            _logger.warning(
                "torchtrace: remove() went on while %d forward(s) ran on other threads for over %.0f s: their later "
                "calls are not traced", running, REMOVE_WAIT_S,
            )  # fmt: skip
        self._remove_hooks(self._model_ref())
        self._recorder.close_interrupted()
        if self._steps is not None:
            model = self._model_ref()
            if model is not None and is_ddp(model):
                unwatch_ddp(model, self._steps)
            record = self._steps.finish()  # what the unfinished step recorded is delivered too
            if self._rank_detail is not None:
                self._rank_detail.close()  # the last traced steps' facts, gathered with the ranks removing here too
                if record is not None:  # no gather: the other ranks may be gone, or go on
                    record.detail = self._rank_detail.alone()
            self._deliver_step(record)
        self._dispatcher.stop()
        self.flush()
        for shutdown in self._shutdowns():
            shutdown()
        print_summary = settings.current().print_summary
        if print_summary or (print_summary is None and self.exporter == "file" and self.options.exporter == "auto"):
            print(
                f"{self.summary(limit=30)}\n\ntorchtrace: traces written to {self.options.trace_file.path}",
                file=sys.stderr,
            )
        if self.options.metrics is True:
            from torchtrace._sinks.metrics import INSTRUMENTED_MODELS

            INSTRUMENTED_MODELS.retire(self.metrics)
        model = self._model_ref()
        if model is not None and _instrumented.get(model) is self:
            del _instrumented[model]
        _live_handles.discard(self)
        forget_unmetered(self)
        _signals.release(self)

    def step(self) -> None:
        """Close the current training step (one trace: its forwards, backward and optimizer step) and start the
        next. With ``optimizer=`` this happens at the end of each ``optimizer.step()``. Call it before
        ``zero_grad()`` when ``Training(param_stats=True)`` and no optimizer is given.

        With ``Stats(on_nonfinite="raise")`` it raises :class:`NonFiniteError` naming the first module that produced
        NaN/Inf in this step (forward or backward): the verdict is read once per step, not per layer.
        """
        if self._steps is None:
            raise RuntimeError(
                "step() needs step tracing: instrument(model, backward=True / optimizer= / "
                "training=Training(schedule=))"
            )
        if self._steps.closed_by_optimizer:
            return  # optimizer.step() closed this iteration's step already (a step() after it is not another one)
        record = self._steps.finish()
        verdict = None
        if record is not None and self.options.stats.on_nonfinite == "raise":
            verdict = first_nonfinite(record, self._recorder.modules)  # before the worker may read and release it
        if record is not None and self._rank_detail is not None:
            nonfinite = True if verdict is not None else self._started_nonfinite(record)
            record.detail = self._rank_detail.start(record, nonfinite)
        self._deliver_step(record)
        if verdict is not None:
            raise NonFiniteError(verdict)

    def _started_nonfinite(self, record: StepRecord) -> bool | None:
        """Whether NaN/Inf showed in this step's forward outputs or gradients (before any all-reduce); None where
        statistics are still on a device (reading them would wait for it)."""
        if record.device is not None or any(forward.device is not None for forward in record.forwards):
            return None
        if record.grads_finite and all(forward.all_finite for forward in record.forwards):
            return False
        return first_nonfinite(record, self._recorder.modules) is not None

    @property
    def step_number(self) -> int | None:
        """The number of the current (open) training step, from 0; None without step tracing."""
        return self._steps.number if self._steps is not None else None

    def _deliver_step(self, record: StepRecord | None) -> None:
        if record is None or self.buffer.put(record, record.module_calls()) or record.rank is None:
            return
        # in a job a dropped step still sends its step-level spans (no call: within the buffer's bound), so that rank
        # 0's step root has its bounds and the step its place in every rank's view
        record.forwards, record.backward_events = [], []
        self.buffer.put(record, 0)

    def __enter__(self) -> TraceHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    # -- drift --------------------------------------------------------------------------------------------------------

    def drift(self) -> DriftStatus:
        """Each traced layer's drift from the baseline (``instrument(baseline=...)``): scores, the first drifted
        layer and since when. Scores cover the calls delivered so far (drained first)."""
        if self._drift is None:
            raise ValueError('drift() needs a baseline: instrument(model, baseline="baseline.json")')
        self._dispatcher.drain()
        return self._drift.status()

    def baseline(self) -> Baseline:
        """A ``Baseline`` of this model from the forward calls the records keep (``Records(max_records=)`` sets how
        many: keep a few hundred forwards); ``.save(path)`` it, and pass it or its path to ``instrument(baseline=)``
        where the model runs later."""
        builder = BaselineBuilder()
        for call in self.records:
            if call.kind == "forward":
                builder.add(call.path, call.type_name, call.attributes)
        model = self.model
        return builder.build(
            parameters=_parameter_count(model) if model is not None else None,
            source=f"records of {self.model_name}",
        )

    # -- in-memory records (spikingjelly monitor style) ----------------------------------------------------------------

    @property
    def records(self) -> list[ModuleCall]:
        """Every kept call, in call order (the latest ``max_records``; a copy)."""
        self._drain_for_reading()
        return self._records.all()

    def __getitem__(self, key: str | int | slice) -> Any:
        """The kept forward calls of one module path, in call order; ``handle[i]`` / ``handle[i:j]`` index
        ``records``. A path that is not traced raises KeyError (one that is, but was not called yet, gives [])."""
        self._drain_for_reading()
        if isinstance(key, (int, slice)):
            return self._records.at(key)
        if key not in self._monitored:
            raise KeyError(f"{key!r} is not a traced module path; traced: {self.monitored_layers[:10]}")
        return self._records.for_path(key)

    def backward_records(self, path: str) -> list[ModuleCall]:
        """The kept backward calls (gradient statistics) of one module path, in order."""
        self._drain_for_reading()
        return self._records.for_path(path, kind="backward")

    @property
    def dropped_records(self) -> int:
        """Calls dropped from the records past ``max_records`` (oldest first; exported all the same)."""
        return self._records.dropped

    def _drain_for_reading(self) -> None:
        self._dispatcher.drain()
        steps = self._steps
        if steps is not None and not self._warned_open_step and (steps.pending_calls or steps.events):
            self._warned_open_step = True
            _logger.warning(
                "torchtrace: the open training step holds calls that reach the records (and exporters) when it "
                "closes: call handle.step() after each step, or pass optimizer= (logged once)"
            )

    def clear_recorded_data(self) -> None:
        self._dispatcher.drain()
        with self._dispatcher.deliver_lock:  # a forward ending on another thread may be handing them its calls
            self._records.clear()
            self._summary.clear()
        self._recorder.captured_bytes = 0

    def summary(self, limit: int | None = None) -> str:
        """Per-layer table: calls, total / mean / p95 time, share of the forward."""
        self._dispatcher.drain()
        return self._summary.table(limit)

    def summary_rows(self):
        self._dispatcher.drain()
        return self._summary.rows()

    @property
    def dropped_calls(self) -> int:
        """Calls lost because the buffer was full (export slower than the model); also logged."""
        return self.buffer.dropped_calls

    @property
    def sink_errors(self) -> int:
        """Batches of calls a sink (exporter, records, summary, metrics, your own) raised on, and traced forwards
        or steps that could not be read; each is logged."""
        return self._dispatcher.sink_errors

    @property
    def skipped_captures(self) -> int:
        """Tensors not captured (``capture_tensors``) because ``capture_max_bytes`` was reached."""
        return self._recorder.skipped_captures

    @property
    def exported_spans(self) -> int | None:
        """Spans the OTLP / file exporter delivered; None with the "sdk" exporter (its processors deliver)."""
        sink = self._counting_exporter()
        return sink.exported if sink is not None else None

    @property
    def failed_spans(self) -> int:
        """Spans the OTLP / file exporter could not deliver (also logged)."""
        sink = self._counting_exporter()
        return sink.failed if sink is not None else 0

    @property
    def model(self) -> torch.nn.Module | None:
        """The instrumented model, while it exists (held weakly)."""
        return self._model_ref()

    def _counting_exporter(self) -> Any:
        return next((sink for sink in self._dispatcher.sinks if hasattr(sink, "exported")), None)

    def _shutdowns(self) -> list[Callable[[], None]]:
        return [sink.shutdown for sink in self._dispatcher.sinks if hasattr(sink, "shutdown")]


def _step_tracker(options: Options, model: torch.nn.Module) -> StepTracker | None:
    """Step tracing is on when backward, a schedule or an optimizer is given, and for DDP models."""
    if not (
        options.backward or options.training.schedule is not None or options.optimizer is not None or is_ddp(model)
    ):
        return None
    inner = _inner(model)
    name = type(inner).__name__
    same_class = sum(
        1 for handle in _live_handles if handle._steps is not None and handle._steps.model_key.split("#")[0] == name
    )
    steps = options.training.schedule
    if steps is None:  # sample_every / sample_ratio pick steps here: the step, not each forward, is what is traced
        sampling = options.sample_every > 1 or options.sample_ratio < 1
        steps = sampled(options.sample_every, options.sample_ratio) if sampling else always
    return StepTracker(
        steps,
        backward=options.backward,
        param_stats=options.training.param_stats,
        on_grad_output=options.records.function_on_grad_output,
        on_grad_input=options.records.function_on_grad_input,
        model_key=name if not same_class else f"{name}#{same_class + 1}",
        rank=rank_info(),
        stats_sample=options.stats.sample,
        grad_stats=GRAD_STATS & frozenset(options.stats.names),
    )


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if is_ddp(model) else model


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in _inner(model).parameters())


_step_bounds_made = itertools.count()  # every rank instruments its models in the same order: the same key for each


def _step_bounds(rank: RankInfo | None) -> StepBounds | None:
    """The exchange of step bounds with the other ranks (rank 0's step roots span every rank's step), in a job."""
    store = job_store() if rank is not None and rank.world_size > 1 else None
    if store is None:
        return None
    return StepBounds(rank, store, f"torchtrace/{rank.run_id}/step-bounds/{next(_step_bounds_made)}")


def _drift_scorer(options: Options, model: torch.nn.Module, modules: list) -> DriftScorer | None:
    """The drift sink of ``baseline=``, once the baseline is known to be this model's and statistics it scores are
    on; raises (a ``BaselineError``, a ValueError) otherwise."""
    drift: Drift = options.baseline
    if drift.baseline is None:
        return None
    drift.baseline.check(type_name(_inner(model)), _parameter_count(model), {info.path: info.type_name for info in
                                                                              modules})  # fmt: skip
    if not set(options.stats.names) & set(DRIFT_STATS):
        raise ValueError(
            f"baseline= scores the statistics {', '.join(DRIFT_STATS)} of each layer's output: stats= turns all of "
            f"them off ({list(options.stats.names)})"
        )
    return DriftScorer(drift.baseline, drift.window, drift.threshold)


def _watch_optimizer(optimizer: torch.optim.Optimizer, handle: TraceHandle) -> list:
    """optimizer.step() is timed as the step's "optimizer.step" span and closes the step."""
    steps = handle._steps

    def after_step(*_: Any) -> None:
        steps.optimizer_finished()
        handle.step()
        steps.closed_by_optimizer = True

    return [
        optimizer.register_step_pre_hook(lambda *_: steps.optimizer_started()),
        optimizer.register_step_post_hook(after_step),
    ]


_metrics_server: Any = None  # the process's TORCHTRACE_METRICS_PORT endpoint, started once


def _metrics_sink(option: Any, model: torch.nn.Module) -> Any:
    """The MetricsSink for ``metrics=``; starts the env-configured endpoint once per process."""
    global _metrics_server
    if not option:
        return None
    from torchtrace._sinks.metrics import INSTRUMENTED_MODELS, MetricsSink
    from torchtrace._sinks.metrics_server import metrics_from_env

    if _metrics_server is None:
        try:
            _metrics_server = metrics_from_env()
        except OSError as error:  # the port is taken (another job on the node): trace on, serve nothing
            _logger.warning(
                "torchtrace: cannot serve metrics as TORCHTRACE_METRICS_PORT asks (%s); they are still aggregated "
                "(torchtrace.serve_metrics() can serve them elsewhere)",
                error,
            )
    if option is not True:
        return option
    sink = MetricsSink(registry=None, model=type_name(_inner(model)))
    INSTRUMENTED_MODELS.add(sink)  # one collector on the global registry for every model instrumented so
    return sink


def _claim_metrics_sinks(sinks: list, handle: TraceHandle) -> None:
    """Each MetricsSink among ``sinks`` serves this handle alone (MetricsSink.claim refuses a shared one)."""
    metrics = sys.modules.get("torchtrace._sinks.metrics")  # imported once a MetricsSink exists: none if not imported
    for sink in sinks:
        if metrics is not None and isinstance(sink, metrics.MetricsSink):
            sink.claim(handle)


def _remove_if_alive(handle_ref: weakref.ref) -> None:
    handle = handle_ref()
    if handle is not None:
        handle.remove()


def _export_sinks(options: Options) -> tuple[str, list, list]:
    """Which exporter runs ("sdk", "otlp", "file" or "none"), its sinks and its flush functions."""
    exporter = options.exporter
    provider = options.tracer_provider
    if exporter == "auto" and (provider is not None or hasattr(trace.get_tracer_provider(), "add_span_processor")):
        exporter = "sdk"  # the user's (or opentelemetry-instrument's) SDK provider decides where spans go
    if exporter == "sdk":
        provider = provider or trace.get_tracer_provider()
        flush = getattr(provider, "force_flush", None)
        return exporter, [SdkSpanSink(provider)], [flush] if flush else []
    if exporter == "none":
        return exporter, [], []
    from torchtrace._otlp import (
        exporters as _exporters,  # loads the OTLP exporters' gRPC/HTTP stacks only when they are used
    )

    if exporter == "auto":
        exporter = "otlp" if _exporters.otlp_endpoint_configured() else "file"
    sender = _exporters.create_otlp_sender() if exporter == "otlp" else _exporters.file_sender(options.trace_file)
    sink = _exporters.OtlpSink(sender, _exporters.process_resource(), "torchtrace", __version__)
    return exporter, [sink], []


def _overlapping_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """An instrumented model that ``model`` contains (DDP's module, a compiled model's original) or is part of."""
    inside = set(model.modules())
    for traced in list(_instrumented.keys()):
        if traced in inside or model in set(traced.modules()):
            return traced
    return None


def handle_of(model: torch.nn.Module) -> TraceHandle | None:
    """The live handle tracing ``model``, if any: a way back to ``remove()`` when the handle was not kept."""
    return _instrumented.get(model)


def instrument(
    model: torch.nn.Module,
    *,
    exporter: str | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    trace_file: str | os.PathLike | TraceFile | None = None,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    types: type | tuple[type, ...] | None = None,
    max_depth: int | None = None,
    stats: bool | str | Iterable[str] | Stats | None = None,
    sample_every: int | None = None,
    sample_ratio: float | None = None,
    backward: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    training: Training | None = None,
    metrics: bool | Callable | None = None,
    sinks: Iterable[Callable] | None = None,
    records: Records | None = None,
    limits: Limits | None = None,
    baseline: str | os.PathLike | Baseline | Drift | None = None,
) -> TraceHandle:
    """Trace every call of the selected modules of ``model``: a span each, with tensor statistics.

    Every option is keyword-only; one left ``None`` comes from its ``TORCHTRACE_*`` environment variable, else its
    default (docs/configuration.md lists them). Invalid options raise here, never inside a hook. Process-wide
    settings (SIGTERM handling, the summary printed at exit, CUDA timing) are ``torchtrace.configure()``'s.

    Args:
        model: the module to trace; its root's call is the outermost span of each forward.
        exporter: where spans go: ``"auto"`` (the SDK provider when one is installed, else OTLP when an
            ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set, else the trace file), ``"otlp"``, ``"sdk"``, ``"file"`` or
            ``"none"``.
        tracer_provider: the OpenTelemetry ``TracerProvider`` of the ``"sdk"`` exporter (default: the global one).
        trace_file: the ``"file"`` exporter's path, or a ``TraceFile`` with its rotation.
        include: globs over module paths (``"encoder.*"``) to trace; default every module.
        exclude: globs over module paths not to trace.
        types: a module class, or a tuple of them, to trace (default: every class).
        max_depth: the deepest module path traced: 0 is the model itself, 1 its children, ...
        stats: ``True`` (every statistic), ``False``, statistic names, or a ``Stats`` with its details.
        sample_every: trace every Nth outermost forward (in training: every Nth step).
        sample_ratio: trace this fraction of outermost forwards (in training: of steps, alike on every rank).
        backward: a span per module backward, with gradient statistics.
        optimizer: its ``step()`` is timed and closes each training step (one trace per step).
        training: a ``Training``: which steps are traced, parameter norms, a DDP comm hook of yours.
        metrics: ``True`` (Prometheus metrics on the global registry) or a ``MetricsSink``.
        sinks: callables receiving each batch of ``ModuleCall`` off the hot path.
        records: a ``Records``: what the in-memory records (``handle.records``) keep.
        limits: a ``Limits``: the export interval and how many calls may wait for export.
        baseline: a ``Baseline`` of this model, or its path, or a ``Drift`` with the window and threshold: each
            traced layer's statistics are scored against it (``handle.drift()``, the ``torchtrace_layer_drift``
            gauge, span attributes on drifted calls).

    Returns:
        The ``TraceHandle``: ``records``, ``summary()``, ``flush()``, ``remove()``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"instrument() expects a torch.nn.Module, got {type(model).__name__}")
    if model in _instrumented:
        raise ValueError(
            f"{type(model).__name__} is already instrumented: remove() the first handle before a new one "
            "(torchtrace.handle_of(model) gives it back)"
        )
    options = resolve_options(**{key: value for key, value in locals().items() if key != "model"})
    settings.current()  # a malformed TORCHTRACE_* setting raises here, not at a signal, in a hook or at remove()
    overlapping = _overlapping_model(model)
    if overlapping is not None:  # e.g. instrument(m), then instrument(DDP(m)): every call would be traced twice
        raise ValueError(
            f"{type(model).__name__} contains, or is part of, the instrumented {type(overlapping).__name__}: "
            "remove() that handle first (torchtrace.handle_of(model) gives it back)"
        )
    handle = TraceHandle(model, options)
    if metrics is None and env_text(ENV_METRICS) is None and not _publishes_metrics(handle):
        note_unmetered(handle)  # warns once if a metrics endpoint is being served: it will show nothing of this model
    return handle


def _publishes_metrics(handle: TraceHandle) -> bool:
    metrics = sys.modules.get("torchtrace._sinks.metrics")
    sinks = [handle.metrics, *handle.options.sinks]
    return metrics is not None and any(isinstance(sink, metrics.MetricsSink) for sink in sinks)


EXIT_DEADLINE_S = 5.0  # what delivery may add to an exit: inside the 10 s a container gets between SIGTERM and SIGKILL


def _remove_at_exit() -> None:
    """Deliver what is pending (and print the summary where asked) before the interpreter goes, within
    ``EXIT_DEADLINE_S`` in all: on a thread of its own (a daemon: one still waiting on a hung endpoint when the
    deadline passes does not hold the exit), the exporters' own timeouts bounding each request inside it."""
    handles = list(_live_handles)
    if not handles:
        return
    for handle in handles:  # here, on the thread a Ctrl-C interrupted: its open forward is this thread's state
        try:
            handle._recorder.close_interrupted()
        except Exception:
            _logger.exception("torchtrace: closing an interrupted forward at exit failed")

    def remove_all() -> None:
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                _logger.exception("torchtrace: delivering pending calls at exit failed")

    deadline_s = _signals.stop_time_left(EXIT_DEADLINE_S)  # after a SIGTERM's flush: what is left of its 5 s
    worker = threading.Thread(target=remove_all, name="torchtrace-exit", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        _logger.warning("torchtrace: at exit, spans not delivered within %.3gs are lost", deadline_s)


def _at_main_thread_end() -> None:
    """The main thread finished. With other (non-daemon) threads still running, a server's request threads, a
    training loop's workers, they keep tracing: removal waits for them, at exit, ahead of the atexit handlers
    registered before now (an SDK TracerProvider's shutdown). Else remove now."""
    current = threading.current_thread()
    running = [
        thread
        for thread in threading.enumerate()
        if thread.is_alive() and not thread.daemon and thread is not current and thread is not threading.main_thread()
    ]
    if running:
        atexit.register(_remove_at_exit)  # atexit runs last in first out: before handlers registered earlier
    else:
        _remove_at_exit()


try:
    # Runs when the main thread finishes, before any atexit handler: an SDK TracerProvider created after this
    # import (its atexit shutdown would run first) still receives the pending spans. concurrent.futures does the same.
    threading._register_atexit(_at_main_thread_end)
except (AttributeError, RuntimeError):
    atexit.register(_remove_at_exit)
