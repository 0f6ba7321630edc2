"""DDP training traced by torchtrace: one trace per step across all ranks, all-reduce spans, straggler metrics.

    torchrun --nproc-per-node=2 examples/ddp_train.py                 # CPU (gloo) or GPUs (nccl)
    OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 TORCHTRACE_METRICS_PORT=9464 torchrun ... # to a collector

Each rank exports its spans; rank 0 also sends the root span of each step. Every rank serves its metrics on
TORCHTRACE_METRICS_PORT + LOCAL_RANK. ``--delay-rank`` makes one rank slow (every step, or at ``--delay-step``), to
see it named the straggler; ``--nan-rank`` / ``--nan-step`` put a NaN in one rank's batch, to see where it started.
With TORCHTRACE_RANK_DETAIL=auto only those ranks (and rank 0) send their module spans of those steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtrace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--delay-rank", type=int, default=-1, help="this rank sleeps before each backward")
    parser.add_argument(
        "--delay-optimizer", action="store_true", help="the delayed rank sleeps before its optimizer step instead"
    )
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--delay-step", type=int, default=-1, help="only at this step (default: every step)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="every rank also works this long a step (sleeps)")
    parser.add_argument("--nan-rank", type=int, default=-1, help="this rank's batch holds a NaN at --nan-step")
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--linger", type=float, default=0.0, help="seconds to keep serving metrics after training")
    args = parser.parse_args()

    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every kernel of this rank on its own GPU
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)  # small buckets: several all-reduce spans per step
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    handle = torchtrace.instrument(ddp, backward=True, optimizer=optimizer)
    for step in range(args.steps):
        batch = torch.randn(32, 64, device=device)
        if rank == args.nan_rank and step == args.nan_step:
            batch[0, 0] = float("nan")  # spreads to every rank's parameters through the gradient all-reduce
        loss = ddp(batch).pow(2).mean()
        time.sleep(args.step_ms / 1000)  # a stand-in for a bigger model's compute
        delayed = rank == args.delay_rank and args.delay_step in (-1, step)
        if delayed and not args.delay_optimizer:
            time.sleep(args.delay_ms / 1000)  # arrives late at the all-reduce: the others wait for it
        loss.backward()
        if delayed and args.delay_optimizer:
            time.sleep(args.delay_ms / 1000)  # a slow optimizer: its step ends (and its next begins) after the others'
        optimizer.step()  # closes the step: its trace goes out
        optimizer.zero_grad()
    handle.remove()
    print(f"rank {rank}: {args.steps} steps traced, {handle.exported_spans} spans exported", flush=True)
    time.sleep(args.linger)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
