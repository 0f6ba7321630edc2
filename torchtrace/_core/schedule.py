"""Which training steps are traced: a plain function ``step -> bool``, like torch.profiler's schedule."""

from __future__ import annotations

from collections.abc import Callable

StepSchedule = Callable[[int], bool]  # step number (from 0) -> trace this step?


def schedule(
    *, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 0, skip_first: int = 0, skip_first_wait: int = 0
) -> StepSchedule:
    """torch.profiler.schedule's cycle: skip ``skip_first`` steps, then repeat ``wait`` + ``warmup`` untraced
    steps (warmup is kept so a profiler schedule carries over unchanged) and ``active`` traced steps;
    ``repeat=0`` repeats forever; ``skip_first_wait`` (non-zero) leaves out the first cycle's wait.
    """
    for name, value in (
        ("wait", wait),
        ("warmup", warmup),
        ("skip_first", skip_first),
        ("repeat", repeat),
        ("skip_first_wait", skip_first_wait),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"schedule: {name} must be an integer >= 0, got {value!r}")
    if isinstance(active, bool) or not isinstance(active, int) or active < 1:
        raise ValueError(f"schedule: active must be an integer >= 1, got {active!r}")
    cycle = wait + warmup + active

    def traced(step: int) -> bool:
        if step < skip_first:
            return False
        step -= skip_first
        if skip_first_wait:
            step += wait  # as torch.profiler does: the first cycle starts at its warmup
        if repeat and step >= cycle * repeat:
            return False
        return step % cycle >= wait + warmup

    return traced


def every(n: int) -> StepSchedule:
    """Trace every ``n``-th step, starting with step 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every: n must be an integer >= 1, got {n!r}")

    def traced(step: int) -> bool:
        return step % n == 0

    traced.__qualname__ = traced.__name__ = f"every({n})"  # how `torchtrace config` shows it
    return traced


def always(step: int) -> bool:
    return True


def sampled(every_n: int = 1, ratio: float = 1.0) -> StepSchedule:
    """``sample_every`` / ``sample_ratio`` as a step schedule (step tracing decides per step, not per forward):
    every ``every_n``-th step, and of those about ``ratio``, chosen by the step number alone, so that every rank of
    a job traces the same steps without a word between them."""

    def traced(step: int) -> bool:
        if step % every_n:
            return False
        return ratio >= 1.0 or ((step * _GOLDEN) & _MASK) / (_MASK + 1) < ratio

    traced.__qualname__ = traced.__name__ = f"sampled(every={every_n}, ratio={ratio})"
    return traced


_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: consecutive steps spread evenly over [0, 1)
_MASK = (1 << 64) - 1
