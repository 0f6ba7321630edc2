"""Raw forwards and training steps become calls as columns (``CallBatch``: ids, epoch times, attributes; a
``ModuleCall`` object is made only for what reads one), handed to every sink.

A CPU forward with nothing left on a device is resolved by the hooks at its end (``resolve_forward``, on the model's
thread, while its values are in cache); the rest (device work, read once complete; steps) on the background worker
every ``export_interval_ms``, and synchronously on ``flush()`` or when records are read. A failing sink is logged
and counted; it never stops the others or reaches user code.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.trace import INVALID_SPAN_CONTEXT

from torchtrace._capture import replaced as _replaced
from torchtrace._capture.buffer import FULL, RecordBuffer
from torchtrace._capture.cuda_driver import THREAD_LOCAL_CAPTURE, exchange_capture_mode
from torchtrace._capture.device import capturing_cuda_graph, elapsed_ns, elapsed_since
from torchtrace._capture.recorder import (
    ATTRIBUTES,
    ERROR,
    INPUT_VALUE,
    INPUTS,
    OUTPUT_VALUE,
    OUTPUTS,
    TENSORS,
    ModuleInfo,
    RawForward,
)
from torchtrace._capture.stats import resolve
from torchtrace._capture.steps import BACKWARD_START, StepRecord
from torchtrace._capture.summaries import CALL_KEYS, fill_table_rows, gradient_items, set_attributes
from torchtrace._core import signals as _signals
from torchtrace._core.calls import DATA_WAIT, CallBatch, Calls, ModuleCall, NonFiniteError, Sink, interned
from torchtrace._pipeline import device_times
from torchtrace._pipeline.step_bounds import StepBounds
from torchtrace._pipeline.worker import WORKER
from torchtrace.attributes import (
    COMM_BUCKET,
    COMM_BYTES,
    COMM_LAST,
    COMM_SECONDS,
    GRAD_INPUT_PREFIX,
    GRAD_OUTPUT_PREFIX,
    OPTIMIZER_CALL_SECONDS,
    OPTIMIZER_CLOSURE_FORWARDS,
    RANK,
    RANK_DETAIL,
    STEP,
    WORLD_SIZE,
)

try:
    from torchtrace._native import call_columns as _call_columns
    from torchtrace._native import place_times as _place_times
except ImportError:  # not built (no C compiler at install): the Python loops make the same values
    _call_columns = _place_times = None

_logger = logging.getLogger(__name__)

# Forwards with device work that come back to back (one starting within BACK_TO_BACK_NS of the one before's end: a
# loop, a busy server, generate) are read on the model's thread at each forward's end, and the worker leaves them
# (``worker_defers``): on one GIL, a worker reading beside a host-bound forward cost the model's thread more
# than the reading itself does there (the two threads hand the GIL over at every torch op;
# benchmarks/worker_contention.py). Forwards with a pause between them (a server between requests) are read by the
# worker at its next tick, while the model is idle: the model's thread never adds reading to a request's latency
# there. The worker never starts reading while a forward runs, nor within MODEL_THREAD_WINDOW_NS of a
# back-to-back forward's end.
BACK_TO_BACK_NS = 2_000_000
MODEL_THREAD_WINDOW_NS = 5_000_000


class CallInterrupted(BaseException):
    """Stands in for an exception torch did not show the hooks (e.g. KeyboardInterrupt)."""


def resolve_forward(forward: RawForward, modules: Sequence[ModuleInfo], release: bool = True) -> CallBatch:
    """One raw forward -> its calls as columns, parents before children, ids assigned. Runs once per traced call:
    lean (no object per call; ``ModuleCall`` objects are made only if something reads them).

    ``release``: give its device buffers and events back afterwards (a step keeps them for its backward).
    """
    parent = forward.context if forward.context is not None else INVALID_SPAN_CONTEXT
    if parent.is_valid:
        trace_id, root_parent_id = parent.trace_id, parent.span_id
        # an empty trace state is none (what the records and the encoders' shortcuts take)
        flags, trace_state = int(parent.trace_flags), parent.trace_state or None
    else:
        trace_id, root_parent_id, flags, trace_state = random.getrandbits(128) or 1, 0, 1, None
    batch = CallBatch(modules, trace_id, root_parent_id, parent.is_remote, flags, trace_state, forward.thread_id)
    n = len(forward.module)
    offset = forward.clock_offset_ns
    starts, ends = _times(forward)
    batch.module = forward.module  # the hot path is done with its columns: shared, not copied
    batch.parent = parents = forward.parent
    columns = _call_columns(starts, ends, parents, offset) if _call_columns is not None else None
    if columns is not None:
        start_ns, end_ns, batch.depth, batch.durations = columns
        batch.start_ns, batch.end_ns = array("q", start_ns), array("q", end_ns)
    else:
        batch.start_ns = array("q", [start + offset for start in starts])
        batch.end_ns = array("q", [(start if end is None else end) + offset for start, end in zip(starts, ends)])
        depth = batch.depth = [0] * n
        for position in range(1, n):
            parent_position = parents[position]
            if parent_position >= 0:
                depth[position] = depth[parent_position] + 1
    set_attributes(batch, forward, modules)
    sparse = batch.sparse
    for position in sorted(forward.extras):
        extras = forward.extras[position]
        error, output_value, input_value = extras[ERROR], extras[OUTPUT_VALUE], extras[INPUT_VALUE]
        tensors, attrs = extras[TENSORS], extras[ATTRIBUTES]
        if not (error is None and output_value is None and input_value is None and tensors is None and attrs is None):
            if error is not None and error == "interrupted":
                error = CallInterrupted("call interrupted")
            sparse[position] = [error, output_value, input_value, tensors, attrs]
    batch.span_id = _span_ids(n)
    batch.hi = n
    # the hot path says when no statistic of the forward counted NaN or Inf: nothing to look at per call
    if not forward.all_finite:
        fill_table_rows(forward)
        if any(map(_has_nonfinite, forward.output_stats.values())) or any(
            _nonfinite(extras[OUTPUTS]) is not None for extras in forward.extras.values()
        ):
            _mark_first_nonfinite(
                (
                    (batch.end_ns[position], (batch, position), forward.output_summaries(position),
                     forward.extra(position, INPUTS))
                    for position in range(n)
                ),
                "output",
            )  # fmt: skip
    if release:
        _release(forward)
    return batch


def _times(forward: RawForward) -> tuple[list[int], list[int | None]]:
    """Each call's start and end, perf_counter ns. With device timing, each call timed by events is placed after
    the root's host start by the events' distance, so the spans show execution on the device, nested as the
    events were recorded on one stream."""
    starts, ends = forward.start, forward.end
    timed = forward.device is not None and forward.device.timer is not None
    origin = forward.start_events.get(0) if timed else None
    if origin is None:
        return starts, ends
    start_events, end_events = forward.start_events, forward.end_events
    read = device_times.take(forward)  # read off the model's thread, where the reader got there first
    if read is not None:
        start_offsets, end_offsets = read
    else:
        start_offsets = elapsed_since(origin, list(start_events.values()))
        end_offsets = elapsed_since(origin, list(end_events.values()))
    if _place_times is not None:
        return _place_times(starts, ends, starts[0], start_events, start_offsets, end_events, end_offsets)
    starts, ends = list(starts), list(ends)
    origin_ns = starts[0]
    for position, offset in zip(start_events, start_offsets):
        start, end = starts[position], ends[position]
        starts[position] = origin_ns + offset
        ends[position] = origin_ns + offset + (end if end is not None else start) - start  # host duration, unless:
    for position, offset in zip(end_events, end_offsets):
        ends[position] = origin_ns + offset
    return starts, ends


def _span_ids(n: int) -> array:
    """``n`` random non-zero 64-bit span ids, drawn at once, as a column of native uint64s (no Python int each)."""
    raw = random.randbytes(8 * n)
    ids = array("Q", raw)
    if raw.find(_EIGHT_ZEROS) >= 0 and 0 in ids:  # one chance in 2**64 per id
        ids = array("Q", [span_id or 1 for span_id in ids])
    return ids


_EIGHT_ZEROS = bytes(8)


def _release(forward: RawForward) -> None:
    """Every statistic and time of the forward is read: its rows and events go back to their pools."""
    device = forward.device
    if device is not None:
        device.release()
        if device.timer is not None:  # every event of the forward is its timer's
            device.timer.give_back(forward.start_events.values())
            device.timer.give_back(forward.end_events.values())


def _has_nonfinite(stats: dict) -> bool:
    """Whether a tensor's statistics (read) count NaN or Inf: the rare case, looked at closer."""
    return bool(stats.get("nan_count") or stats.get("inf_count"))


