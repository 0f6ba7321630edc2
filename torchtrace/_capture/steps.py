"""Training steps: one trace per step holding its forwards, its backward and the optimizer step.

Backward timing uses tensor-level multi-grad hooks (as torch's ModuleTracker does), not full backward hooks,
which break on in-place modules: a module's backward starts when the first gradient reaches its outputs and ends
when the gradients of its inputs (or, for the first layer, of its own parameters) are computed. Autograd may run
these hooks on its own threads: they only append to the step's event list, never read the current OTel context.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from opentelemetry.trace import SpanContext, TraceFlags
from torch.autograd.graph import register_multi_grad_hook

from torchtrace._capture.device import ROW_POOL, DeviceWork, EventTimer, StatRows, completion_event
from torchtrace._capture.recorder import FEATURE_ERROR
from torchtrace._capture.stats import (
    device_stats,
    find_tensors,
    local_values,
    reduce_view,
    reduced_on_device,
)
from torchtrace._core.calls import error_text
from torchtrace._core.ranks import RankInfo, derived_id
from torchtrace._core.schedule import StepSchedule
from torchtrace.attributes import PARAM_GRAD_NORM, PARAM_NORM

MAX_COMM_RECORDS = 10_000  # all-reduce buckets kept per step

_BARE_OUTPUT = ("0",)  # the output names of a call that returned one tensor
GRAD_STATS = frozenset({"mean", "abs_max", "norm", "nan_count", "inf_count"})
NORM_ONLY = frozenset({"norm"})
BACKWARD_START, BACKWARD_END = 0, 1


class DetailDecision(Protocol):
    """Under ``rank_detail="auto"``: why this rank sends its module spans of a step (empty: it does not)."""

    def sent(self) -> bool:
        """Whether it can be read: this rank's facts of the step are on their way to the others (or it was made
        without them)."""
        ...

    def ready(self) -> bool:
        """Whether reading it now goes without waiting for the other ranks."""
        ...

    def __call__(self) -> tuple[str, ...]: ...


@dataclass(slots=True)
class StepRecord:
    """Everything one traced step produced, handed to the dispatcher at ``step()``."""

    number: int
    trace_id: int
    span_id: int
    start_ns: int  # epoch
    end_ns: int
    forwards: list  # RawForward, in completion order
    # ((forward, position), BACKWARD_START | BACKWARD_END, perf_counter_ns, grad stats by name, CUDA timing event
    #  or None, the user's function_on_grad_output / _input of the gradients, or None)
    backward_events: list
    optimizer_ns: tuple[int, int] | None  # perf_counter start/end of optimizer.step()
    clock_offset_ns: int
    param_stats: dict[tuple, dict[str, float]] = field(default_factory=dict)  # (forward, position) -> norms
    rank: RankInfo | None = None
    root_span_id: int = 0  # the step's root shared by all ranks (distributed), emitted by rank 0; else 0
    comm: list = field(default_factory=list)  # (bucket, bytes, perf start, perf end, is_last, (start, end events))
    device: DeviceWork | None = None  # gradient and parameter statistics, backward timing events, on the device
    grads_finite: bool = False  # every gradient summarised on the host with no NaN or Inf (False: not known)
    detail: DetailDecision | None = None  # rank_detail="auto": read when resolved

    def module_calls(self) -> int:
        """The module calls it holds, as the record buffer counts them: forward and backward (two gradient events
        each); its step and phase spans are not counted."""
        return sum(map(len, self.forwards)) + len(self.backward_events) // 2


class StepTracker:
    """The current step: its number, whether the schedule traces it, its ids, and what it collected."""

    def __init__(
        self,
        schedule: StepSchedule,
        *,
        backward: bool,
        param_stats: bool,
        rank: RankInfo | None = None,
        stats_sample: int | None = None,
        grad_stats: frozenset[str] = GRAD_STATS,
        model_key: str = "",
        on_grad_output: Callable[[Any], Any] | None = None,
        on_grad_input: Callable[[Any], Any] | None = None,
    ) -> None:
        self.on_grad_output = on_grad_output  # the user's functions of the gradients (spikingjelly's monitors)
        self.on_grad_input = on_grad_input
        self.schedule = schedule
        self.model_key = model_key  # the same on every rank: the model's class, numbered in instrumentation order
        self.backward = backward
        self.param_stats = param_stats
        self.stats_sample = stats_sample
        self.grad_stats = grad_stats  # of GRAD_STATS, those the options name: none under stats=False
        self.rank = rank
        self.number = 0
        self.closed_by_optimizer = False  # optimizer= closed the step and no forward ran since
        self._lock = threading.Lock()
        self._begin(0)

    def forget_after_fork(self) -> None:
        """In a forked child: the open step is the parent's (which delivers it); start this step afresh, under ids
        of the child's own (the parent's step N has the derived ids of step N)."""
        self._lock = threading.Lock()
        for handle in self.hook_handles:
            handle.remove()
        self.model_key = f"{self.model_key}@{os.getpid()}"
        self._begin(self.number)

    def _begin(self, number: int) -> None:
        self.number = number
        self.traced = bool(self.schedule(number))  # deterministic in the step number: every rank agrees
        rank = self.rank
        if rank is None:
            self.trace_id = random.getrandbits(128) or 1
            self.span_id = random.getrandbits(64) or 1
            self.root_span_id = 0
        else:  # every rank derives the same trace and root for step N, and its own span under that root
            key = (rank.run_id, self.model_key, number)  # two models trained in one job: two traces per step
            self.trace_id = derived_id(128, *key)
            self.root_span_id = derived_id(64, *key, "root")
            self.span_id = derived_id(64, *key, "rank", rank.rank)
        self.context = SpanContext(self.trace_id, self.span_id, is_remote=False, trace_flags=TraceFlags(1))
        self.start_ns = time.time_ns()
        self.clock_offset_ns = self.start_ns - time.perf_counter_ns()
        self.forwards: list = []
        self.pending_calls = 0  # calls in self.forwards: bounded by max_pending_calls like the buffer
        self.events: list = []
        self.hook_handles: list = []
        self.optimizer_ns: list[int] = []
        self.comm: list = []
        # ((forward, position), module) whose parameter norms are read at the step's end
        self.parameter_owners: list = []
        self._param_stats: dict[tuple, dict[str, Any]] = {}  # float, or statistics pending on a device
        self._rows: dict[torch.device, StatRows] = {}  # the step's statistics reduced on devices
        self.timer: EventTimer | None = None  # the CUDA timer of the step's forwards, if any
        # id(tensor) -> (weak reference to it, its _GradientHook): a tensor watched by two calls gets one hook
        self._tensor_hooks: dict[int, tuple[weakref.ref, _GradientHook]] = {}
        # (weak reference to the gradient, its version, its statistics): the last gradient summarised, which the
        # next hook on the same tensor (the consumer's, after the producer's) is given again
        self._last_gradient: tuple = (_dead_reference, 0, None)
        self.grads_finite = True  # no gradient summarised so far counted NaN or Inf, or could not be read yet

    # -- called from the forward hooks (only while this step is traced and backward tracing is on) ------------

    def watch_backward(
        self, call: tuple, module: torch.nn.Module, inputs: Any, output: Any, timer: EventTimer | None = None
    ) -> None:
        """Registers the grad hooks that time this call's backward and summarise its gradients; ``call`` is
        (forward, position).

        With a ``timer`` (CUDA), each hook also marks the stream with a timing event, on autograd's thread for
        that device: the backward span is then device time, read with the step's other device work.
        """
        if not torch.is_grad_enabled():
            return
        if type(output) is torch.Tensor:  # the usual layer's
            if not output.requires_grad:
                return
            outputs, names = None, _BARE_OUTPUT
        else:
            outputs = _named_outputs(output)
            if not outputs:
                return
            names = [name for name, _ in outputs]
        if timer is not None:
            self.timer = timer
        # One hook per tensor, each firing once: a leaf (a parameter, a leaf input) outlives this graph, and its
        # hook would fire again in a later backward (gradient accumulation, a second loss) and stretch this span.
        # The first gradient to arrive starts the span; each output's gradient is summarised under its forward
        # name, and an output that got none is called with None (or not at all) and left out.
        watch = _BackwardWatch(self, call, names, timer)
        if outputs is None:
            self._gradient_hook(output).callbacks.append(watch.received_only)
        elif len(outputs) == 1:
            self._gradient_hook(outputs[0][1]).callbacks.append(watch.received_only)
        else:
            for name, tensor in outputs:
                self._gradient_hook(tensor).callbacks.append(functools.partial(watch.received, name))
        if type(inputs) is tuple and len(inputs) == 1 and type(inputs[0]) is torch.Tensor:  # the usual layer
            sources = inputs if inputs[0].requires_grad else ()
        else:
            sources = [t for t in _tensors(inputs) if t.requires_grad]
        if not sources:  # the first layer: its backward ends when its own parameters have their gradients
            sources = _own_parameters(module)
        non_leaves = [t for t in sources if t.grad_fn is not None]
        if len(non_leaves) == 1:
            # the usual layer: its input is the output of the call before, whose hook fires at that same moment
            # and is shared (one hook, one summary of the gradient)
            self._gradient_hook(non_leaves[0]).callbacks.append(watch.finished)
        elif non_leaves:  # several inputs (attention's q, k, v; a residual sum): the span ends with the last one
            end = _GradientHook()
            end.callbacks.append(watch.finished)
            handle = register_multi_grad_hook(non_leaves, end)
            end.handles.append(handle)
            self.hook_handles.append(handle)
        else:
            # leaves only (the first layer's parameters, a leaf input): the first of their gradients ends the span
            # (a layer's parameter gradients come from one node, at once; waiting for all of them would wait
            # forever for one that takes none, and torch.autograd.grad computes only those asked for)
            for leaf in sources:
                self._gradient_hook(leaf).callbacks.append(watch.finished)
        if self.param_stats:
            self.parameter_owners.append((call, module))

    def _gradient_hook(self, tensor: torch.Tensor) -> _GradientHook:
        """The hook of ``tensor``'s gradient, registered at its first watcher (made once per tensor a step)."""
        kept = self._tensor_hooks.get(id(tensor))
        if kept is not None and kept[0]() is tensor and kept[1].handles:  # not fired yet (a later backward's)
            return kept[1]
        hook = _GradientHook()
        handle = hook.register(tensor)
        hook.handles.append(handle)
        self.hook_handles.append(handle)
        self._tensor_hooks[id(tensor)] = (weakref.ref(tensor), hook)
        return hook

    def record_comm(
        self, bucket: int, size: int, start: int, end: int, is_last: bool, marks: tuple = (None, None)
    ) -> None:
        """One gradient bucket's all-reduce (from DDP's comm hook; may run on a comm thread); ``marks``: its CUDA
        start and end events, if any."""
        if self.traced and len(self.comm) < MAX_COMM_RECORDS:  # a step never closed must not grow forever
            self.comm.append((bucket, size, start, end, is_last, marks))

    # -- optimizer hooks ----------------------------------------------------------------------------------------

    def optimizer_started(self) -> None:
        self.optimizer_ns = [time.perf_counter_ns()]
        if self.traced:
            self.read_parameter_stats()  # gradients complete, parameters not yet updated

    def optimizer_finished(self) -> None:
        if self.optimizer_ns:
            self.optimizer_ns.append(time.perf_counter_ns())

    def read_parameter_stats(self) -> None:
        for call, module in self.parameter_owners:
            params = list(module.parameters(recurse=False))
            grads = [p.grad for p in params if p.grad is not None]
            stats = self._param_stats.setdefault(call, {})
            if params:
                stats[PARAM_NORM] = self._joint_norm(params)
            if grads:
                stats[PARAM_GRAD_NORM] = self._joint_norm(grads)
        self.parameter_owners = []

    def device_rows(self, device: torch.device) -> StatRows:
        rows = self._rows.get(device)
        if rows is None:  # autograd threads of several devices may get here at once: setdefault is atomic
            rows = self._rows.setdefault(device, StatRows(device, ROW_POOL))
        return rows

    def _joint_norm(self, tensors: list[torch.Tensor]) -> float | dict:
        """L2 norm of all the tensors together, as torch.nn.utils.clip_grad_norm_ computes it (pending on a
        device: the norm of the per-tensor norms, read with the step's other device statistics)."""
        norms = torch.stack([torch.linalg.vector_norm(local_values(t.detach())) for t in tensors])
        if not reduced_on_device(norms):
            return float(torch.linalg.vector_norm(norms))
        stats: dict[str, Any] = {}
        device_stats(norms, self.device_rows(norms.device), NORM_ONLY, stats)
        return stats

    def _grad_stats(self, grads: Any, names: list[str] | None = None) -> dict[str, dict]:
        """Statistics of each gradient, by its position or, given ``names``, by its name."""
        summaries: dict[str, dict] = {}
        if not self.grad_stats:
            return summaries
        for index, grad in enumerate(grads):
            if grad is None or not grad.numel():  # an expert that got no tokens: nothing to summarise
                continue
            summaries[names[index] if names else str(index)] = self._gradient_stats(grad)
        return summaries

    def _gradient_stats(self, grad: torch.Tensor) -> dict[str, Any]:
        last_reference, last_version, last_stats = self._last_gradient
        version = grad._version
        if last_reference() is grad and last_version == version:
            return last_stats  # the consumer's input gradient, just summarised as its producer's output gradient
        stats: dict[str, Any] = {}
        try:
            values = grad if type(grad) is torch.Tensor else local_values(grad)  # a DTensor's: this rank's shard
            # an expanded gradient (of a sum(), a broadcast) read once, not materialised
            values = values.detach() if values.requires_grad else values
            reduce_view(values, self.grad_stats, stats, self.stats_sample, self.device_rows)
        except Exception as error:  # a statistic must never break the user's backward
            stats = {"stats_error": error_text(error)}
        if stats.get("nan_count") != 0 or stats.get("inf_count") != 0:  # or on a device, or failed: look closer
            self.grads_finite = False
        self._last_gradient = (weakref.ref(grad), version, stats)
        return stats

    # -- step boundary ------------------------------------------------------------------------------------------

    def finish(self) -> StepRecord | None:
        """Closes the current step and starts the next; the record of a traced step, else None."""
        with self._lock:
            if self.traced and self.parameter_owners:
                self.read_parameter_stats()
            for handle in self.hook_handles:
                handle.remove()  # leaf-parameter hooks would otherwise outlive the step
            record = None
            if self.traced and (self.forwards or self.events or self.optimizer_ns or self.comm):
                end_ns = time.time_ns()
                rows = list(self._rows.values())
                for device_rows in rows:
                    device_rows.seal()  # one copy per device per step
                record = StepRecord(
                    self.number,
                    self.trace_id,
                    self.span_id,
                    self.start_ns,
                    end_ns,
                    self.forwards,
                    self.events,
                    tuple(self.optimizer_ns) if len(self.optimizer_ns) == 2 else None,
                    self.clock_offset_ns,
                    self._param_stats,
                    self.rank,
                    self.root_span_id,
                    self.comm,
                    self._device_work(rows),
                    self.grads_finite,
                )
            self._begin(self.number + 1)
            return record

    def _device_work(self, rows: list[StatRows]) -> DeviceWork | None:
        if not rows and self.timer is None:
            return None
        work = DeviceWork(rows, self.timer)
        if self.timer is not None:
            last_marks = {
                event[4].device: event[4] for event in self.events if event[4] is not None
            }  # per device, in order
            work.done.extend(last_marks.values())
            work.done.extend(end for *_, (_, end) in self.comm if end is not None)  # recorded on side streams
            finished = completion_event(self.timer.device)  # after backward: autograd joined its streams
            if finished is not None:
                work.done.append(finished)
        return work


