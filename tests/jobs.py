"""A torch.distributed job inside the test process, for what tracing does only in a job."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_job(run_id: str = "tests") -> Iterator[None]:
    """A one-rank gloo job in this process (Training(rank_detail="auto") decides on each step only in a job), ended
    on leaving."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHTRACE_RUN_ID", run_id)  # else a warning that step trace ids repeat
        dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
