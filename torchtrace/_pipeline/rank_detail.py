"""Which ranks send module spans for a training step under ``Training(rank_detail="auto")``.

Every rank sends its step span and its phases (its data wait, the forward and backward roots, the optimizer step,
each all-reduce bucket) every traced step. A rank's module spans of a step are sent only where they explain it: a
rank of ``detail_ranks``; the step's straggler (the rank the others waited for at the gradient all-reduce: its own
wait the shortest, the waits spread by more than ``STRAGGLER_FRACTION`` of the step and ``STRAGGLER_MIN_S``); the
rank where a NaN/Inf started (in its forward outputs or its gradients before the all-reduce, in a step after one
where no rank saw any: after the all-reduce every rank has it); a rank whose forward raised; with
``rotating_detail``, ranks in turn, chosen by the count of traced steps (no communication).

What the other ranks saw comes from all-gathers of four numbers per rank and traced step, started at a step's end on
the training thread (never in a hook) and left running, on a gloo group made for it at ``instrument()``. Any
collective costs a loop about half a millisecond on a busy host, so one all-gather carries a run of traced steps:
1, 2, 4, ... up to ``GATHER_STEPS_MAX`` (every rank counts the same traced steps, so all call it at the same step).
A step's module records wait on the worker for their run's gather (a flush too leaves them waiting: a collective
started by one rank's flush could wait for ranks that never flush there). At ``remove()`` the open run is gathered
at once, padded to ``GATHER_STEPS_MAX`` steps so that ranks removing at different steps still pair up, and waited
for at most ``CLOSE_WAIT``; where it is not complete by then, each rank decides those steps from what it knows.
"""

from __future__ import annotations

import collections
import datetime
import logging
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchtrace._capture.recorder import ERROR
from torchtrace._capture.steps import DetailDecision, StepRecord
from torchtrace._core import signals as _signals
from torchtrace._core.ranks import RankInfo

AUTO_FROM_WORLD_SIZE = 64  # "auto" is the default from here: ranks x modules spans a step is past what UIs draw
STRAGGLER_FRACTION = 0.25  # a wait spread below this share of the step (or STRAGGLER_MIN_S) is noise, not a straggler
STRAGGLER_MIN_S = 0.01
GATHER_STEPS_MAX = 16  # the longest run of traced steps one all-gather carries: a 16th of its cost a step
GATHER_TIMEOUT = datetime.timedelta(seconds=60)  # a rank that never reaches the step's end must not hang the others
CLOSE_WAIT = datetime.timedelta(seconds=5)  # remove(): ranks that go on training (or are gone) never join the last run
# What each rank tells the others at a step's end (a float each; -1: not known)
COMM_WAIT, STEP_SECONDS, NONFINITE, RAISED = 0, 1, 2, 3

_logger = logging.getLogger(__name__)


def policy_for(rank_detail: str | None, rank: RankInfo | None) -> str:
    """The policy in force: the option, else ``auto`` from ``AUTO_FROM_WORLD_SIZE`` ranks; ``all`` outside a job."""
    if rank is None:
        return "all"
    if rank_detail is not None:
        return rank_detail
    return "auto" if rank.world_size >= AUTO_FROM_WORLD_SIZE else "all"


def reasons(
    facts: Sequence[Sequence[float]],
    rank: int,
    detail_ranks: frozenset[int],
    nonfinite_before: bool,
    rotation: bool = False,
) -> tuple[str, ...]:
    """Why ``rank`` sends its module spans of a step, given every rank's facts (empty: it sends none); ``rotation``:
    its turn of ``rotating_detail``."""
    found = []
    if rank in detail_ranks:
        found.append("rank")
    if rotation:
        found.append("rotation")
    waits = [fact[COMM_WAIT] for fact in facts]
    if len(facts) > 1 and min(waits) >= 0:
        typical_step = statistics.median(fact[STEP_SECONDS] for fact in facts)
        spread = max(waits) - min(waits)
        if spread > max(STRAGGLER_FRACTION * typical_step, STRAGGLER_MIN_S) and waits.index(min(waits)) == rank:
            found.append("straggler")
    if facts[rank][NONFINITE] > 0 and not nonfinite_before:
        found.append("nonfinite")
    if facts[rank][RAISED] > 0:
        found.append("raised")
    return tuple(found)