def _nonfinite(summaries: dict[str, dict] | None) -> tuple[str, int, int] | None:
    """(tensor name, NaN count, Inf count) of the first tensor with either, if any."""
    for name, stats in (summaries or {}).items():
        nans, infs = stats.get("nan_count", 0), stats.get("inf_count", 0)
        if nans or infs:
            return name, nans, infs
    return None


def _first_nonfinite(
    candidates: Iterable[tuple[int, Any, dict | None, dict | None]],
) -> tuple[Any, str, int, int] | None:
    """Of (finish time, who, tensor summaries, what it received), the first to finish with NaN/Inf produced it
    (those finishing later only pass it on); one that received NaN/Inf (its inputs, when summarised, or its
    incoming gradient) did not: (who, tensor name, NaN count, Inf count)."""
    first = None
    for end, who, summaries, received in candidates:
        found = _nonfinite(summaries)
        if found and (first is None or end < first[0]) and not _nonfinite(received):
            first = (end, who, found)
    return None if first is None else (first[1], *first[2])


def _mark_first_nonfinite(candidates: Iterable[tuple[int, tuple[CallBatch, int], Any, Any]], what: str) -> None:
    """Of (end, (columns, position), the call's tensor summaries, what it received), the call that first produced
    NaN/Inf gets a NonFiniteError naming the tensor (its ``what``: "output", "grad_input")."""
    found = _first_nonfinite(candidates)
    if found is None:
        return
    (batch, position), name, nans, infs = found
    if batch.error(position) is None:
        call = batch.calls()[position]
        tensor = f"{what}.{name}" if name else what
        message = f"{call.name} produced {nans} NaN and {infs} Inf in its {tensor}"
        batch.set_error(position, NonFiniteError(message, call))


