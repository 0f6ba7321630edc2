"""Rank 0's ``train_step`` root spans every rank's step: the ranks send it their step spans' bounds.

A rank's step runs from the end of its previous step to the end of its optimizer step, so the ranks of a job start
and end a step apart (their optimizer steps differ; across machines, their clocks too), and a root timed on rank 0
alone would leave other ranks' steps hanging outside it. Each rank other than 0 sends the bounds of its ``rank N``
spans (as exported: after their spans are placed, on the device clock too) to rank 0 through the job's own store
(the ``TCPStore`` torchrun and ``init_process_group`` set up), one queue message per worker pass however many steps
it resolved, every ``EXCHANGE_EVERY_S`` at most (``PER_RANK_S`` a rank in a large job): no collective, nothing on
the model's thread. Rank 0 holds each root until every rank's bounds of its step arrived, then sends it spanning
all of them; a rank that never reports (gone, or one that never called ``instrument()``) holds it
``RELEASE_AFTER_S`` at most, with one warning. At ``flush()`` and ``remove()`` rank 0 waits ``FINAL_WAIT_S`` at most
for the bounds of the steps it holds, from every rank (a rank's first report can come after rank 0's first steps
were resolved), except those that were waited for before and never reported: a job with ranks that do not
instrument pays that wait once, not at every flush.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch.distributed as dist

from torchtrace._core.calls import ModuleCall
from torchtrace._core.ranks import RankInfo

RELEASE_AFTER_S = 10.0  # a root waits this long for a rank's bounds at most (a rank gone, a rank never instrumented)
FINAL_WAIT_S = 2.0  # at flush() and remove(): how long rank 0 waits for the others' last reports
# a store round trip is a wake-up of the process serving it: a rank sends, and rank 0 reads, this often at most
# (roots go out up to twice this late), whatever the step rate; in a large job less often, so that rank 0 reads about
# one message a PER_RANK_S (its worker pops each rank's messages one by one)
EXCHANGE_EVERY_S = 0.05
PER_RANK_S = 0.001
_POLL_S = 0.001

_logger = logging.getLogger(__name__)


def job_store() -> Any:
    """The store of the default process group (a TCPStore under torchrun), or None outside one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return default_store() if default_store is not None else None
    except Exception:
        return None