def step_facts(record: StepRecord, nonfinite: bool | None) -> list[float]:
    """This rank's facts of a step: its all-reduce wait, the step's length, whether NaN/Inf started in its forward or
    gradients (``nonfinite``; None: not known on the host without a device sync, counted as no), whether a forward
    raised."""
    wait = sum(end - start for _, _, start, end, *_ in record.comm) / 1e9 if record.comm else -1.0
    raised = any(extras[ERROR] is not None for forward in record.forwards for extras in forward.extras.values())
    return [wait, (record.end_ns - record.start_ns) / 1e9, float(bool(nonfinite)), float(raised)]


class _Run:
    """The traced steps one all-gather carries: this rank's facts of each, then every rank's once gathered."""

    __slots__ = ("mine", "sent", "work", "wait_for", "gathered", "facts")

    def __init__(self) -> None:
        self.mine: list[list[float]] = []
        self.sent = False  # the gather was started (or could not be: then ``work`` stays None)
        self.work: Any = None
        self.wait_for: datetime.timedelta | None = None  # at most, once closed (None: the group's timeout)
        self.gathered: list[torch.Tensor] = []
        self.facts: list[list[list[float]]] | None = None  # [step][rank] -> facts, once read


class StepDecision:
    """Why this rank sends its module spans of one traced step (``reasons``), read once on the worker, steps in
    order, once its run's gather was started (``sent()``); ``ready()``: read now, it would not wait for it."""

    __slots__ = ("_policy", "_run", "_index", "_turn")

    def __init__(self, policy: RankDetail, run: _Run, index: int, turn: bool) -> None:
        self._policy, self._run, self._index, self._turn = policy, run, index, turn

    def sent(self) -> bool:
        return self._run.sent

    def ready(self) -> bool:
        run = self._run
        return run.sent and (run.work is None or run.facts is not None or run.work.is_completed())

    def __call__(self) -> tuple[str, ...]:
        return self._policy._decide(self._run, self._index, self._turn)