def first_nonfinite(record: StepRecord, modules: Sequence[ModuleInfo]) -> str | None:
    """The verdict of a step without resolving it: which module first produced NaN/Inf, forward or backward."""

    def resolved(summaries: dict | None) -> dict | None:
        return summaries and {name: resolve(stats) for name, stats in summaries.items()}

    for fw in record.forwards:
        fill_table_rows(fw)
    forward = _first_nonfinite(
        (fw.end[p] or 0, (fw, p), resolved(fw.output_summaries(p)), resolved(fw.extra(p, INPUTS)))
        for fw in record.forwards
        for p in range(len(fw))
    )
    if forward is not None:
        (fw, p), name = forward[0], forward[1]
        info = modules[fw.module[p]]
        return f"{info.path or info.type_name} produced NaN/Inf in output {name}".rstrip()
    incoming = {call: grads for call, event, _, grads, *_ in record.backward_events if event == BACKWARD_START}
    backward = _first_nonfinite(
        (time_ns, call, resolved(grads), resolved(incoming.get(call)))
        for call, event, time_ns, grads, *_ in record.backward_events
        if event != BACKWARD_START
    )
    if backward is not None:
        fw, p = backward[0]
        info = modules[fw.module[p]]
        return f"{info.path or info.type_name} backward produced NaN/Inf in grad_input {backward[1]}"
    return None


def _step_call(name: str, trace_id: int, span_id: int, parent_id: int, record: StepRecord, attributes: dict):
    return ModuleCall(
        "", name, 0, trace_id, span_id, parent_id, record.start_ns, record.end_ns, attributes, kind="step"
    )