class StepBounds:
    """One handle's side of the exchange on one rank (``key``: the same on every rank for the same model)."""

    def __init__(self, rank: RankInfo, store: Any, key: str) -> None:
        self.rank = rank.rank
        self.others = rank.world_size - 1
        self._other_ranks = frozenset(range(1, rank.world_size))
        self._store = store
        self._key = key
        self._failed = False
        self._warned_missing = False
        self._outgoing: list[tuple[int, int, int]] = []  # (step, start ns, end ns) not yet sent
        # rank 0: held roots by step, (root, held since, ranks reported), and reports of steps not yet held
        self._held: dict[int, tuple[ModuleCall, float, set[int]]] = {}
        self._early: dict[int, list[tuple[int, int, int]]] = {}
        self._released_to = -1  # the newest step whose root was sent
        self._reporters: set[int] = set()  # the ranks heard from so far
        self._silent: set[int] = set()  # ranks never heard from after a wait for them: not waited for at a flush
        self._last_exchange = 0.0  # monotonic
        self._every_s = max(EXCHANGE_EVERY_S, rank.world_size * PER_RANK_S)

    def step_resolved(self, step: int, root: ModuleCall | None, start_ns: int, end_ns: int) -> bool:
        """A step of this rank was resolved, its step span from ``start_ns`` to ``end_ns``. Rank 0 passes its root:
        True if it is held here (``exchange()`` returns it once complete). Other ranks' bounds go out at the end of
        the worker's pass (``exchange()``)."""
        if self._failed:
            return False
        if self.rank != 0:
            self._outgoing.append((step, start_ns, end_ns))
            return False
        if root is None:
            return False
        reported: set[int] = set()
        for rank, start, end in self._early.pop(step, ()):
            _widen(root, start, end)
            reported.add(rank)
        self._held[step] = (root, time.monotonic(), reported)
        return True

    def pending(self) -> bool:
        """Whether roots are held or bounds wait to be sent: the worker keeps passing."""
        return bool(self._held or self._outgoing)

    def exchange(self, final: bool = False) -> list[ModuleCall]:
        """Once a worker pass: send this rank's bounds (ranks other than 0); read the others' and return the roots
        now complete (rank 0). ``final`` (``flush()``, ``remove()``): every held root, once every rank not found
        silent before sent its bounds of it (``FINAL_WAIT_S`` at most)."""
        now = time.monotonic()
        due = final or now - self._last_exchange >= self._every_s
        try:
            if self.rank != 0:
                if due and self._outgoing:
                    self._last_exchange = now
                    self._send()
                return []
            if not (due and self._held):
                return self._ready(everything=self._failed)
            self._last_exchange = now
            self._receive()
            deadline = time.monotonic() + FINAL_WAIT_S
            awaited = (self._other_ranks - self._silent) | self._reporters
            while final and any(awaited - seen for _, _, seen in self._held.values()):
                if time.monotonic() >= deadline:
                    self._found_silent()
                    break
                time.sleep(_POLL_S)
                self._receive()
        except Exception as error:  # a store without queues (a FileStore), the store gone: rank 0's own bounds
            self._give_up(error)
        return self._ready(everything=final or self._failed)

    def _send(self) -> None:
        if not self._failed:
            message = json.dumps([self.rank, self._outgoing]).encode()
            self._outgoing = []
            self._store.queue_push(self._key, message)

    def _receive(self) -> None:
        if self._failed:
            return
        while True:  # not queue_len(): it holds the GIL for its round trip, queue_pop does not
            try:
                message = self._store.queue_pop(self._key, False)
            except dist.QueueEmptyError:
                return
            rank, bounds = json.loads(message)
            self._reporters.add(rank)
            for step, start, end in bounds:
                held = self._held.get(step)
                if held is None:
                    self._early.setdefault(step, []).append((rank, start, end))
                else:
                    _widen(held[0], start, end)
                    held[2].add(rank)

    def _ready(self, everything: bool) -> list[ModuleCall]:
        now = time.monotonic()
        ready = []
        for step, (root, since, seen) in list(self._held.items()):
            late = now - since > RELEASE_AFTER_S
            if everything or late or len(seen) >= self.others:
                if late and len(seen) < self.others:
                    self._found_silent()
                if late and not self._warned_missing and len(seen) < self.others:
                    self._warned_missing = True
                    _logger.warning("torchtrace: step %d: %d of %d other ranks sent no step bounds in %.0f s (does "
                                    "every rank call instrument()?); its train_step spans the ranks that did",
                                    step, self.others - len(seen), self.others, RELEASE_AFTER_S)  # fmt: skip
                del self._held[step]
                ready.append(root)
                self._released_to = max(self._released_to, step)
        for step in [step for step in self._early if step <= self._released_to]:  # rank 0 resolves steps in order:
            del self._early[step]  # a step up to the last released that is not held now never will be
        return ready

    def _found_silent(self) -> None:
        """Waited for in vain: the ranks never heard from (gone, or not instrumenting) are not waited for at a flush
        again (one that reports later is)."""
        self._silent |= self._other_ranks - self._reporters

    def _give_up(self, error: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self._outgoing = []
            _logger.warning("torchtrace: the ranks' step bounds could not be exchanged through the job's store (%s); "
                            "train_step spans rank 0's step only", error)  # fmt: skip


def _widen(root: ModuleCall, start_ns: int, end_ns: int) -> None:
    root.start_ns = min(root.start_ns, start_ns)
    root.end_ns = max(root.end_ns, end_ns)
