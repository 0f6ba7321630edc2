"""Overhead of tracing a DDP training step: identical DDP models in one torchrun job, stepped alternately.

    python benchmarks/ddp.py [--ranks 2] [--steps 40] [--exporter otlp|none] [--breakdown]  # torchrun, gloo on CPU

Model A is plain DDP; model B is the same under torchtrace.instrument(backward=True, optimizer=..., stats on),
exporting OTLP/HTTP to a local discard receiver in another process (--exporter none: records only). Steps are
timed in blocks of 20 (fewer if --steps is smaller), a traced model's block ending with handle.flush(), so its
export is inside the timed window (as overhead.py's 20 forwards and a flush). Blocks alternate A, B, A, B so machine
noise hits both alike; the first block of each is warm-up; medians of the blocks' time per step. Rank 0 prints a
table and, last, one JSON line: {"ddp": {"world_size", "steps", "exporter", "plain_ms", "traced_ms", "x_plain",
"spans_per_step", "failed_spans", "variants"}} (failed_spans: rank 0's; variants: x plain of each model run).

--breakdown adds, in the same rotation, what each part of the traced step costs: DDP with torch's own Python
all-reduce comm hook (the least any per-bucket timing costs: DDP's default hook runs in C++), forward spans alone,
forward spans with statistics, forward and backward spans without statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torchtrace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 20  # steps timed together, the traced model's flush at the end of them
# --breakdown: the traced step's parts, each a model of its own (instrument()'s keywords; backward=True unless said)
BREAKDOWN = {
    "python_comm_hook": None,
    "forward_spans": {"backward": False, "stats": False},
    "forward_stats": {"backward": False},
    "backward_spans": {"stats": False},
}


def worker(steps: int, exporter: str, breakdown: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(256, 256), nn.ReLU())])
        ddp = DistributedDataParallel(model, bucket_cap_mb=1)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)

    runs = {"plain": None, "traced": {}, **(BREAKDOWN if breakdown else {})}
    models = {}
    spans = [0]  # of the traced model, as its sinks get them (under rank_detail="auto", a run of steps late)
    for name, options in runs.items():
        model, optimizer = make()
        handle = None
        if name == "python_comm_hook":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif options is not None:
            options = {"backward": True, **options}
            if name == "traced":
                options["sinks"] = [lambda calls: spans.__setitem__(0, spans[0] + len(calls))]
            handle = torchtrace.instrument(model, exporter=exporter, optimizer=optimizer, **options)
        models[name] = model, optimizer, handle
    handle = models["traced"][2]
    x = torch.randn(64, 256)
    times: dict[str, list[float]] = {name: [] for name in models}
    block = min(steps, BLOCK)
    for round_index in range(1 + steps // block):  # the first block of each model: warm-up, not timed
        for name, (model, optimizer, traced_by) in models.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(block):
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            if traced_by is not None:
                traced_by.flush()  # export work inside the timed window, once a block (overhead.py: 20 forwards)
            if round_index:
                times[name].append((time.perf_counter() - start) * 1e3 / block)
    for _, _, traced_by in models.values():
        if traced_by is not None:
            traced_by.remove()
    spans_per_step = spans[0] / (block * (1 + steps // block))
    failed = handle.failed_spans  # a failing export is cheap: its numbers would mean nothing
    if rank == 0:
        medians = {name: statistics.median(times[name]) for name in times}
        plain_ms, traced_ms = medians["plain"], medians["traced"]
        print(f"DDP step, {dist.get_world_size()} ranks (gloo, CPU), {steps} steps each, interleaved")
        for name, median in medians.items():
            print(f"  {name:18s} {median:8.3f} ms/step  ({median / plain_ms:.3f}x)")
        print(f"  traced: ~{spans_per_step:.0f} spans per step, exporter {exporter}, {failed} spans failed to export")
        result = {"world_size": dist.get_world_size(), "steps": steps, "exporter": exporter,
                  "plain_ms": round(plain_ms, 3), "traced_ms": round(traced_ms, 3),
                  "x_plain": round(traced_ms / plain_ms, 3), "spans_per_step": round(spans_per_step, 1),
                  "failed_spans": failed,
                  "variants": {name: round(median / plain_ms, 3) for name, median in medians.items()}}  # fmt: skip
        print(json.dumps({"ddp": result}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--exporter", choices=("otlp", "none"), default="otlp")
    parser.add_argument("--breakdown", action="store_true", help="also time the traced step's parts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.exporter, args.breakdown)
        return 0
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    if args.exporter == "none":
        return launch(args, env)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from overhead import discard_receiver  # a receiver in its own process: it must not take the ranks' GIL

    with discard_receiver("http/protobuf") as endpoint:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        return launch(args, env)


def launch(args: argparse.Namespace, env: dict[str, str]) -> int:
    with socket.socket() as probe:  # torchrun's static rendezvous needs a concrete port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", f"--master-port={port}",
               os.path.abspath(__file__), "--worker", f"--steps={args.steps}",
               f"--exporter={args.exporter}", *(["--breakdown"] if args.breakdown else [])]  # fmt: skip
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