class _Made:
    """A decision made already."""

    __slots__ = ("reasons",)

    def __init__(self, reasons: tuple[str, ...]) -> None:
        self.reasons = reasons

    def sent(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def __call__(self) -> tuple[str, ...]:
        return self.reasons


class RankDetail:
    """The ``auto`` policy of one handle on one rank. At each traced step's end ``start()`` keeps this rank's facts
    of the step and gives it its decision to read later; at the end of a run of steps it sends the run's facts to the
    others (one all-gather, left running: the training thread goes on; on a gloo group of its own, so it never
    interleaves with the job's collectives). The worker reads a step's decision once its run was sent, waiting for
    the gather there; ``close()`` sends the open run at ``remove()`` and at SIGTERM."""

    def __init__(self, rank: RankInfo, detail_ranks: Sequence[int], rotating: int = 0) -> None:
        self.rank = rank.rank
        self.world_size = rank.world_size
        self.detail_ranks = frozenset(detail_ranks)
        self.rotating = rotating
        self._decided = 0  # traced steps decided so far: the same count on every rank (the schedule is shared)
        self.nonfinite_before = False  # some rank saw NaN/Inf at the previous traced step
        self._failed = False
        self._run = _Run()
        self._run_steps = 1  # the open run's length: doubles after each run, to GATHER_STEPS_MAX
        self._unread: collections.deque[_Run] = collections.deque()  # sent runs the worker has not read yet
        # Made here, where every rank calls instrument() at the same point of its program (a group made later could
        # interleave with the job's own group creations).
        self._group = None
        try:
            if not dist.is_initialized():
                raise RuntimeError("no torch.distributed process group")
            self._group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)
        except Exception as error:  # each rank on its own, from what it sees itself
            self._give_up(error)

    @_signals.guarded  # a SIGTERM's flush closes the open run: not while it changes here
    def start(self, record: StepRecord, nonfinite: bool | None) -> StepDecision:
        """Keeps this rank's facts of ``record`` for the others (sent with the run's last step); the reasons for its
        module spans, to read later."""
        run = self._run
        run.mine.append(step_facts(record, nonfinite))
        decision = StepDecision(self, run, len(run.mine) - 1, self._rotation_turn())
        if len(run.mine) == self._run_steps:
            self._send(run)
            self._run = _Run()
            self._run_steps = min(2 * self._run_steps, GATHER_STEPS_MAX)
        return decision

    def close(self, wait: datetime.timedelta = CLOSE_WAIT) -> None:
        """At ``remove()`` (and at SIGTERM, which every rank of a job gets): the open run's gather started now,
        padded to ``GATHER_STEPS_MAX`` steps. Its decisions, and those of runs sent before and not read yet (a rank
        that stopped a run short never joins their gathers), wait for them at most ``wait``."""
        run = self._run
        if run.mine:
            self._run = _Run()
            self._send(run, rows=GATHER_STEPS_MAX)
        for unread in list(self._unread):
            unread.wait_for = wait

    def alone(self) -> DetailDecision:
        """The decision of a step the other ranks may never close with this one (at ``remove()``): no gather."""
        return _Made(("rank",) * (self.rank in self.detail_ranks) + ("rotation",) * self._rotation_turn())

    def _rotation_turn(self) -> bool:
        """Whether this traced step is this rank's turn of ``rotating_detail`` (counts the step)."""
        first = self._decided * self.rotating % self.world_size
        self._decided += 1
        return (self.rank - first) % self.world_size < self.rotating

    def _send(self, run: _Run, rows: int = 0) -> None:
        if not self._failed:
            unknown = [[-1.0, 0.0, 0.0, 0.0]] * (rows - len(run.mine))  # padding: no wait known, no NaN, no error
            mine = torch.tensor(run.mine + unknown, dtype=torch.float64)
            run.gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
            try:
                run.work = dist.all_gather(run.gathered, mine, group=self._group, async_op=True)
            except Exception as error:
                self._give_up(error)
        while self._unread and self._unread[0].work is None:  # read: the worker reads runs in order
            self._unread.popleft()
        if run.work is not None:
            self._unread.append(run)
        run.sent = True  # last: the worker, reading the run's steps meanwhile, finds its work there once it is sent

    def _decide(self, run: _Run, index: int, turn: bool) -> tuple[str, ...]:
        mine = run.mine[index]
        if run.facts is None and run.work is not None and not self._failed:  # failed: alone from then on, at once
            try:
                if run.wait_for is None:
                    run.work.wait()
                else:
                    run.work.wait(run.wait_for)
                by_rank = [tensor.tolist() for tensor in run.gathered]
                run.facts = [[facts[step] for facts in by_rank] for step in range(len(run.mine))]
            except Exception as error:
                self._give_up(error)
            run.work = None
        if run.facts is None:  # on its own, from what it knows of itself: no straggler
            own = frozenset({0}) if self.rank in self.detail_ranks else frozenset()
            decided = reasons([mine], 0, own, self.nonfinite_before, turn)
            self.nonfinite_before = mine[NONFINITE] > 0
            return decided
        facts = run.facts[index]
        decided = reasons(facts, self.rank, self.detail_ranks, self.nonfinite_before, turn)
        self.nonfinite_before = any(fact[NONFINITE] > 0 for fact in facts)
        return decided

    def _give_up(self, error: BaseException) -> None:
        """A rank gone, a timeout: detail from what this rank knows, from now on."""
        if not self._failed:
            self._failed = True
            _logger.warning("torchtrace: rank detail: the ranks' step facts could not be gathered (%s); each rank "
                            "decides on its own from now on (no straggler detail)", error)  # fmt: skip
