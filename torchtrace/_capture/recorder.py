"""The hot path: forward pre/post hooks that append timestamps and statistics to a per-thread list.

Nothing here creates OTel objects, takes a lock per call, updates a metric or waits for a device. Per call: two
clock reads (plus two pooled timing events on CUDA), a list append, a stack push/pop, and (when statistics are on)
a few torch reductions. Once per outermost forward: the sampling decision, the caller's span context, the forward's
columns resolved (CPU: ``resolve_forward``, a few C loops, while its values are in cache) and one append to the
record buffer.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry import trace

from torchtrace._capture.batched import StatBatch
from torchtrace._capture.buffer import RecordBuffer
from torchtrace._capture.device import DeviceWork, capturing_cuda_graph, event_timer
from torchtrace._capture.stats import StatComputer, StatTable, find_tensors
from torchtrace._capture.traced_forward import FORWARD_COLUMNS, TracedCallContext, class_forward, native_traced_call
from torchtrace._core import settings
from torchtrace._core.calls import error_text
from torchtrace._core.options import Options
from torchtrace._core.sampling import ForwardSampler

_logger = logging.getLogger(__name__)
_UNKNOWN = object()
# the frames of a module call (nn.Module.__call__ and what it calls): how a model's running call is found
_MODULE_CALL_CODES = frozenset((torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__))
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # a plain `return False` that dynamo folds to True
_compiler = torch.compiler
try:
    from torchtrace._native import bind_slots as _bind_slots
    from torchtrace._native import run_uncompiled as _run_uncompiled
except ImportError:  # not built: torch.compiler.disable
    _run_uncompiled = _bind_slots = None
_eval_frame = getattr(torch._C, "_dynamo", None) and getattr(torch._C._dynamo, "eval_frame", None)


def _call_uncompiled(hook: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    return _run_uncompiled(_eval_frame.set_eval_frame, hook, *args, **kwargs)


def _mark_uncompiled() -> bool:
    """Whether dynamo will treat ``_call_uncompiled`` as torch.compiler.disable's wrappers: its attribute makes the
    tracer break the graph at a call of it, without a warning; its code's frames are never compiled (the C
    module's own skip list, which torch._dynamo.skip_code writes)."""
    try:
        strategy = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.DEFAULT)
        _eval_frame.set_code_exec_strategy(_call_uncompiled.__code__, strategy)
    except Exception:  # AttributeError, TypeError: a torch without them (the wrapper is then not used)
        return False
    _call_uncompiled._torchdynamo_disable = True  # type: ignore[attr-defined]
    return True


_UNCOMPILED = _run_uncompiled is not None and _eval_frame is not None and _mark_uncompiled()


def outside_compiled_regions(hook: Callable[..., None]) -> Callable[..., None]:
    """The model's own hook, run eagerly where torch.compile'd code calls the model: dynamo breaks its graph around
    the call (so a compiled model keeps its outermost span: region-level tracing), and no frame of the hook is
    compiled. What torch.compiler.disable does, without importing torch._dynamo (~1-2.6 s) into a process that
    never compiles: ``_native.run_uncompiled`` calls the hook with dynamo's frame callback off."""
    if not _UNCOMPILED:
        return torch.compiler.disable(hook)
    return functools.partial(_call_uncompiled, hook)