def resolve_step(
    record: StepRecord, modules: Sequence[ModuleInfo], step_bounds: StepBounds | None = None
) -> list[Sequence[ModuleCall]]:
    """A traced training step as segments: a list of its root span, its all-reduce buckets, the optimizer step and its
    backward span, then each forward's module backward spans (nested like its calls, ``_backward_columns``) and each
    forward's calls, as columns (no ModuleCall made). In a job, ``step_bounds`` takes this rank's step bounds to rank
    0, where it holds the step's root until every rank's are in."""
    offset = record.clock_offset_ns
    getrandbits = random.getrandbits

    def phase(name: str, start_ns: int, end_ns: int, attributes: dict | None = None) -> ModuleCall:
        return ModuleCall(
            "",
            name,
            1,
            record.trace_id,
            getrandbits(64) or 1,
            record.span_id,
            start_ns,
            end_ns,
            attributes or {},
            kind="phase",
        )

    on_step_clock = _device_clock(record)
    comm = [  # (bucket, bytes, start, end, is_last) on the step's clock; CUDA: from the all-reduce's events
        (bucket, size, on_step_clock(marks[0], start), on_step_clock(marks[1], end), is_last)
        for bucket, size, start, end, is_last, marks in record.comm
    ]
    attributes = {STEP: record.number}
    detail = record.detail() if record.detail is not None else None  # waits for the other ranks' facts
    rank = record.rank
    if rank is None:
        head = [_step_call("train_step", record.trace_id, record.span_id, 0, record, attributes)]
    else:  # one root for all ranks (rank 0 sends it), each rank's step under it: Jaeger shows them side by side
        attributes[RANK] = rank.rank
        if detail is not None:
            attributes[RANK_DETAIL] = ",".join(detail) or "none"
        if comm:
            attributes[COMM_SECONDS] = sum(end - start for _, _, start, end, _ in comm) / 1e9
        root = record.root_span_id
        head = [_step_call(f"rank {rank.rank}", record.trace_id, record.span_id, root, record, attributes)]
        head[0].parent_is_remote = rank.rank != 0  # the root is rank 0's span: another process, another clock
        if rank.rank == 0:
            root_attributes = {STEP: record.number, WORLD_SIZE: rank.world_size}
            head.insert(0, _step_call("train_step", record.trace_id, root, 0, record, root_attributes))
    steps = list(head)
    for bucket, size, start, end, is_last in comm:
        head.append(
            phase(
                f"allreduce bucket {bucket}",
                start + offset,
                end + offset,
                {COMM_BUCKET: bucket, COMM_BYTES: size, COMM_LAST: is_last},
            )
        )
    batches = {forward: resolve_forward(forward, modules, release=False) for forward in record.forwards}
    backward = _backward_columns(record, batches, phase, on_step_clock)
    if record.optimizer_ns:
        head.append(_optimizer_phase(record, phase, batches.values(), backward[0] if backward else None))
    if backward:
        head.append(backward[0])  # the step's own spans in one list (one encoding run), then columns
    columns = [*backward[1:], *batches.values()]  # each forward's backward spans, then each forward's calls
    firsts = [batch.start_ns[0] for batch in batches.values() if len(batch)]
    if firsts:  # the loop between steps, the data loader's next batch above all: up to the first forward
        if record.optimizer_ns:  # a closure optimizer's forwards run inside its step
            firsts.append(record.optimizer_ns[0] + record.clock_offset_ns)
        if min(firsts) > record.start_ns:
            head.insert(len(steps), phase(DATA_WAIT, record.start_ns, min(firsts)))
    if detail == ():  # rank_detail="auto", no reason for this rank's module spans: each forward's root only
        columns = [batch[:1] for batch in batches.values()]
    starts = [call.start_ns for call in head] + [min(batch.start_ns) for batch in columns if batch]
    ends = [call.end_ns for call in head] + [max(batch.end_ns) for batch in columns if batch]
    for step in steps:  # holds all its spans, read on other clocks too (a forward's own offset, CUDA events)
        step.start_ns, step.end_ns = min(step.start_ns, *starts), max(step.end_ns, *ends)
    if step_bounds is not None and rank is not None:
        root = steps[0] if rank.rank == 0 else None  # all ranks' step spans hang under it: it holds all of them
        if step_bounds.step_resolved(record.number, root, steps[-1].start_ns, steps[-1].end_ns):
            del head[0]  # sent when the other ranks' bounds are in
    for forward in record.forwards:
        _release(forward)
    if record.device is not None:
        marks = [event[4] for event in record.backward_events]
        record.device.release([*marks, *(mark for *_, pair in record.comm for mark in pair)])
    return [head, *columns]


def _optimizer_phase(record: StepRecord, phase: Callable[..., ModuleCall], batches: Iterable[CallBatch],
                     backward: ModuleCall | None) -> ModuleCall:  # fmt: skip
    """The optimizer.step span. A closure optimizer (LBFGS, Lightning's automatic optimization) runs the forward and
    backward inside ``step(closure)``: its span then starts where the last of them ended (the optimizer's own
    work), so forward, backward and optimizer stay separate phases; it says how many forwards its closure ran and
    how long the whole call took."""
    start, end = (time + record.clock_offset_ns for time in record.optimizer_ns)
    forwards = [(batch.start_ns[0], batch.end_ns[0]) for batch in batches if len(batch)]
    inside = [(first, last) for first, last in forwards if start <= first and last <= end]
    if not inside:
        return phase("optimizer.step", start, end)
    ends = [last for _, last in inside]
    if backward is not None and start <= backward.start_ns and backward.end_ns <= end:
        ends.append(backward.end_ns)
    attributes = {OPTIMIZER_CLOSURE_FORWARDS: len(inside), OPTIMIZER_CALL_SECONDS:
                  (end - start) / 1e9}  # fmt: skip
    return phase("optimizer.step", max(ends), end, attributes)


def _device_clock(record: StepRecord) -> Callable[[Any, int], int]:
    """(CUDA event or None, host perf_counter ns) -> ns on the step's clock. Events are placed by their distance
    from the start event of the step's first forward (at that forward's host start), as its module calls are."""
    origin = next((fw for fw in record.forwards if 0 in fw.start_events), None)
    if origin is None:
        return lambda mark, host_ns: host_ns
    origin_event = origin.start_events[0]
    origin_ns = origin.start[0] + origin.clock_offset_ns - record.clock_offset_ns

    def on_step_clock(mark: Any, host_ns: int) -> int:
        if mark is None or mark.device != origin_event.device:  # events of two devices have no common clock
            return host_ns
        return origin_ns + elapsed_ns(origin_event, mark)

    return on_step_clock


