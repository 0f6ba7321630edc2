"""Rank awareness: who this process is in a distributed job, and ids every rank derives alike without talking.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK and TORCHELASTIC_RUN_ID on every rank; torch.distributed,
once initialised, is the authority for rank and world size. The trace of step N is a hash of (run id, N), so all
ranks put their spans of step N in one trace under one root span with no communication.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass

import torch

from torchtrace.attributes import LOCAL_RANK, RANK, WORLD_SIZE

_logger = logging.getLogger(__name__)

ENV_RUN_ID = "TORCHTRACE_RUN_ID"  # overrides TORCHELASTIC_RUN_ID (set it the same on every rank)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    node: str
    run_id: str

    def resource_attributes(self) -> dict[str, str | int]:
        """Resource attributes of this rank. service.instance.id is fixed per (run, node, rank): the same after a
        fork (DataLoader workers), unlike the SDK's random default."""
        return {
            RANK: self.rank,
            LOCAL_RANK: self.local_rank,
            WORLD_SIZE: self.world_size,
            "host.name": self.node,
            "service.instance.id": f"{self.run_id}/{self.node}/rank-{self.rank}",
        }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def rank_info() -> RankInfo | None:
    """This process's place in a distributed job; None for a single process."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if initialized else _env_int("RANK")
    world_size = torch.distributed.get_world_size() if initialized else _env_int("WORLD_SIZE")
    if rank is None or not world_size or world_size < 2 and not initialized:
        return None
    elastic_run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    run_id = (
        os.environ.get(ENV_RUN_ID)
        # torchrun's default for multi-node jobs without --rdzv-id is the literal "none": every run would share it
        or (elastic_run_id if elastic_run_id != "none" else None)
        or (f"slurm-{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else None)
    )
    if not run_id:  # the rendezvous address: shared by the ranks, but often by every run of the job too
        run_id = f"{os.environ.get('MASTER_ADDR', 'local')}:{os.environ.get('MASTER_PORT', '0')}"
        _warn_reused_run_id(run_id)
    local_rank = _env_int("LOCAL_RANK")
    return RankInfo(rank, rank if local_rank is None else local_rank, world_size, socket.gethostname(), run_id)


_warned_run_id = False


def _warn_reused_run_id(run_id: str) -> None:
    global _warned_run_id
    if not _warned_run_id:
        _warned_run_id = True
        _logger.warning(
            "torchtrace: no run id (TORCHTRACE_RUN_ID, torchrun --rdzv-id, SLURM_JOB_ID): step trace ids derive from "
            "%s and repeat in every run started with that address; set TORCHTRACE_RUN_ID to a per-run value",
            run_id,
        )


def derived_id(bits: int, *parts: object) -> int:
    """A non-zero id of ``bits`` bits that every rank computes alike from the same parts."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=bits // 8).digest()
    return int.from_bytes(digest, "big") or 1
