"""DDP communication: a span per gradient-bucket all-reduce, by wrapping the comm hook DDP calls per bucket.

DDP calls its comm hook when a bucket of gradients is ready and waits on the returned future. Timing from the
call to the future's completion is this rank's wait for that bucket: a rank that arrives late (the straggler)
finds the others ready and waits least. On CUDA the future completes before the kernels do, so the span is timed
with events instead: one on the gradients' stream before the all-reduce is launched, one recorded from the
future's callback, on a stream that waits for the all-reduce's kernels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

_logger = logging.getLogger(__name__)

CommHook = Callable[[Any, Any], torch.futures.Future]  # (state, GradBucket) -> Future[Tensor]


def is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


class CommTarget:
    """Where a DDP model's timing comm hook records: the step tracker of the handle tracing the model now, or
    nowhere after ``remove()``. DDP takes one comm hook for good, so a later handle of the same model takes
    this target over instead of registering another hook."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps

    @property
    def timer(self) -> Any:
        steps = self.steps
        return steps.timer if steps is not None else None

    def record_comm(self, *bucket: Any) -> None:
        steps = self.steps
        if steps is not None:
            steps.record_comm(*bucket)


def watch_ddp(model: torch.nn.Module, steps: Any, inner: CommHook | None = None, inner_state: Any = None) -> bool:
    """Registers a timing comm hook on a DDP model (default all-reduce unless ``inner`` is given), or takes over
    the one an earlier handle registered.

    DDP accepts one comm hook, before the first backward: a model that already has one keeps it, untimed (pass
    your hook as ``inner`` through :func:`timed_comm_hook` to have both).
    """
    target = getattr(model, "_torchtrace_comm", None)
    if isinstance(target, CommTarget):
        target.steps = steps
        return True
    target = CommTarget(steps)
    try:
        # the default all-reduce runs over the DDP model's own group (it may be a sub-group)
        state = inner_state if inner is not None else getattr(model, "process_group", None)
        hook, state = timed_comm_hook(target, inner, state)
        model.register_comm_hook(state, hook)
    except (RuntimeError, ValueError) as error:  # a hook is already registered, or backward already ran
        _logger.warning("torchtrace: all-reduce spans are off for this DDP model: %s", error)
        return False
    model._torchtrace_comm = target
    model.register_comm_hook = _refuse_another_comm_hook  # DDP's own error would not say what to do instead
    return True


def _refuse_another_comm_hook(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "torchtrace registered this DDP model's communication hook, and DDP takes one: pass yours to "
        "instrument(ddp, training=torchtrace.Training(comm_hook=(hook, state))) instead (torchtrace then runs and "
        "times it)"
    )


def unwatch_ddp(model: torch.nn.Module, steps: Any) -> None:
    """After ``remove()``: the comm hook (DDP keeps it) records nothing more."""
    target = getattr(model, "_torchtrace_comm", None)
    if isinstance(target, CommTarget) and target.steps is steps:
        target.steps = None


def timed_comm_hook(steps: Any, inner: CommHook | None = None, inner_state: Any = None) -> tuple[CommHook, Any]:
    """(hook, state) for ``ddp.register_comm_hook(state, hook)``: runs ``inner`` (default: DDP's all-reduce, then the
    average, over the process group ``inner_state`` or the default group) and records each bucket's all-reduce in
    the current step.

    The default is torch's ``allreduce_hook`` done here: its result and the timing then come from one callback on
    the communication thread instead of two chained ones (each waits for the GIL there, and delays the buckets
    queued behind it: ~35 us a callback, measured with gloo)."""

    def hook(state, bucket):  # noqa: ANN001 -- DDP rejects annotations other than the real classes
        timer = steps.timer  # CUDA: the step's event timer
        start = time.perf_counter_ns()
        start_mark = timer.mark() if timer is not None else None  # on the stream that produced the gradients
        if inner is None:
            group = state if state is not None else torch.distributed.group.WORLD
            averaged = bucket.buffer().div_(group.size())
            future = torch.distributed.all_reduce(averaged, group=group, async_op=True).get_future()
        else:
            future = inner(state, bucket)
        index, size, is_last = (
            bucket.index(),
            bucket.buffer().numel() * bucket.buffer().element_size(),
            bucket.is_last(),
        )

        def finished(done: torch.futures.Future) -> Any:
            # CUDA futures run this on a stream that waits for the all-reduce kernels: the mark is their end
            end_mark = timer.mark() if timer is not None else None
            steps.record_comm(index, size, start, time.perf_counter_ns(), is_last, (start_mark, end_mark))
            return done.value()[0] if inner is None else done.value()  # all_reduce's future holds [tensor]

        return future.then(finished)

    return hook, inner_state