def _backward_columns(
    record: StepRecord, batches: dict[RawForward, CallBatch], phase: Any, on_step_clock: Callable[[Any, int], int]
) -> list:
    """[the step's backward span, then each forward's module backward spans as columns], or [] without any."""
    offset = record.clock_offset_ns
    # per forward: position -> [start, end, grad_outputs, grad_inputs, output value, input value]; the first start
    # and the last end of a call count, a missing one is the other
    spans_of: dict[RawForward, dict[int, list]] = {}
    for (forward, position), event, time_ns, grads, mark, value in record.backward_events:
        spans = spans_of.get(forward)
        if spans is None:
            if forward not in batches:
                continue  # a forward of an earlier step, backpropagated late: it belongs to no traced step
            spans = spans_of[forward] = {}
        if mark is not None:
            time_ns = on_step_clock(mark, time_ns)  # CUDA: device time
        time_ns += offset
        span = spans.get(position)
        if event == BACKWARD_START:
            if span is None:
                spans[position] = [time_ns, None, grads, None, value, None]
            elif span[0] is None:
                span[0], span[2], span[4] = time_ns, grads, value
        elif span is None:
            spans[position] = [None, time_ns, None, grads, None, value]
        else:
            span[1], span[3], span[5] = time_ns, grads, value
    if not spans_of:
        return []
    first = last = None
    for spans in spans_of.values():
        for span in spans.values():
            if span[0] is None:
                span[0] = span[1]
            elif span[1] is None:
                span[1] = span[0]
            if first is None or span[0] < first:
                first = span[0]
            if last is None or span[1] > last:
                last = span[1]
    backward = phase("backward", first, last)
    columns = [
        _backward_batch(forward, batches[forward], spans_of[forward], record, backward.span_id)
        for forward in batches
        if forward in spans_of
    ]
    if not record.grads_finite:  # a NaN or Inf (or a gradient not read on the host): who produced it
        _mark_first_nonfinite(
            (
                (batch.end_ns[position], (batch, position), grads[0], grads[1])
                for batch, grads_of in columns
                for position, grads in enumerate(grads_of)
            ),
            "grad_input",
        )
    return [backward, *(batch for batch, _ in columns)]


def _backward_batch(
    raw: RawForward, forward: CallBatch, spans: dict[int, list], record: StepRecord, backward_id: int
) -> tuple[CallBatch, list[tuple]]:
    """One forward's module backward spans as columns, parents first, and each span's (grad_input, grad_output)
    summaries. Nested like the forward calls: under the nearest ancestor with a backward, which is stretched to hold
    it (a container's own hooks miss its children's work when its inputs take no gradient, e.g. token ids); deepest
    first, so that a child is final (holds its own descendants) before its parent is stretched over it."""
    depth, parent_of = forward.depth, forward.parent
    ancestor_of: dict[int, int] = {}
    for position in sorted(spans, key=lambda p: -depth[p]):
        ancestor = parent_of[position]
        while ancestor >= 0 and ancestor not in spans:
            ancestor = parent_of[ancestor]
        ancestor_of[position] = ancestor
        if ancestor >= 0:
            span, holder = spans[position], spans[ancestor]
            if span[0] < holder[0]:
                holder[0] = span[0]
            if span[1] > holder[1]:
                holder[1] = span[1]
    # by start, an ancestor (which starts no later than its descendants) before them
    order = sorted(spans, key=lambda p: (spans[p][0], depth[p]))
    index_of = {position: index for index, position in enumerate(order)}
    modules = forward.modules
    batch = CallBatch(modules, record.trace_id, backward_id, False, 1, None, forward.thread_id, kind="backward")
    ordered = [spans[position] for position in order]
    batch.module = [forward.module[position] for position in order]
    batch.parent = [index_of[ancestor_of[p]] if ancestor_of[p] >= 0 else -1 for p in order]
    batch.depth = [depth[position] for position in order]
    batch.start_ns = array("q", [span[0] for span in ordered])
    batch.end_ns = array("q", [span[1] for span in ordered])
    batch.span_id = _span_ids(len(order))
    batch.hi = len(order)
    param_stats = record.param_stats  # (raw forward, position) -> parameter norms
    counts: list[int] = []
    keys: list[str] = []  # every span's attributes, flat (as CallBatch.flat_attributes()): no dict a span
    values: list = []
    grads = []
    for index, (position, span) in enumerate(zip(order, ordered)):
        _, _, grad_outputs, grad_inputs, output_value, input_value = span
        info = modules[batch.module[index]]
        before = len(keys)
        keys += CALL_KEYS
        values += (info.path, info.type_name)
        if grad_outputs:
            gradient_items(keys, values, GRAD_OUTPUT_PREFIX, grad_outputs)
        if grad_inputs:
            gradient_items(keys, values, GRAD_INPUT_PREFIX, grad_inputs)
        if param_stats:
            for name, value in param_stats.get((raw, position), {}).items():
                keys.append(name)
                values.append(resolve(value)["norm"] if isinstance(value, dict) else value)  # dict: on a device
        counts.append(len(keys) - before)
        grads.append((grad_inputs, grad_outputs))
        if output_value is not None or input_value is not None:
            # function_on_grad_output(grad_output), function_on_grad_input(grad_input)
            batch.sparse[index] = [None, output_value, input_value, None, None]
    batch.set_flat_attributes(interned(tuple(counts)), interned(tuple(keys)), tuple(values))
    return batch, grads