class SummaryMarker:
    """A key among a call's tensor summaries (keyed by tensor name, i.e. str(key) of an output) that no output can
    collide with; its value's items become ``<prefix>.<item>`` attributes."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


TRUNCATED = SummaryMarker("truncated")  # more tensors than max_tensors: {"truncated": True}
FEATURE_ERROR = SummaryMarker("feature error")  # a feature failed on this call: {"stats_error": text}

# Slots of a call's extras (``RawForward.extras[position]``, a list made only for a call that has one: an error, a
# non-tensor output's summaries, a user function's value...).
(OUTPUTS, INPUTS, ERROR, OUTPUT_VALUE, INPUT_VALUE, ATTRIBUTES, TENSORS) = range(7)  # fmt: skip
_EXTRAS = 7


@dataclass(slots=True, frozen=True)
class ModuleInfo:
    """What is known of a module before any call: computed once at instrument()."""

    path: str
    type_name: str
    depth: int


@dataclass(slots=True, eq=False)
class RawForward:
    """One outermost forward as the hot path leaves it: a few columns, one value per call in start order, and
    what few calls have besides. A call adds no object of its own for the garbage collector to track (a list per
    call, kept until the worker resolved it, was promoted to the oldest generation by the thousand per second)."""

    context: Any  # the caller's OTel SpanContext (may be invalid)
    thread_id: int
    clock_offset_ns: int  # epoch ns = perf_counter ns + offset
    module: list[int] = field(default_factory=list)  # index into the instrumentation's modules
    start: list[int] = field(default_factory=list)  # perf_counter ns
    end: list[int | None] = field(default_factory=list)  # None: still open
    parent: list[int] = field(default_factory=list)  # position of the parent call, -1 for the root
    output_stats: dict[int, dict] = field(default_factory=dict)  # position -> a bare tensor output's statistics
    extras: dict[int, list] = field(default_factory=dict)  # position -> [OUTPUTS, INPUTS, ERROR, ...]
    # position -> the timing events of a call timed on the device (most calls of a CUDA forward: kept apart from
    # the extras, so that a timed call with nothing else has none)
    start_events: dict[int, Any] = field(default_factory=dict)
    end_events: dict[int, Any] = field(default_factory=dict)
    device: DeviceWork | None = None  # timing events and statistics rows still on the device
    in_step: bool = False  # part of a training step (delivered with it); else a trace of its own
    all_finite: bool = False  # True: no NaN or Inf in any statistic (nothing to look for), False: not known
    stat_table: StatTable | None = None  # the statistics of its small CPU tensors, a row each
    # the read of its timing events' offsets off the model's thread (the compiled module's EventRead, handed over by
    # the pipeline's device_times; None: read where the forward is resolved). The hot path never touches it.
    event_offsets: Any = None
    columns: tuple = field(init=False, repr=False)  # the compiled traced call's columns, in FORWARD_COLUMNS order

    def __post_init__(self) -> None:
        self.columns = tuple(getattr(self, name) for name in FORWARD_COLUMNS)

    def extra(self, position: int, slot: int) -> Any:
        extras = self.extras.get(position)
        return None if extras is None else extras[slot]

    def set_extra(self, position: int, slot: int, value: Any) -> None:
        extras = self.extras.get(position)
        if extras is None:
            extras = self.extras[position] = [None] * _EXTRAS
        extras[slot] = value

    def interrupt(self, position: int, end: int) -> None:
        """An open call ends at ``end``, interrupted (by an exception torch showed no always_call hook)."""
        self.end[position] = end
        self.set_extra(position, ERROR, "interrupted")

    def output_summaries(self, position: int) -> dict[str, dict] | None:
        """A call's output tensor summaries, {name: stats}, whichever column holds them."""
        stats = self.output_stats.get(position)
        outputs = self.extra(position, OUTPUTS)
        if stats is None:
            return outputs
        return {"": stats, **outputs} if outputs else {"": stats}

    def __len__(self) -> int:
        return len(self.module)


class _ThreadState:
    """What the hooks of one instrumentation keep per thread (plain slots: read many times per call)."""

    __slots__ = ("stats", "stack", "forward", "skip_depth", "skip_root", "root_frame", "timer")  # fmt: skip

    def __init__(self, options: Options, steps: Any) -> None:
        # per thread: it batches per forward; in training, device statistics share the step's rows
        stats = options.stats
        batch = StatBatch(stats.batch, int(stats.batch_mb * 2**20)) if stats.batch > 1 else None
        self.stats = StatComputer(stats.names, stats.extra, steps.device_rows if steps else None, stats.sample, batch)
        self.stack: list[int] = []  # positions of the open calls, innermost last
        self.forward: RawForward | None = None  # the forward being recorded
        self.skip_depth = 0  # > 0 inside a forward that is not traced
        self.skip_root = -1  # the outermost module of that forward
        self.root_frame: Any = None  # frame of the outermost call: tells recursion from an interrupted forward
        self.timer: Any = None  # the EventTimer of the current forward's device (CUDA), else None


if _bind_slots is not None:  # the compiled hot path reads and writes its slots by offset
    _bind_slots(_ThreadState, "state")


