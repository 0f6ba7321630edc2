"""The hot path: forward pre/post hooks that append timestamps and statistics to a per-thread list.

Nothing here creates OTel objects, takes a lock per call, updates a metric or waits for a device. Per call: two
clock reads (plus two pooled timing events on CUDA), a list append, a stack push/pop, and (when statistics are on)
a few torch reductions. Once per outermost forward: the sampling decision, the caller's span context, and one
append to the record buffer.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry import trace

from torchtrace._buffer import RecordBuffer
from torchtrace._calls import error_text
from torchtrace._config import Options
from torchtrace._device import DeviceWork, event_timer
from torchtrace._sampling import ForwardSampler
from torchtrace._stats import StatComputer, StatTable, find_tensors

_UNKNOWN = object()
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # a plain `return False` that dynamo folds to True
_compiler = torch.compiler


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

# Slots of one raw call entry (a list: the cheapest thing to create in a hook). A bare tensor output's statistics
# go in OUTPUT_STATS (a dict of plain values, which the garbage collector does not track); OUTPUTS holds the tensor
# summaries of any other output ({name: stats}), a tracked dict: one more object per call for the collector to
# promote while the forward runs. START_EVENT and END_EVENT stay last (read as a slice).
(MODULE, START, END, PARENT, POSITION, OUTPUTS, INPUTS, ERROR, OUTPUT_VALUE, INPUT_VALUE, ATTRIBUTES, TENSORS,
 OUTPUT_STATS, START_EVENT, END_EVENT) = range(15)  # fmt: skip


@dataclass(slots=True, frozen=True)
class ModuleInfo:
    """What is known of a module before any call: computed once at instrument()."""

    path: str
    type_name: str
    depth: int


@dataclass(slots=True)
class RawForward:
    """One outermost forward as the hot path left it."""

    entries: list  # call entries in start order; PARENT is an index into this list or -1
    parent: Any  # the caller's OTel SpanContext (may be invalid)
    thread_id: int
    clock_offset_ns: int  # epoch ns = perf_counter ns + offset
    device: DeviceWork | None = None  # timing events and statistics rows still on the device
    all_finite: bool = False  # True: no NaN or Inf in any statistic (nothing to look for), False: not known
    stat_table: StatTable | None = None  # the statistics of its small CPU tensors, a row each


class _ThreadState:
    """What the hooks of one instrumentation keep per thread (plain slots: read many times per call)."""

    __slots__ = ("stats", "stack", "entries", "skip_depth", "skip_root", "root_frame", "parent", "clock_offset_ns",
                 "timer")  # fmt: skip

    def __init__(self, options: Options, steps: Any) -> None:
        # per thread: it batches per forward; in training, device statistics share the step's rows
        self.stats = StatComputer(
            options.stats, options.extra_stats, steps.device_rows if steps else None, options.stats_sample
        )
        self.stack: list = []  # open entries, innermost last
        self.entries: list = []
        self.skip_depth = 0  # > 0 inside a forward that is not traced
        self.skip_root = -1  # the outermost module of that forward
        self.root_frame: Any = None  # frame of the outermost call: tells recursion from an interrupted forward
        self.parent: Any = None
        self.clock_offset_ns = 0
        self.timer: Any = None  # the EventTimer of the current forward's device (CUDA), else None


class HookRecorder:
    """Owns the hook functions of one instrumentation and the per-thread state they share."""

    def __init__(self, modules: list[ModuleInfo], options: Options, buffer: RecordBuffer, steps: Any = None) -> None:
        self.modules = modules
        self.options = options
        self.buffer = buffer
        self.enabled = True
        self.sampler = ForwardSampler(options.sample_every, options.sample_ratio)
        self.summarise = bool(options.stats or options.extra_stats)
        # what each call does with its output and inputs beyond timing, chosen once: every feature fails alone
        self._output_work = tuple(
            work
            for work, wanted in (
                (self._output_stats, self.summarise),
                (self._output_value, options.function_on_output is not None),
                (self._output_attributes, bool(options.module_attributes) and not options.attributes_before_forward),
                (self._output_capture, options.capture_tensors),
                (self._output_backward, steps is not None and steps.backward),
            )
            if wanted
        )
        self._input_work = tuple(
            work
            for work, wanted in (
                (self._input_stats, options.inputs and self.summarise),
                (self._input_value, options.function_on_input is not None),
                (self._attributes_before, bool(options.module_attributes) and options.attributes_before_forward),
            )
            if wanted
        )
        self.captured_bytes = 0
        self.skipped_captures = 0
        self.steps = steps  # a StepTracker when forwards belong to training steps
        self.warned_compiled = False
        self._first_parameter: dict[int, Any] = {}  # module index -> its first own Parameter, or None
        self._local = threading.local()  # .state: this thread's _ThreadState

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
            if stack and stack[0][MODULE] == index and not _on_call_stack(state.root_frame):
                self._close_interrupted(state)
            if not stack and not self._begin_forward(state, index, module, args):
                return
            entries = state.entries
            # MODULE, START, END, PARENT, POSITION, OUTPUTS, INPUTS, ERROR (the exception the caller is handling,
            # if any: a None output seen with it still current is no error), OUTPUT_VALUE, INPUT_VALUE, ...
            entry = [index, 0, None, stack[-1][POSITION] if stack else -1, len(entries), None, None, exc_info()[1],
                     None, None, None, None, None, None, None]  # fmt: skip
            if input_work:
                _run_work(input_work, INPUTS, entry, module, args, kwargs)
            entries.append(entry)
            stack.append(entry)
            timer = state.timer  # the root always marks: its events are the forward's origin and completion
            if timer is not None and (len(stack) == 1 or self._on_timer_device(index, module, args, timer)):
                entry[START_EVENT] = timer.mark()
            entry[START] = perf_counter_ns()  # last: the span times the module, not our bookkeeping

        # The model's own hooks run outside a compiled region (dynamo graph-breaks around them), so a compiled
        # model still gets its outermost span: region-level tracing, announced once by warn_region_level.
        return torch.compiler.disable(pre_hook) if self.modules[index].path == "" else pre_hook

    def traced_forward(self, index: int):
        """The body of module ``index``'s ``TracedForward`` (see ``_traced_forward``). Inside a traced forward it
        records the call itself, in one Python call; outside one (the module called on its own, or the model's root
        not selected) it runs the hook functions, which begin and end forwards."""
        local = self._local
        perf_counter_ns = time.perf_counter_ns
        input_work = self._input_work
        output_work = self._output_work
        pre, post = self.forward_pre_hook(index), self.forward_post_hook(index)

        def call(module_ref: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
            module = module_ref()
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
            entries = state.entries
            # MODULE, START, END, PARENT, POSITION, OUTPUTS, INPUTS, ERROR, OUTPUT_VALUE, INPUT_VALUE, ...
            entry = [index, 0, None, stack[-1][POSITION], len(entries), None, None, None, None, None, None, None,
                     None, None, None]  # fmt: skip
            if input_work:
                _run_work(input_work, INPUTS, entry, module, args, kwargs)
            entries.append(entry)
            stack.append(entry)
            timer = state.timer
            if timer is not None and self._on_timer_device(index, module, args, timer):
                entry[START_EVENT] = timer.mark()
            entry[START] = perf_counter_ns()  # last: the span times the module, not our bookkeeping
            try:
                output = function(module, *args, **kwargs)
            except BaseException as error:
                end = perf_counter_ns()
                _pop_to(stack, entry, end)
                entry[END] = end
                entry[ERROR] = _call_error(error)
                if entry[START_EVENT] is not None:  # before the statistics' kernels: not the module's work
                    entry[END_EVENT] = state.timer.mark()
                if output_work:
                    _run_work(output_work, OUTPUTS, entry, module, args, None)
                raise
            end = perf_counter_ns()
            if stack and stack[-1] is entry:
                stack.pop()
            else:
                _pop_to(stack, entry, end)
            entry[END] = end
            if entry[START_EVENT] is not None:
                entry[END_EVENT] = state.timer.mark()
            if output_work:
                _run_work(output_work, OUTPUTS, entry, module, args, output)
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
            if stack[-1][MODULE] != index and all(open_entry[MODULE] != index for open_entry in stack):
                return  # never opened: a pre-hook registered before ours raised (torch still runs always_call hooks)
            entry = stack.pop()
            while entry[MODULE] != index and stack:
                # An exception that torch does not pass to always_call hooks (BaseException) skipped these closes.
                entry[END] = end
                entry[ERROR] = "interrupted"
                entry = stack.pop()
            entry[END] = end
            if entry[START_EVENT] is not None:  # before the statistics' kernels: they are not the module's work
                entry[END_EVENT] = state.timer.mark()
            if output is None:
                # always_call hooks run from torch's `except Exception:` block: the exception is still current.
                # One the caller was already handling before the call (pre hook) is not this call's error.
                error = sys.exc_info()[1]
                entry[ERROR] = None if error is entry[ERROR] else _call_error(error)
            else:
                entry[ERROR] = None
            if output_work:
                _run_work(output_work, OUTPUTS, entry, module, args, output)
            if not stack:
                self._end_forward(state)

        return torch.compiler.disable(post_hook) if self.modules[index].path == "" else post_hook

    # -- per forward ---------------------------------------------------------------------------------------------

    def _on_timer_device(self, index: int, module: torch.nn.Module, args: tuple, timer: Any) -> bool:
        """Whether this call runs where the forward's timer records (a model split over GPUs has calls elsewhere:
        those keep host times rather than events on another device's stream). Its own first parameter says,
        else its first tensor argument; a module with neither is taken to run there."""
        parameter = self._first_parameter.get(index, _UNKNOWN)
        if parameter is _UNKNOWN:  # looked up once: .to() keeps the Parameter objects, only their data moves
            parameter = self._first_parameter[index] = next(module.parameters(recurse=False), None)
        device = parameter.device if parameter is not None else _argument_device(args)
        return device is None or device == timer.device

    def _begin_forward(self, state: _ThreadState, index: int, module: torch.nn.Module, args: tuple) -> bool:
        state.root_frame = _torch_call_frame()
        parent = self._parent_if_traced() if self.enabled and not _inside_tracer_or_backward() else None
        root = self.modules[index]
        if parent is not None and not self.warned_compiled and root.path == "" and called_from_compiled_code():
            self.warned_compiled = True
            warn_region_level(root.type_name)
        device = _device_of(module, args) if parent is not None else None
        if parent is None or (device is not None and device.type == "cuda" and _capturing_graph()):
            # Not traced; or being captured into a CUDA graph, where timing events are not allowed and statistics
            # kernels would be replayed into rows long since read: graph capture and replay are not traced.
            state.skip_depth = 1
            state.skip_root = index
            return False
        state.parent = parent
        state.clock_offset_ns = time.time_ns() - time.perf_counter_ns()
        state.timer = event_timer(device) if self.options.cuda_events else None
        return True

    def _parent_if_traced(self) -> Any:
        """The span context this forward's root goes under, or None when it is not traced."""
        steps = self.steps
        if steps is not None:
            steps.closed_by_optimizer = False  # a forward of the next iteration: handle.step() closes again
            return steps.context if steps.traced else None  # the step's schedule decides
        parent = trace.get_current_span().get_span_context()
        if parent.is_valid and not parent.trace_flags.sampled:
            return None  # the caller's trace is not sampled: neither are we (ParentBased)
        return parent if self.sampler.should_trace() else None

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
        end = max(entry[END] or entry[START] for entry in state.entries)
        for entry in state.stack:
            entry[END] = end
            entry[ERROR] = "interrupted"
        root = state.stack[0]
        if root[START_EVENT] is not None:  # the forward's events are read once this one completes
            root[END_EVENT] = state.timer.mark()
        state.stack.clear()
        self._end_forward(state)

    def _end_forward(self, state: _ThreadState) -> None:
        entries = state.entries
        state.entries = []
        state.root_frame = None
        rows, all_finite, table = state.stats.finish_forward()
        device = None
        if rows or state.timer is not None:
            device = DeviceWork(rows, state.timer)
            if state.timer is not None and entries[0][END_EVENT] is not None:
                device.done.append(entries[0][END_EVENT])
        forward = RawForward(
            entries, state.parent, threading.get_ident(), state.clock_offset_ns, device, all_finite, table
        )
        steps = self.steps
        if steps is not None:  # delivered with its step, after the step's root span
            if state.timer is not None:
                steps.timer = state.timer  # the step's backward and all-reduce marks use it too
            if steps.pending_calls + len(entries) > self.options.max_pending_calls:
                self.buffer.drop(len(entries), "training step never closed: call handle.step() each step")
            else:
                steps.forwards.append(forward)
                steps.pending_calls += len(entries)
        else:
            self.buffer.put(forward, len(entries))

    # -- what a call records --------------------------------------------------------------------------------------

    def _input_stats(self, entry: list, module: torch.nn.Module, args: tuple, kwargs: dict | None) -> None:
        value: Any = args if not kwargs else {**{str(i): a for i, a in enumerate(args)}, **kwargs}
        entry[INPUTS] = self._summarise_value(value)

    def _input_value(self, entry: list, module: torch.nn.Module, args: tuple, kwargs: dict | None) -> None:
        entry[INPUT_VALUE] = self.options.function_on_input(args[0] if len(args) == 1 else args)

    def _attributes_before(self, entry: list, module: torch.nn.Module, args: tuple, kwargs: dict | None) -> None:
        entry[ATTRIBUTES] = self._attribute_values(module)

    def _output_stats(self, entry: list, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            entry[OUTPUT_STATS] = self._thread_state().stats(output)
        elif output is not None:  # None: a call that raised (always_call hooks)
            entry[OUTPUTS] = self._summarise_value(output)

    def _output_value(self, entry: list, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if output is not None:
            entry[OUTPUT_VALUE] = self.options.function_on_output(output)

    def _output_attributes(self, entry: list, module: torch.nn.Module, args: tuple, output: Any) -> None:
        entry[ATTRIBUTES] = self._attribute_values(module)

    def _attribute_values(self, module: torch.nn.Module) -> dict[str, Any]:
        """The module attributes asked for: ``function_on_attribute(value)`` when given (the live value, kept as
        the function returns it), else numbers as they are, tensors copied (one element: a number)."""
        function = self.options.function_on_attribute
        if function is not None:
            return {name: function(getattr(module, name, None)) for name in self.options.module_attributes}
        return {name: self._attribute_value(module, name) for name in self.options.module_attributes}

    def _attribute_value(self, module: torch.nn.Module, name: str) -> Any:
        value = getattr(module, name, None)
        if not isinstance(value, torch.Tensor):
            return value
        return value.item() if value.numel() == 1 else self._copy_within_budget(value)

    def _copy_within_budget(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A CPU copy, counted against ``capture_max_bytes`` (None, and counted as skipped, past it)."""
        size = tensor.numel() * tensor.element_size()
        if self.captured_bytes + size > self.options.capture_max_bytes:
            self.skipped_captures += 1
            return None
        self.captured_bytes += size
        return tensor.detach().to("cpu", copy=True)

    def _output_capture(self, entry: list, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if output is not None:
            entry[TENSORS] = self._capture(output)

    def _output_backward(self, entry: list, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.steps.pending_calls >= self.options.max_pending_calls:
            return  # a step that is never closed: its forwards are dropped, so are their backward hooks
        timer = self._thread_state().timer if entry[START_EVENT] is not None else None  # on the timer's device only
        self.steps.watch_backward(entry, module, args, output, timer)

    def _summarise_value(self, value: Any) -> dict[str, dict]:
        tensors, truncated = find_tensors(value, self.options.max_tensors)
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
        for name, tensor in find_tensors(output, self.options.max_tensors)[0]:
            copy = self._copy_within_budget(tensor)
            if copy is not None:
                captured[name] = CompressedTensor.of(copy) if self.options.capture_compress else copy
        return captured


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


def output_summaries(entry: list) -> dict[str, dict] | None:
    """A call's output tensor summaries, {name: stats}, whichever slot holds them."""
    stats = entry[OUTPUT_STATS]
    if stats is None:
        return entry[OUTPUTS]
    return {"": stats, **entry[OUTPUTS]} if entry[OUTPUTS] else {"": stats}


def _pop_to(stack: list, entry: list, end: int) -> None:
    """Pops a finished call off the stack. Calls above it still open were left so by an exception that torch runs
    no always_call hook for (the root's hooks, re-entered inside it): they end here, interrupted. A call no longer
    on the stack (closed from outside) leaves the stack alone."""
    if not any(open_entry is entry for open_entry in stack):
        return
    while stack:
        top = stack.pop()
        if top is entry:
            return
        top[END] = end
        top[ERROR] = "interrupted"


def _run_work(works: tuple, slot: int, entry: list, module: torch.nn.Module, args: tuple, value: Any) -> None:
    """A call's features (statistics, user functions, attributes, captures) on its inputs or output; each fails
    alone, noted in ``slot``: never let tracing break the user's forward."""
    for work in works:
        try:
            work(entry, module, args, value)
        except Exception as error:
            _note_error(entry, slot, error)


def _call_error(error: BaseException | None) -> Any:
    """What a call's ERROR slot holds for the exception it ended with: the exception; "interrupted" for one that is
    not an ``Exception`` (KeyboardInterrupt, SystemExit: shown as CallInterrupted)."""
    return error if error is None or isinstance(error, Exception) else "interrupted"


def _note_error(entry: list, slot: int, error: Exception) -> None:
    """A feature failed on this call: its error becomes the call's ``<prefix>.stats_error`` attribute; what the other
    features recorded stays (tensor summaries are left alone: they may be shared with other calls, and small
    tensors' numbers are filled in at the end of the forward)."""
    entry[slot] = {**(entry[slot] or {}), FEATURE_ERROR: {"stats_error": error_text(error)}}


def _inside_tracer_or_backward() -> bool:
    """torch.jit.trace recording the model (the statistics' ops would enter its graph), or autograd re-running a
    checkpointed forward inside backward (not a forward of the user's: its time is the backward span's)."""
    return torch.jit.is_tracing() or torch._C._current_graph_task_id() != -1


def _capturing_graph() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _device_of(module: torch.nn.Module, args: tuple) -> torch.device | None:
    """Where a forward runs: its module's first parameter (in ``parameters()`` order), else its first buffer, else
    its first tensor argument. Walked directly: ``module.parameters()`` builds a generator chain and a set of the
    modules seen, 2.8 us on every forward of an 8-layer model."""
    tensor = _first_tensor(module, "_parameters")
    if tensor is None:
        tensor = _first_tensor(module, "_buffers")
    return tensor.device if tensor is not None else _argument_device(args)


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


def _argument_device(args: tuple) -> torch.device | None:
    """The device of a call's first tensor argument, if it has one."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return None


def _torch_call_frame() -> Any:
    """torch's frame running the hooked call: above _begin_forward, the hook and any graph-break wrapper."""
    frame = sys._getframe(3)
    if "_dynamo" in frame.f_code.co_filename:  # torch.compiler.disable around the model's own hooks
        frame = frame.f_back
    return frame


def called_from_compiled_code() -> bool:
    """Whether torch.compile'd code called this model: a torch._dynamo frame above torch's module call."""
    frame = sys._getframe(4)  # past this check, _begin_forward, the hook, and torch.compiler.disable's wrapper
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