def _device_works(item: RawForward | StepRecord | CallBatch) -> list:
    if isinstance(item, CallBatch):  # resolved by the hooks: nothing on a device
        return []
    forwards = item.forwards if isinstance(item, StepRecord) else [item]
    works = [forward.device for forward in forwards if forward.device is not None]
    if isinstance(item, StepRecord) and item.device is not None:
        works.append(item.device)
    return works


def _ready(item: RawForward | StepRecord | CallBatch) -> bool:
    """Whether ``item`` can be read without waiting: its device work complete and, for a step under
    ``rank_detail="auto"``, the other ranks' facts in."""
    if isinstance(item, StepRecord) and item.detail is not None and not item.detail.ready():
        return False
    return all(work.ready() for work in _device_works(item))


def _unsent(item: RawForward | StepRecord | CallBatch) -> bool:
    """A step under ``rank_detail="auto"`` whose facts this rank has not sent the others yet: not readable, even
    waiting (until its run's last step, or ``remove()``)."""
    return isinstance(item, StepRecord) and item.detail is not None and not item.detail.sent()


def _wait_for_device(item: RawForward | StepRecord | CallBatch) -> None:
    for work in _device_works(item):
        work.wait()


def _calls_held(item: RawForward | StepRecord | CallBatch) -> int:
    """The calls ``item`` holds, as the buffer counted them when it was put."""
    return item.module_calls() if isinstance(item, StepRecord) else len(item)


def _errors(calls: Calls) -> Iterable[BaseException]:
    """The errors of a batch's calls, without making ModuleCall objects for the forwards' columns."""
    for segment in calls.segments:
        if isinstance(segment, CallBatch) and not segment.made:
            yield from (extras[0] for extras in segment.sparse.values() if extras[0] is not None)
        else:
            yield from (call.error for call in segment if call.error is not None)