class HookRecorder:
    """Owns the hook functions of one instrumentation and the per-thread state they share."""

    def __init__(
        self,
        modules: list[ModuleInfo],
        options: Options,
        buffer: RecordBuffer,
        steps: Any = None,
        resolve: Callable[[RawForward, list[ModuleInfo]], Any] | None = None,
    ) -> None:
        self.modules = modules
        self.options = options
        self.cuda_events = settings.current().cuda_events  # process-wide, fixed for this handle's life
        self.buffer = buffer
        # What a finished forward with nothing left on a device becomes before it is buffered (its columns, ids and
        # attributes: ``resolve_forward``), here, while its values are in this core's cache: on the worker, on the
        # other core and the GIL handed over and back, the same work cost several times as much (the cheap model of
        # benchmarks/overhead.py, with statistics). None: the worker resolves it.
        self._resolve = resolve
        # called with what a forward became at its end; True: it was delivered there (see Dispatcher), else buffered
        self.deliver: Callable[[Any], bool] | None = None
        self.enabled = True
        self.sampler = ForwardSampler(options.sample_every, options.sample_ratio)
        self.summarise = bool(options.stats.names or options.stats.extra)
        # what each call does with its output and inputs beyond timing, chosen once: every feature fails alone
        records = options.records
        self._output_work = tuple(
            work
            for work, wanted in (
                (self._output_stats, self.summarise),
                (self._output_value, records.function_on_output is not None),
                (self._output_attributes, bool(records.module_attributes) and not records.attributes_before_forward),
                (self._output_capture, records.capture_tensors),
                (self._output_backward, steps is not None and steps.backward),
            )
            if wanted
        )
        self._input_work = tuple(
            work
            for work, wanted in (
                (self._input_stats, options.stats.inputs and self.summarise),
                (self._input_value, records.function_on_input is not None),
                (self._attributes_before, bool(records.module_attributes) and records.attributes_before_forward),
            )
            if wanted
        )
        self.captured_bytes = 0
        self.skipped_captures = 0
        self.steps = steps  # a StepTracker when forwards belong to training steps
        self.model_ref: Any = None  # the model's traced root, weakly (set by its handle; None if it is not traced)
        self.warned_compiled = False
        self.warned_no_backward = False
        self._first_parameter: dict[int, Any] = {}  # module index -> its first own Parameter, or None
        self._local = threading.local()  # .state: this thread's _ThreadState
        self._open: dict[int, _ThreadState] = {}  # thread id -> its state, while a traced forward is open there

    def _thread_state(self) -> _ThreadState:
        try:
            return self._local.state
        except AttributeError:
            state = self._local.state = _ThreadState(self.options, self.steps)
            return state

    # -- hook factories -------------------------------------------------------------------------------------------

    def forward_pre_hook(self, index: int):
        local = self._local
        thread_state = self._thread_state
        perf_counter_ns = time.perf_counter_ns
        exc_info = sys.exc_info
        input_work = self._input_work

        def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
            if _dynamo_compiling() or _compiler._is_compiling_flag:  # constant-folded by dynamo: a compiled
                return  # region contains no hook work (docs/training.md); the flag: torch.export's non-strict tracing
            try:
                state = local.state
            except AttributeError:
                state = thread_state()
            if state.skip_depth:
                if index != state.skip_root or _on_call_stack(state.root_frame):
                    state.skip_depth += 1
                    return
                state.skip_depth = 0  # the skipped forward never finished: see _close_interrupted
            stack = state.stack
            if stack and state.forward.module[stack[0]] == index and not _on_call_stack(state.root_frame):
                self._close_interrupted(state)
            if not stack and not self._begin_forward(state, index, module, args):
                return
            forward = state.forward
            position = len(forward.module)
            forward.module.append(index)
            forward.parent.append(stack[-1] if stack else -1)
            forward.start.append(0)
            forward.end.append(None)
            handled = exc_info()[1]  # the exception the caller is handling, if any: a None output seen with it
            if handled is not None:  # still current is no error of this call (post_hook)
                forward.set_extra(position, ERROR, handled)
            if input_work:
                _run_work(input_work, INPUTS, forward, position, module, args, kwargs)
            stack.append(position)
            timer = state.timer  # the root always marks: its events are the forward's origin and completion
            if timer is not None:
                if len(stack) == 1:
                    mark_start(timer, forward, position)
                else:
                    self._mark_start(index, module, args, timer, forward, position)
            forward.start[position] = perf_counter_ns()  # last: the span times the module, not our bookkeeping

        # The model's own hooks run outside a compiled region (dynamo graph-breaks around them), so a compiled
        # model still gets its outermost span: region-level tracing, announced once by warn_region_level.
        return outside_compiled_regions(pre_hook) if self.modules[index].path == "" else pre_hook

    def traced_forward(self, index: int) -> tuple[Callable[..., Any], tuple | None]:
        """The body of module ``index``'s ``TracedForward`` (see ``traced_forward``) and its context: called as
        ``body(context, module_ref, function, *args, **kwargs)``. Inside a traced forward it records the call
        itself, in one call; outside one (the module called on its own, or the model's root not selected) it runs
        the hook functions, which begin and end forwards. With the compiled module the body is
        ``_native.traced_call``, which records the common call in C and hands the rest to the Python body in its
        context; else the Python body (context None). Dynamo inlines the Python body either way
        (``TracedForward.func``)."""
        local = self._local
        perf_counter_ns = time.perf_counter_ns
        input_work = self._input_work
        output_work = self._output_work
        # the default work on an output, its statistics alone: a tensor's taken here, without _run_work's loop and
        # two calls (~0.15 us a call); anything else through the work itself
        output_stats = self._output_stats if output_work == (self._output_stats,) else None
        pre, post = self.forward_pre_hook(index), self.forward_post_hook(index)
        mark_call_start = self._mark_start

        def call(context: Any, module_ref: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
            module = module_ref()
            if module is None:
                raise _freed_module_error(function)
            if type(module).forward is not function:  # the class's forward was replaced since: call that one
                function = class_forward(module)
            if _dynamo_compiling() or _compiler._is_compiling_flag:
                return function(module, *args, **kwargs)
            try:
                state = local.state
            except AttributeError:
                return _through_hooks(pre, post, module, function, args, kwargs)
            stack = state.stack
            if not stack or state.skip_depth:
                if state.skip_depth:  # inside a forward that is not traced
                    return function(module, *args, **kwargs)
                return _through_hooks(pre, post, module, function, args, kwargs)
            forward = state.forward
            starts, ends = forward.start, forward.end
            position = len(starts)
            forward.module.append(index)
            forward.parent.append(stack[-1])
            starts.append(0)
            ends.append(None)
            if input_work:
                _run_work(input_work, INPUTS, forward, position, module, args, kwargs)
            stack.append(position)
            timer = state.timer
            if timer is not None:
                mark_call_start(index, module, args, timer, forward, position)
            starts[position] = perf_counter_ns()  # last: the span times the module, not our bookkeeping
            try:
                output = function(module, *args, **kwargs)
            except BaseException as error:
                call_failed(state, forward, position, perf_counter_ns(), error, module, args, output_work)
                raise
            end = perf_counter_ns()
            if stack and stack[-1] == position and state.forward is forward:
                stack.pop()
            else:
                _pop_to(state, forward, position, end)
            ends[position] = end
            if timer is not None:
                mark_end(state, forward, position)
            if output_stats is not None:
                try:
                    if isinstance(output, torch.Tensor):
                        forward.output_stats[position] = state.stats(output)
                    else:
                        output_stats(forward, position, module, args, output)
                except Exception as error:
                    _note_error(forward, position, OUTPUTS, error)
            elif output_work:
                _run_work(output_work, OUTPUTS, forward, position, module, args, output)
            return output

        native = native_traced_call()
        if native is None or input_work:
            return call, None
        context = TracedCallContext(
            index=index, local=local, slow=call, tensor=torch.Tensor, output_stats=output_stats,
            output_work=output_work, run_work=_run_work, call_failed=call_failed, pop_to=_pop_to,
            note_error=_note_error, compiler=_compiler, clock=perf_counter_ns, outputs_slot=OUTPUTS,
            mark_start=mark_call_start, first_parameter=self._first_parameter,
            max_tensors=self.options.stats.max_tensors,
        )  # fmt: skip
        return native, context

    def traced_compiled_call(self, index: int) -> Callable[..., Any]:
        """The body of module ``index``'s ``TracedCompiledCall`` (a module compiled with ``module.compile()``):
        ``body(module_ref, compiled, *args, **kwargs)``. torch calls it eagerly, before the compiled code: it records
        the call as ``traced_forward``'s Python body does, around ``compiled`` (the modules inside it are not
        traced: the compiled code runs them). Not the hot path of uncompiled models: each call of a compiled module
        costs dynamo's guards first."""
        local = self._local
        perf_counter_ns = time.perf_counter_ns
        input_work = self._input_work
        output_work = self._output_work
        pre, post = self.forward_pre_hook(index), self.forward_post_hook(index)
        mark_call_start = self._mark_start

        def call(module_ref: Any, compiled: Any, *args: Any, **kwargs: Any) -> Any:
            if _dynamo_compiling() or _compiler._is_compiling_flag:  # a compiled model calling it: dynamo inlines
                return compiled(*args, **kwargs)
            module = module_ref()
            if module is None:  # torch's compiled call holds its module: only a call kept apart from it
                return compiled(*args, **kwargs)
            try:
                state = local.state
            except AttributeError:
                state = None
            if state is None or not state.stack:  # no traced forward open here: this call begins one
                return _through_hooks(pre, post, module, _CallCompiled(compiled), args, kwargs)
            if state.skip_depth:  # inside a forward that is not traced
                return compiled(*args, **kwargs)
            forward, stack = state.forward, state.stack
            position = len(forward.start)
            forward.module.append(index)
            forward.parent.append(stack[-1])
            forward.start.append(0)
            forward.end.append(None)
            if input_work:
                _run_work(input_work, INPUTS, forward, position, module, args, kwargs)
            stack.append(position)
            if state.timer is not None:
                mark_call_start(index, module, args, state.timer, forward, position)
            forward.start[position] = perf_counter_ns()
            try:
                output = compiled(*args, **kwargs)
            except BaseException as error:
                call_failed(state, forward, position, perf_counter_ns(), error, module, args, output_work)
                raise
            end = perf_counter_ns()
            _pop_to(state, forward, position, end)
            forward.end[position] = end
            if state.timer is not None:
                mark_end(state, forward, position)
            if output_work:
                _run_work(output_work, OUTPUTS, forward, position, module, args, output)
            return output

        return call

    def forward_post_hook(self, index: int):
        local = self._local
        thread_state = self._thread_state
        perf_counter_ns = time.perf_counter_ns
        output_work = self._output_work

        def post_hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if _dynamo_compiling() or _compiler._is_compiling_flag:
                return
            end = perf_counter_ns()  # first: the span times the module, not our bookkeeping
            try:
                state = local.state
            except AttributeError:
                state = thread_state()
            if state.skip_depth:
                state.skip_depth -= 1
                if not state.skip_depth:
                    state.root_frame = None  # torch's frame holds the call's inputs, output and model
                return
            stack = state.stack
            if not stack:  # enabled in the middle of a forward: nothing open to close
                return
            forward = state.forward
            modules = forward.module
            if modules[stack[-1]] != index and all(modules[open_call] != index for open_call in stack):
                return  # never opened: a pre-hook registered before ours raised (torch still runs always_call hooks)
            position = stack.pop()
            while modules[position] != index and stack:
                # An exception that torch does not pass to always_call hooks (BaseException) skipped these closes.
                forward.interrupt(position, end)
                position = stack.pop()
            forward.end[position] = end
            if state.timer is not None:
                mark_end(state, forward, position)
            if output is None:
                # always_call hooks run from torch's `except Exception:` block: the exception is still current.
                # One the caller was already handling before the call (pre hook) is not this call's error.
                error = sys.exc_info()[1]
                error = None if error is forward.extra(position, ERROR) else _call_error(error)
            else:
                error = None
            if error is not None or position in forward.extras:
                forward.set_extra(position, ERROR, error)
            if output_work:
                _run_work(output_work, OUTPUTS, forward, position, module, args, output)
            if not stack:
                self._end_forward(state)

        return outside_compiled_regions(post_hook) if self.modules[index].path == "" else post_hook

    # -- per forward ---------------------------------------------------------------------------------------------

    def _mark_start(
        self, index: int, module: torch.nn.Module, args: tuple, timer: Any, forward: RawForward, position: int
    ) -> None:
        """A timed call's start event (``mark_end`` closes it), where the call runs on the timer's device: a model
        split over GPUs has calls elsewhere, which keep host times rather than events on another device's stream.
        Its own first parameter says, else its first tensor argument; a module with neither is taken to run there."""
        parameter = self._first_parameter.get(index, _UNKNOWN)
        if parameter is _UNKNOWN:  # looked up once: .to() keeps the Parameter objects, only their data moves
            parameter = self._first_parameter[index] = next(module.parameters(recurse=False), None)
        if parameter is None:
            parameter = _first_tensor_argument(args)
        if parameter is None or parameter.device == timer.device:
            event = timer.mark()
            if event is not None:
                forward.start_events[position] = event

    def _begin_forward(self, state: _ThreadState, index: int, module: torch.nn.Module, args: tuple) -> bool:
        state.root_frame = _torch_call_frame()
        # in training, a forward with gradients off (an evaluation between steps: no_grad, inference_mode) is not
        # part of a step: a trace of its own, as outside training
        in_step = self.steps is not None and torch.is_grad_enabled()
        parent = self._parent_if_traced(in_step) if self.enabled and not _inside_tracer_or_backward() else None
        root = self.modules[index]
        if parent is not None and root.path and self._inside_unseen_model_call():
            parent = None  # part of a forward of the model that began before instrument(): untraced, as a whole
        if parent is not None and not self.warned_compiled and root.path == "" and called_from_compiled_code():
            self.warned_compiled = True
            warn_region_level(root.type_name)
        device = _device_of(module, args) if parent is not None else None
        if parent is None or (device is not None and device.type == "cuda" and capturing_cuda_graph()):
            # Not traced; or being captured into a CUDA graph, where timing events are not allowed and statistics
            # kernels would be replayed into rows long since read: graph capture and replay are not traced.
            state.skip_depth = 1
            state.skip_root = index
            return False
        thread = threading.get_ident()
        state.forward = RawForward(parent, thread, time.time_ns() - time.perf_counter_ns())
        self._open[thread] = state
        state.forward.in_step = state.stats.in_step = in_step
        state.stats.inference_mode = torch.is_inference_mode_enabled()
        state.timer = event_timer(device) if self.cuda_events else None
        return True

    def _inside_unseen_model_call(self) -> bool:
        """Whether the model's traced root is running on this thread while no traced forward is open here: a
        forward of it that began before its hooks were in place (``instrument()`` on another thread while it ran).
        A submodule it calls then is part of that forward, not a forward of its own (its spans would be orphans in
        traces of their own). Where the root is not traced (``include`` / ``types`` leave it out), its submodules
        begin forwards of their own, as always. Walks the stack: only for a submodule beginning a forward."""
        model = self.model_ref() if self.model_ref is not None else None
        if model is None:
            return False
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in _MODULE_CALL_CODES and frame.f_locals.get("self") is model:
                return True
            frame = frame.f_back
        return False

    def _parent_if_traced(self, in_step: bool) -> Any:
        """The span context this forward's root goes under (``in_step``: the training step's), or None when it is
        not traced."""
        steps = self.steps
        if in_step:
            steps.closed_by_optimizer = False  # a forward of the next iteration: handle.step() closes again
            return steps.context if steps.traced else None  # the step's schedule decides
        parent = trace.get_current_span().get_span_context()
        if parent.is_valid and not parent.trace_flags.sampled:
            return None  # the caller's trace is not sampled: neither are we (ParentBased)
        return parent if self.sampler.should_trace() else None

    def forward_running(self) -> bool:
        """Whether a traced forward is open on any thread now."""
        return bool(self._open)

    def running_elsewhere(self) -> int:
        """How many traced forwards other live threads have open now (one interrupted there, rare, counts until that
        thread calls the model again)."""
        here, alive = threading.get_ident(), {thread.ident for thread in threading.enumerate()}
        return sum(thread != here and thread in alive for thread in list(self._open))

    def close_interrupted(self) -> None:
        """At flush / remove / exit: close this thread's open forward if it no longer runs (see
        ``_close_interrupted``); a Ctrl-C lands on the main thread, where these are called."""
        state = getattr(self._local, "state", None)
        if state is None or state.root_frame is None or _on_call_stack(state.root_frame):
            return  # nothing open, or called from inside the forward (a hook, the model's own code)
        if state.skip_depth:  # an untraced forward that was interrupted: nothing to deliver, its frame is let go
            state.skip_depth = 0
            state.root_frame = None
        elif state.stack:
            self._close_interrupted(state)

    def _close_interrupted(self, state: _ThreadState) -> None:
        """The open forward is no longer running (its outermost module is called again, or flush / remove / exit).

        Torch runs always_call hooks only for ``Exception``; a KeyboardInterrupt (a notebook's stop button) leaves
        the forward open forever: close it as interrupted and deliver it. Its open calls end at the last moment the
        hooks saw the forward (its latest start or end): when it really stopped is not known, and no earlier.
        """
        forward = state.forward
        end = max(max(filter(None, forward.end), default=0), max(forward.start))
        for position in state.stack:
            forward.interrupt(position, end)
        mark_end(state, forward, 0)  # the forward's events are read once its end event completes
        state.stack.clear()
        self._end_forward(state)

    def _end_forward(self, state: _ThreadState) -> None:
        forward = state.forward
        state.forward = None
        state.root_frame = None
        self._open.pop(forward.thread_id, None)
        rows, forward.all_finite, forward.stat_table = state.stats.finish_forward()
        if rows or state.timer is not None:
            forward.device = DeviceWork(rows, state.timer)
            if state.timer is not None and 0 in forward.end_events:
                forward.device.done.append(forward.end_events[0])
        calls = len(forward.module)
        steps = self.steps
        if forward.in_step:  # delivered with its step, after the step's root span
            if state.timer is not None:
                steps.timer = state.timer  # the step's backward and all-reduce marks use it too
            if steps.pending_calls + calls > self.options.limits.max_pending_calls:
                self.buffer.drop(
                    calls,
                    "a training step holds more than max_pending_calls calls (never closed? call "
                    "handle.step() each step; else raise Limits(max_pending_calls=))",
                )
            else:
                steps.forwards.append(forward)
                steps.pending_calls += calls
        else:
            item = self._resolved(forward)
            if self.deliver is None or not self.deliver(item):
                self.buffer.put(item, calls)

    def _resolved(self, forward: RawForward) -> Any:
        if self._resolve is None or forward.device is not None:
            return forward  # device work still running: the worker reads it once complete
        try:
            return self._resolve(forward, self.modules)
        except Exception:  # never the user's forward's error: the worker tries again, and logs what fails
            return forward

    # -- what a call records --------------------------------------------------------------------------------------

    # Each takes (forward, position, module, args, inputs or output) and writes the call's column or extras slot.

    def _input_stats(self, forward: RawForward, position: int, module: Any, args: tuple, kwargs: Any) -> None:
        value: Any = args if not kwargs else {**{str(i): a for i, a in enumerate(args)}, **kwargs}
        forward.set_extra(position, INPUTS, self._summarise_value(value))

    def _input_value(self, forward: RawForward, position: int, module: Any, args: tuple, kwargs: Any) -> None:
        forward.set_extra(
            position, INPUT_VALUE, self.options.records.function_on_input(args[0] if len(args) == 1 else args)
        )

    def _attributes_before(self, forward: RawForward, position: int, module: Any, args: tuple, kwargs: Any) -> None:
        forward.set_extra(position, ATTRIBUTES, self._attribute_values(module))

    def _output_stats(self, forward: RawForward, position: int, module: Any, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            forward.output_stats[position] = self._local.state.stats(output)
        elif output is not None:  # None: a call that raised (always_call hooks)
            forward.set_extra(position, OUTPUTS, self._summarise_value(output))

    def _output_value(self, forward: RawForward, position: int, module: Any, args: tuple, output: Any) -> None:
        if output is not None:
            forward.set_extra(position, OUTPUT_VALUE, self.options.records.function_on_output(output))

    def _output_attributes(self, forward: RawForward, position: int, module: Any, args: tuple, output: Any) -> None:
        forward.set_extra(position, ATTRIBUTES, self._attribute_values(module))

    def _attribute_values(self, module: torch.nn.Module) -> dict[str, Any]:
        """The module attributes asked for: ``function_on_attribute(value)`` when given (the live value, kept as
        the function returns it), else numbers as they are, tensors copied (one element: a number)."""
        function = self.options.records.function_on_attribute
        if function is not None:
            return {name: function(getattr(module, name, None)) for name in self.options.records.module_attributes}
        return {name: self._attribute_value(module, name) for name in self.options.records.module_attributes}

    def _attribute_value(self, module: torch.nn.Module, name: str) -> Any:
        value = getattr(module, name, None)
        if not isinstance(value, torch.Tensor):
            return value
        return value.item() if value.numel() == 1 else self._copy_within_budget(value)

    def _copy_within_budget(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A CPU copy, counted against ``capture_max_bytes`` (None, and counted as skipped, past it)."""
        size = tensor.numel() * tensor.element_size()
        if self.captured_bytes + size > self.options.records.capture_max_bytes:
            self.skipped_captures += 1
            return None
        self.captured_bytes += size
        return tensor.detach().to("cpu", copy=True)

    def _output_capture(self, forward: RawForward, position: int, module: Any, args: tuple, output: Any) -> None:
        if output is not None:
            forward.set_extra(position, TENSORS, self._capture(output))

    def _output_backward(self, forward: RawForward, position: int, module: Any, args: tuple, output: Any) -> None:
        if self.steps.pending_calls >= self.options.limits.max_pending_calls:
            return  # a step that is never closed: its forwards are dropped, so are their backward hooks
        if forward.in_step and not torch.is_grad_enabled():
            self._warn_no_backward(forward.module[position])
            return
        on_timer = position in forward.start_events  # on the timer's device only
        timer = self._local.state.timer if on_timer else None
        self.steps.watch_backward((forward, position), module, args, output, timer)

    def _warn_no_backward(self, index: int) -> None:
        """A module of a training forward ran with gradients off: its backward (if any) runs where no hook of ours
        sees it, so it gets no backward span. Said once."""
        if self.warned_no_backward:
            return
        self.warned_no_backward = True
        _logger.warning(
            "torchtrace: %s ran with gradients off inside a training forward, so its backward is not traced: "
            "torch.utils.checkpoint with use_reentrant=True runs the checkpointed modules so, and again inside "
            "backward; use_reentrant=False keeps their backward spans",
            self.modules[index].path or self.modules[index].type_name,
        )

    def _summarise_value(self, value: Any) -> dict[str, dict]:
        tensors, truncated = find_tensors(value, self.options.stats.max_tensors)
        summarise = self._thread_state().stats
        summaries = {name: summarise(tensor) for name, tensor in tensors}
        if truncated:
            summaries[TRUNCATED] = {"truncated": True}
        return summaries

    def release_capture(self, call: Any) -> None:
        """A record left the records: its captured tensors (outputs, module attributes) no longer count against
        ``capture_max_bytes``."""
        for value in [*(call.tensors or {}).values(), *(call.module_attributes or {}).values()]:
            if isinstance(value, (torch.Tensor, CompressedTensor)):
                self.captured_bytes -= value.nbytes

    def _capture(self, output: Any) -> dict[str, Any]:
        captured: dict[str, Any] = {}
        for name, tensor in find_tensors(output, self.options.stats.max_tensors)[0]:
            copy = self._copy_within_budget(tensor)
            if copy is not None:
                captured[name] = CompressedTensor.of(copy) if self.options.records.capture_compress else copy
        return captured


def _freed_module_error(function: Any) -> ReferenceError:
    """A traced forward kept (``f = module.forward``) and called after its module was freed: it holds the module weakly
    (a model dropped is freed at once), where an untraced bound method keeps it alive."""
    return ReferenceError(
        f"torchtrace: {function.__qualname__} was called after its module was freed (a traced module's forward "
        "holds its module weakly): keep a reference to the module itself"
    )


def _through_hooks(pre: Any, post: Any, module: torch.nn.Module, function: Any, args: tuple, kwargs: dict) -> Any:
    """A traced module's forward outside a traced forward: the hook functions begin and end one (always_call: post
    runs on any exception, KeyboardInterrupt included, which torch's own always_call hooks do not see)."""
    pre(module, args, kwargs)
    try:
        output = function(module, *args, **kwargs)
    except BaseException:
        post(module, args, None)
        raise
    post(module, args, output)
    return output


class _CallCompiled:
    """A compiled call (it takes no module) where ``_through_hooks`` calls ``function(module, *args, **kwargs)``."""

    __slots__ = ("compiled",)

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    def __call__(self, _module: Any, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def mark_start(timer: Any, forward: RawForward, position: int) -> None:
    """A call's start event (none where it cannot be recorded: the call keeps its host times)."""
    event = timer.mark()
    if event is not None:
        forward.start_events[position] = event


def mark_end(state: _ThreadState, forward: RawForward, position: int) -> None:
    """A timed call's end event, after its work was launched and before its statistics' kernels (not its work)."""
    if position in forward.start_events:
        event = state.timer.mark()
        if event is not None:
            forward.end_events[position] = event


def call_failed(
    state: _ThreadState,
    forward: RawForward,
    position: int,
    end: int,
    error: BaseException,
    module: Any,
    args: tuple,
    output_work: tuple,
) -> None:
    """A traced call raised at ``end``: it ends there with the error (an interrupt: "interrupted"), its output's
    features see no output; the caller re-raises the error."""
    _pop_to(state, forward, position, end)
    forward.end[position] = end
    forward.set_extra(position, ERROR, _call_error(error))
    mark_end(state, forward, position)
    if output_work:
        _run_work(output_work, OUTPUTS, forward, position, module, args, None)


def _pop_to(state: _ThreadState, forward: RawForward, position: int, end: int) -> None:
    """Pops a finished call off the stack. Calls above it still open were left so by an exception that torch runs
    no always_call hook for (the root's hooks, re-entered inside it): they end here, interrupted. A call no longer
    on the stack (its forward closed from outside) leaves the stack alone."""
    stack = state.stack
    if state.forward is not forward or position not in stack:
        return
    while stack:
        top = stack.pop()
        if top == position:
            return
        forward.interrupt(top, end)


def _run_work(
    works: tuple, slot: int, forward: RawForward, position: int, module: Any, args: tuple, value: Any
) -> None:
    """A call's features (statistics, user functions, attributes, captures) on its inputs or output; each fails
    alone, noted in ``slot``: never let tracing break the user's forward."""
    for work in works:
        try:
            work(forward, position, module, args, value)
        except Exception as error:
            _note_error(forward, position, slot, error)


def _call_error(error: BaseException | None) -> Any:
    """What a call's ERROR slot holds for the exception it ended with: the exception; "interrupted" for one that is
    not an ``Exception`` (KeyboardInterrupt, SystemExit: shown as CallInterrupted)."""
    return error if error is None or isinstance(error, Exception) else "interrupted"


def _note_error(forward: RawForward, position: int, slot: int, error: Exception) -> None:
    """A feature failed on this call: its error becomes the call's ``<prefix>.stats_error`` attribute; what the other
    features recorded stays (tensor summaries are left alone: they may be shared with other calls, and small
    tensors' numbers are filled in at the end of the forward)."""
    noted = {**(forward.extra(position, slot) or {}), FEATURE_ERROR: {"stats_error": error_text(error)}}
    forward.set_extra(position, slot, noted)


def _inside_tracer_or_backward() -> bool:
    """torch.jit.trace recording the model (the statistics' ops would enter its graph), or autograd re-running a
    checkpointed forward inside backward (not a forward of the user's: its time is the backward span's)."""
    return torch.jit.is_tracing() or torch._C._current_graph_task_id() != -1


def _device_of(module: torch.nn.Module, args: tuple) -> torch.device | None:
    """Where a forward runs: its module's first parameter (in ``parameters()`` order), else its first buffer, else
    its first tensor argument. Walked directly: ``module.parameters()`` builds a generator chain and a set of the
    modules seen, 2.8 us on every forward of an 8-layer model."""
    tensor = _first_tensor(module, "_parameters")
    if tensor is None:
        tensor = _first_tensor(module, "_buffers")
    if tensor is None:
        tensor = _first_tensor_argument(args)
    return tensor.device if tensor is not None else None


def _first_tensor(module: torch.nn.Module, kind: str) -> torch.Tensor | None:
    """The first of ``module``'s own tensors of ``kind``, else of its sub-modules', depth first, as
    ``named_modules()`` orders them."""
    for tensor in getattr(module, kind).values():
        if tensor is not None:
            return tensor
    for child in module._modules.values():
        if child is not None and (tensor := _first_tensor(child, kind)) is not None:
            return tensor
    return None


def _first_tensor_argument(args: tuple) -> torch.Tensor | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
    return None


def _torch_call_frame() -> Any:
    """torch's frame running the hooked call: above _begin_forward, the hook and any graph-break wrapper."""
    return _past_hook_wrapper(sys._getframe(3))


def _past_hook_wrapper(frame: Any) -> Any:
    """The frame that called a model's own hook: past what it was wrapped in (``outside_compiled_regions``)."""
    code = frame.f_code
    if code is _call_uncompiled.__code__ or "_dynamo" in code.co_filename:  # or torch.compiler.disable's wrapper
        return frame.f_back
    return frame


def called_from_compiled_code() -> bool:
    """Whether torch.compile'd code called this model: a torch._dynamo frame above torch's module call. Where
    dynamo has not converted a frame in this process (its counters say), none can be: no walk up the stack (~2 us
    on every traced forward of a model that is never compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:  # dynamo never loaded
        return False
    counters = getattr(utils, "counters", None)
    if counters is not None and not counters["frames"]["total"]:
        return False
    frame = _past_hook_wrapper(sys._getframe(3))  # past this check, _begin_forward and the hook
    for _ in range(24):
        if frame is None:
            return False
        if "_dynamo" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def warn_region_level(model_name: str) -> None:
    warnings.warn(
        f"torchtrace: {model_name} runs under torch.compile; module hooks do not run inside compiled regions, "
        "so it is traced at region level: one span per call of the model, with its output statistics. "
        "Run it uncompiled for per-module spans.",
        RuntimeWarning,
        stacklevel=4,
    )


def warn_compiled_modules(paths: list[str], stacklevel: int = 5, after: bool = False) -> None:
    """Modules of the model compiled on their own (the per-block recipe): said once per instrument(), and once for
    those compiled after it (``after``: the first one named)."""
    if after:
        named, verb = f"{paths[0]} (and any module compiled after it)", "was compiled after instrument()"
    else:
        named = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        verb = "is compiled on its own" if len(paths) == 1 else "are compiled on their own"
    warnings.warn(
        f"torchtrace: {named} {verb} (module.compile() or torch.compile(module)): each such module is traced as a "
        "whole, outside its compiled code (one span per call, with its output statistics); the modules inside it "
        "are not traced.",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def _on_call_stack(frame: Any) -> bool:
    """Walks the stack: only when the outermost module is entered again while its forward looks open (rare)."""
    current = sys._getframe(2)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


@dataclass(slots=True, frozen=True)
class CompressedTensor:
    """A captured tensor, zlib-compressed; ``tensor()`` gives it back bit for bit."""

    data: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The uncompressed size (what ``capture_max_bytes`` counts)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> CompressedTensor:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return cls(zlib.compress(raw), tensor.dtype, tuple(tensor.shape))

    def tensor(self) -> torch.Tensor:
        raw = bytearray(zlib.decompress(self.data))
        if not raw:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype).reshape(self.shape)