def _user_value(function: Callable[[Any], Any] | None, grads: Any, summaries: dict) -> Any:
    """``function(grads)`` (spikingjelly's function_on_grad_*); a failure is the span's ``stats_error``, never an
    exception in the user's backward."""
    if function is None:
        return None
    try:
        return function(grads)
    except Exception as error:
        summaries[FEATURE_ERROR] = {"stats_error": error_text(error)}
        return None


class _BackwardWatch:
    """One call's backward: started by the first gradient to reach its outputs (each output's gradient summarised
    under its forward name), ended by its inputs' gradients. Holds the outputs' names only: the step keeps its hooks
    until it closes, and a tensor held by its own hook's callbacks would outlive the backward that frees it (every
    micro-batch's outputs, under gradient accumulation)."""

    __slots__ = ("steps", "events", "call", "names", "timer", "grad_outputs", "started", "ended")

    def __init__(self, steps: StepTracker, call: tuple, names: Sequence[str], timer: EventTimer | None) -> None:
        self.steps = steps
        self.events = steps.events  # the step of the forward, whenever its backward runs
        self.call = call  # (forward, position)
        self.names = names
        self.timer = timer
        self.grad_outputs: dict[str, dict] = {}
        self.started = False  # a gradient arrived: the span started
        self.ended = False

    def received_only(self, now: int, grad: torch.Tensor | None) -> None:
        """The gradient of a call's one output."""
        self.received(self.names[0], now, grad)

    def received(self, name: str, now: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        grad_outputs = self.grad_outputs
        steps = self.steps
        if grad.numel() and steps.grad_stats:  # an expert that got no tokens: nothing to summarise
            # the statistics' kernels run before the mark: they are not the module's backward
            grad_outputs[name] = steps._gradient_stats(grad)
        names = self.names
        if len(names) > 1:  # in the forward's order, whatever order the gradients arrived in
            for other in names:
                if other in grad_outputs:
                    grad_outputs[other] = grad_outputs.pop(other)
        if self.started:
            return
        self.started = True
        value = _user_value(steps.on_grad_output, grad, grad_outputs) if steps.on_grad_output is not None else None
        mark = self.timer.mark() if self.timer is not None else None
        self.events.append((self.call, BACKWARD_START, now, grad_outputs, mark, value))

    def finished(self, now: int, grads: Any) -> None:
        """The gradients of the call's inputs (all of them, or the first of its leaves')."""
        if not self.started or self.ended:  # its outputs got no gradient: not this module's backward, but a shared
            return  # input's; or another leaf's gradient ended it
        self.ended = True
        steps = self.steps
        mark = self.timer.mark() if self.timer is not None else None  # before the statistics' kernels
        grads = [grads] if isinstance(grads, torch.Tensor) else grads
        stats = steps._grad_stats(grads)
        value = None
        if steps.on_grad_input is not None:
            value = _user_value(steps.on_grad_input, grads[0] if len(grads) == 1 else tuple(grads), stats)
        self.events.append((self.call, BACKWARD_END, now, stats, mark, value))


class _GradientHook:
    """A gradient hook that fires once and calls each watcher with the moment the gradient arrived: shared by the
    calls that watch one tensor (in a chain of layers, the one that made it, whose backward starts there, and the
    one that took it in, whose backward ends there), so a tensor costs one hook and one summary of its gradient."""

    __slots__ = ("callbacks", "handles", "_hooks")

    def __init__(self) -> None:
        self.callbacks: list[Callable[[int, Any], None]] = []
        self.handles: list = []  # what removes it (itself, or a RemovableHandle), until it fires
        self._hooks: dict | None = None  # the tensor's hook dict it is in, registered directly

    def register(self, tensor: torch.Tensor) -> Any:
        """Adds this hook to ``tensor``'s gradient hooks; returns what removes it.

        A plain tensor or parameter gets it as ``Tensor.register_hook`` adds one, minus the ``RemovableHandle``
        (its weak reference and id: 2.6 of a registration's 3.6 us, 18 a training step): the hook is its own key
        in the tensor's hook dict and removes itself. A tensor subclass may handle ``register_hook`` itself
        (``__torch_function__``): it gets the public call."""
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
            return tensor.register_hook(self)
        if not tensor.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        hooks = tensor._backward_hooks
        if hooks is None:
            hooks = tensor._backward_hooks = OrderedDict()
            if tensor.grad_fn is not None:
                tensor.grad_fn._register_hook_dict(tensor)
        hooks[self] = self
        self._hooks = hooks
        return self

    def remove(self) -> None:
        """Out of its tensor's hook dict (idempotent; the reference cycle between them is broken here)."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.pop(self, None)

    def __call__(self, grad: Any) -> None:
        now = time.perf_counter_ns()
        try:
            self.handles.pop().remove()
        except IndexError:  # fired already (another autograd thread, or a later backward before the removal)
            return
        for callback in self.callbacks:
            callback(now, grad)


def _own_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module.parameters(recurse=False)`` that take a gradient, read from its parameter dict (half the time of
    the generator behind ``parameters()``)."""
    return [p for p in dict.fromkeys(module._parameters.values()) if p is not None and p.requires_grad]


def _dead_reference() -> None:
    return None


def _named_outputs(output: Any) -> list[tuple[str, torch.Tensor]]:
    """The output tensors that take a gradient, by their forward names (a bare tensor is output "0")."""
    if isinstance(output, torch.Tensor):
        return [("0", output)] if output.requires_grad else []
    return [(name or "0", t) for name, t in find_tensors(output, limit=sys.maxsize)[0] if t.requires_grad]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a module's inputs or outputs, nested containers included (as the statistics see them)."""
    if type(value) is tuple and all(isinstance(item, torch.Tensor) for item in value):  # the usual positional args
        return list(value)
    return [tensor for _, tensor in find_tensors(value, limit=sys.maxsize)[0]]