class Dispatcher:
    """Drains the record buffer into the sinks, on the shared worker thread and on demand.

    Two paces, so that nothing the garbage collector tracks waits long (see ``worker``): every
    ``RESOLVE_INTERVAL_S`` the worker resolves what the hooks left and hands it to the in-process ``sinks``
    (records, summary, metrics, the user's); ``exporters`` (OTLP, file, SDK spans) get the calls in batches every
    ``interval_s``, or at once on ``drain()``.

    When every in-process sink is one of ``at_forward_end`` (the records and the summary: short, and safe on any
    thread under ``deliver_lock``), a CPU forward that the hooks resolved reaches them on the model's thread at its
    end (``deliver_at_forward_end``) and waits there for the exporters: the worker then never runs while the model
    does, except to export. On the worker, the same delivery slowed the model's thread by a multiple of its own cost
    (the GIL handed back and forth between the two threads; benchmarks/overhead.py, see docs/architecture.md).
    """

    def __init__(
        self,
        buffer: RecordBuffer,
        modules: Sequence[ModuleInfo],
        sinks: Sequence[Sink],
        interval_s: float,
        exporters: Sequence[Sink] = (),
        at_forward_end: Sequence[Sink] = (),
    ) -> None:
        self.buffer = buffer
        self.modules = modules
        self.exporters = list(exporters)
        self.sinks = [*self.exporters, *sinks]  # every sink, exporters first
        self._in_process = list(sinks)
        self._at_forward_end = all(any(sink is safe for safe in at_forward_end) for sink in self._in_process)
        self.interval_s = interval_s
        self.sink_errors = 0
        self.on_nonfinite: Any = None  # callable(NonFiniteError), called off the hot path
        self._lock = threading.Lock()  # one drain at a time keeps batches in order
        self.deliver_lock = threading.Lock()  # held while the in-process sinks and the exporters' backlog change
        self._waiting: list = []  # taken from the buffer, not ready yet (device work, the ranks' facts of a step)
        self._waiting_calls = 0
        self._unexported: list[Sequence[ModuleCall]] = []  # resolved segments, delivered in process, to export
        self._unexported_calls = 0
        self._exporting_calls = 0  # of those, taken by the drain running now, until its requests end
        self._behind = False  # the worker holds forwards taken from the buffer that it has not delivered yet
        self._resolved = 0  # calls resolved since the last drain
        self.next_drain = 0.0  # monotonic time of the next background drain (the shared worker sets it)
        self._forward_end_ns: int | None = None  # perf_counter ns a forward with device work last ended (that path)
        self._back_to_back = False  # it started within BACK_TO_BACK_NS of the one before's end
        self.forward_running: Callable[[], bool] = lambda: False  # whether a traced forward runs (the handle's)
        self.step_bounds: StepBounds | None = None  # in a job: the ranks' step bounds, for rank 0's step roots

    def start(self) -> None:
        """Drain in the background every ``interval_s``, on the process's shared worker thread (which also
        resolves what waits whenever the buffer's backlog is reached)."""
        self.buffer.on_backlog = WORKER.resolve_soon
        WORKER.add(self)

    def stop(self) -> None:
        """Leave the worker (the last dispatcher out ends its thread), then drain what is left."""
        self.buffer.on_backlog = None
        WORKER.discard(self)
        self.drain()

    def _notify_nonfinite(self, error: NonFiniteError) -> None:
        try:
            self.on_nonfinite(error)
        except Exception:
            _logger.exception("torchtrace: the on_nonfinite callback failed")

    def after_fork(self) -> None:
        """In a forked child: a free lock; what was taken or resolved belongs to the parent, which exports it."""
        self._lock = threading.Lock()
        self.deliver_lock = threading.Lock()
        self._waiting = []
        self._waiting_calls = 0
        self._unexported = []
        self._unexported_calls = self._exporting_calls = 0
        self._held_changed()
        self._behind = False
        self._resolved = 0
        self.step_bounds = None  # the child trains no step of the job

    def has_unresolved(self) -> bool:
        """Whether forwards wait in the buffer (or for their device work, or a step for the other ranks' facts), or
        step bounds for the other ranks."""
        return bool(len(self.buffer) or self._waiting or self.step_bounds is not None and self.step_bounds.pending())

    @_signals.guarded
    def deliver_at_forward_end(self, item: Any) -> bool:
        """Called by the hooks on the model's thread when a forward ends, with what it became: a forward resolved
        to its columns, with nothing but spans and statistics (no error, user value or capture: those take the
        worker, where ``on_nonfinite`` is called), goes to the in-process sinks now and waits for the exporters'
        next drain; True then. A forward with device work still running is buffered, after the buffered forwards
        whose device work is done were resolved here where forwards come back to back (``_resolve_device_forwards``);
        True then too. False: the hooks buffer it for the worker."""
        if not self._at_forward_end:
            return False
        if type(item) is RawForward:
            return item.device is not None and self._resolve_device_forwards(item)
        if type(item) is not CallBatch or item.sparse:
            return False
        calls = len(item)
        with self.deliver_lock:  # guarded: a SIGTERM landing meanwhile (its flush needs the lock) is handled after
            if self._behind or len(self.buffer):  # what waits for the worker goes first: forwards stay in order
                return False
            self._deliver(self._in_process, item)
            if not self.exporters:
                self._resolved += calls
            elif self.buffer.pending_calls + self.buffer.held_elsewhere + calls <= self.buffer.max_calls:
                self._unexported.append(item)
                self._unexported_calls += calls
                self._held_changed()
                self._resolved += calls
            else:  # the exporters fall behind (an endpoint that stalls): bounded as the buffer is
                self.buffer.drop(calls, FULL)
        return True

    def _resolve_device_forwards(self, forward: RawForward) -> bool:
        """At the end of ``forward`` (with device work), on the model's thread: where it came back to back with the
        one before (see BACK_TO_BACK_NS), the buffered forwards whose device work is done are resolved and delivered
        to the in-process sinks here, before the worker would take them beside this thread's next forward; then
        ``forward`` is buffered (read at a later forward's end or by the worker: a forward never pays for its own
        reading). After a pause, ``forward`` is buffered for the worker, which reads what is done at its next tick,
        the model idle by then.

        Not where ``on_nonfinite`` (the user's callback stays off the model's thread) or a job's step bounds (rank
        0's step roots) are to be handled: False, the worker's then. Nothing is resolved where this thread captures
        a CUDA graph, or a drain holds the lock (it resolves them itself); the event queries are made in
        thread-local capture mode, so that they cannot invalidate a graph another thread captures (see
        ``tolerate_graph_captures``)."""
        if self.on_nonfinite is not None or self.step_bounds is not None:
            return False
        ended = forward.end[0]
        previous = self._forward_end_ns  # another thread's forward may have ended after this one started: negative
        self._back_to_back = previous is not None and forward.start[0] - previous < BACK_TO_BACK_NS
        self._forward_end_ns = ended if ended is not None else time.perf_counter_ns()
        # after a pause nothing is read here: the worker's, at its next tick, the model idle by then (woken now, it
        # would take the GIL from this forward's own way out)
        readable = self._back_to_back and (self._waiting or len(self.buffer))
        if readable and not capturing_cuda_graph() and self._lock.acquire(blocking=False):
            mode = exchange_capture_mode(THREAD_LOCAL_CAPTURE)
            try:
                self._resolve(wait=False)
            except Exception:  # never the user's forward's error: the worker tries again, and logs what fails
                _logger.exception("torchtrace: could not read the device work of a forward at a later one's end")
            finally:
                if mode is not None:
                    exchange_capture_mode(mode)
                self._lock.release()
        if device_times.applies(forward):  # its events read off this thread while the next forwards run
            device_times.submit(forward)
        self.buffer.put(forward, len(forward))
        return True

    def worker_defers(self) -> bool:
        """Whether the worker is to leave this dispatcher's buffered forwards alone now: forwards with device work
        took ``_resolve_device_forwards``, and a traced forward runs, or they come back to back and the last one
        ended within MODEL_THREAD_WINDOW_NS (the model's thread reads them itself)."""
        end = self._forward_end_ns
        if end is None:
            return False
        return self.forward_running() or self._back_to_back and time.perf_counter_ns() - end < MODEL_THREAD_WINDOW_NS

    def resolve(self) -> None:
        """Resolves what is buffered and ready (device work complete) and hands it to the in-process sinks; the
        exporters get it at the next drain."""
        with self._lock:
            self._resolve(wait=False)

    def drain(self, wait: bool = True) -> int:
        """Processes everything buffered so far; returns the number of calls resolved since the last drain, all of
        which have now reached every sink.

        Forwards whose device work is still running are read once it completes: waited for when ``wait``, else
        kept (in order) for a later drain, so the worker never blocks on a GPU. So are training steps whose
        ``rank_detail="auto"`` decision waits for the other ranks; those whose facts were not sent yet are kept even
        when ``wait`` (until their run's last step, or ``remove()``).
        """
        _replaced.sweep()  # modules replaced behind torch's registration hook stop being traced (one warning)
        with self._lock:
            self._resolve(wait)
            with self.deliver_lock:
                segments, self._unexported = self._unexported, []
                self._exporting_calls, self._unexported_calls = self._unexported_calls, 0
                resolved, self._resolved = self._resolved, 0
            try:
                self._deliver(self.exporters, Calls(segments))
            finally:
                with self.deliver_lock:
                    self._exporting_calls = 0
                    self._held_changed()
            return resolved

    def _held_changed(self) -> None:
        """The buffer's bound counts what this dispatcher holds too (not ready yet, waiting for the next drain, or in
        a request now): max_pending_calls in all, not once in the buffer and again here."""
        self.buffer.held_elsewhere = self._unexported_calls + self._exporting_calls + self._waiting_calls

    def _resolve(self, wait: bool) -> None:
        with self.deliver_lock:  # from now until they are delivered, later forwards wait behind them
            items = self._waiting + self.buffer.take_all()
            self._behind = bool(items)
        try:
            self._resolve_taken(items, wait)
        finally:  # whatever happened to them: forwards wait behind those still waiting only
            self._behind = bool(self._waiting)

    def _resolve_taken(self, items: list, wait: bool) -> None:
        ready = len(items)
        for position, item in enumerate(items):
            try:
                if _unsent(item) or not wait and not _ready(item):
                    ready = position
                    break
                if wait:
                    _wait_for_device(item)
            except Exception:  # the driver fails (a device fault): read below what can be, the rest logged, counted
                continue
        forwards, self._waiting = items[:ready], items[ready:]
        with self.deliver_lock:
            self._waiting_calls = sum(map(_calls_held, self._waiting))
            self._held_changed()
        segments: list[Sequence[ModuleCall]] = []  # a forward's columns, or a training step's calls
        for item in forwards:
            try:
                if isinstance(item, CallBatch):  # resolved by the hooks at the forward's end
                    segments.append(item)
                elif isinstance(item, StepRecord):
                    segments.extend(resolve_step(item, self.modules, self.step_bounds))
                else:
                    segments.append(resolve_forward(item, self.modules))
            except Exception:  # one unreadable forward must not take the batch (or the worker) with it
                self.sink_errors += 1
                _logger.exception("torchtrace: could not read a traced %s; its calls are lost", type(item).__name__)
        if self.step_bounds is not None:  # rank 0: the step roots every rank's bounds have reached
            segments.extend([root] for root in self.step_bounds.exchange(final=wait))
        if not segments:
            return
        calls = Calls(segments)
        if self.on_nonfinite is not None:
            for error in _errors(calls):
                if isinstance(error, NonFiniteError):
                    self._notify_nonfinite(error)
        with self.deliver_lock:
            self._deliver(self._in_process, calls)
            if self.exporters:
                self._unexported.extend(calls.segments)
                self._unexported_calls += len(calls)
                self._held_changed()
            self._resolved += len(calls)

    def _deliver(self, sinks: list[Sink], calls: Sequence[ModuleCall]) -> None:
        if not calls:
            return
        for sink in sinks:
            try:
                sink(calls)
            except Exception:
                self.sink_errors += 1
                _logger.exception("torchtrace: sink %r failed on %d calls", sink, len(calls))
