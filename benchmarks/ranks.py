"""Spans, bytes and metric series a traced training job makes per rank as the world grows, rank detail "all" / "auto".

    python benchmarks/ranks.py [--ranks 2,4,8,16] [--steps 6]   # real torchrun jobs (gloo, CPU) on this machine

Each job: DDP over 12 x (Linear(32, 32) + ReLU), backward spans and the optimizer traced, every rank writing its
own OTLP/JSON trace file and serving its Prometheus metrics (``metrics=True``, ``serve_metrics(port=0)``); one rank
arrives late at one step (a straggler) and a NaN starts on another rank at a later step. For each world size and
policy: spans and bytes per step per rank (median over ranks, and the largest), in total per step, and the median
step time (rank 0, steps after the first). Series: after its last step each rank scrapes its own /metrics over HTTP
(as Prometheus would) and writes the text next to its trace file; counted are its ``torchtrace_*`` samples
(prometheus_client's own process / gc series left out), for rank 0 (the detail rank) and the others (median and
largest: the straggler and the NaN's rank are among them). The last line is one JSON object. From the measured
per-rank figures, the spans a step holds and the series a job exposes at 64, 256 and 1,000 ranks (the formulas are
printed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRAGGLER_STEP, NAN_STEP = 2, 4  # step 0 warms up; the NaN step comes last but one: it spreads to every rank after
DELAY_S = 0.4
STEP_S = 0.05  # every rank's own work a step (a sleep), so a straggler stands out of the noise of a shared host


def worker(steps: int, trace_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, ROOT)
    import torchtrace

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(12) for layer in (nn.Linear(32, 32), nn.ReLU())])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    handle = torchtrace.instrument(
        ddp, exporter="file", trace_file=os.path.join(trace_dir, f"rank{rank}.jsonl"), backward=True,
        optimizer=optimizer, metrics=True,
    )  # fmt: skip
    server = torchtrace.serve_metrics(port=0)  # this rank's endpoint, as TORCHTRACE_METRICS_PORT + LOCAL_RANK
    straggler, nan_rank = 1 % world, world - 1
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x = torch.randn(16, 32)
        if rank == nan_rank and step == NAN_STEP:
            x[0, 0] = float("nan")
        loss = ddp(x).pow(2).mean()
        time.sleep(STEP_S + (DELAY_S if rank == straggler and step == STRAGGLER_STEP else 0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    handle.remove()  # everything delivered; the sink's last values stay exposed for a final scrape
    with urllib.request.urlopen(server.url, timeout=30) as response:  # a real scrape of this rank's endpoint
        scraped = response.read().decode()
    server.shutdown()
    with open(os.path.join(trace_dir, f"rank{rank}.metrics.txt"), "w", encoding="utf-8") as out:
        out.write(scraped)
    with open(os.path.join(trace_dir, f"rank{rank}.times.json"), "w", encoding="utf-8") as out:  # not stdout: ranks
        json.dump(times, out)  # print at once, and torchrun interleaves their lines
    dist.destroy_process_group()


def _spans_in(path: str) -> int:
    count = 0
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            for resource in json.loads(line).get("resourceSpans", []):
                for scope in resource.get("scopeSpans", []):
                    count += len(scope.get("spans", []))
    return count


def series_in(text: str) -> int:
    """Samples of torchtrace's families in one scrape: each is a series in Prometheus (prometheus_client's own
    process / platform / gc series, the same on every process, left out)."""
    return sum(1 for line in text.splitlines() if line.startswith("torchtrace_"))


def run(ranks: int, steps: int, policy: str) -> dict:
    with tempfile.TemporaryDirectory() as trace_dir, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHTRACE_RANK_DETAIL=policy, TORCHTRACE_PRINT_SUMMARY="false",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))  # fmt: skip
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}",
                   os.path.abspath(__file__), "--worker", f"--steps={steps}", f"--trace-dir={trace_dir}"]  # fmt: skip
        subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
        with open(os.path.join(trace_dir, "rank0.times.json"), encoding="utf-8") as times:
            rank0_step_s = json.load(times)
        spans = [_spans_in(os.path.join(trace_dir, f"rank{rank}.jsonl")) / steps for rank in range(ranks)]
        sizes = [os.path.getsize(os.path.join(trace_dir, f"rank{rank}.jsonl")) / steps for rank in range(ranks)]
        series = []
        for rank in range(ranks):
            with open(os.path.join(trace_dir, f"rank{rank}.metrics.txt"), encoding="utf-8") as scraped:
                series.append(series_in(scraped.read()))
    return {
        "ranks": ranks, "policy": policy,
        "spans_per_rank_step": round(statistics.median(spans), 1), "max_spans_per_rank_step": round(max(spans), 1),
        "bytes_per_rank_step": round(statistics.median(sizes)), "spans_per_step": round(sum(spans), 1),
        "bytes_per_step": round(sum(sizes)), "step_ms": round(statistics.median(rank0_step_s[1:]) * 1e3, 2),
        # rank 0 is the detail rank (detail_ranks' default); the others include the straggler and the NaN's rank
        "series_rank0": series[0], "series_per_other_rank": statistics.median(series[1:]),
        "max_series_other_rank": max(series[1:]), "series_total": sum(series),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8,16", help="comma-separated world sizes")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.trace_dir)
        return 0
    rows = [run(int(ranks), args.steps, policy) for ranks in args.ranks.split(",") for policy in ("all", "auto")]
    print(f"{'ranks':>5} {'policy':>6} {'spans/rank/step':>15} {'max':>6} {'bytes/rank/step':>15} "
          f"{'spans/step':>10} {'bytes/step':>11} {'step ms':>8} {'series r0':>9} {'series other':>12} {'max':>5} "
          f"{'series':>7}")  # fmt: skip
    for row in rows:
        print(f"{row['ranks']:>5} {row['policy']:>6} {row['spans_per_rank_step']:>15}"
              f" {row['max_spans_per_rank_step']:>6} {row['bytes_per_rank_step']:>15} {row['spans_per_step']:>10}"
              f" {row['bytes_per_step']:>11} {row['step_ms']:>8} {row['series_rank0']:>9}"
              f" {row['series_per_other_rank']:>12} {row['max_series_other_rank']:>5}"
              f" {row['series_total']:>7}")  # fmt: skip
    largest = max(row["ranks"] for row in rows)
    full = next(row for row in rows if row["ranks"] == largest and row["policy"] == "all")["spans_per_rank_step"]
    auto = [row for row in rows if row["ranks"] == largest and row["policy"] == "auto"][0]
    base = auto["spans_per_rank_step"]  # a rank without detail: its step and phase spans
    # per step: every rank's base spans, plus the full module spans of the detailed ranks (rank 0, a straggler, a
    # NaN's first rank: at most 3, over `steps` steps fewer on average)
    detailed = (auto["spans_per_step"] - base * largest) / max(full - base, 1)
    projection = {str(n): {"all": round(full * n), "auto": round(base * n + detailed * (full - base))}
                  for n in (64, 256, 1000)}  # fmt: skip
    print(
        f"spans a step at N ranks: all = {full} x N; auto = {base} x N + {detailed:.2f} detailed ranks x "
        f"({full} - {base}) (measured at {largest} ranks)"
    )
    for n, figures in projection.items():
        print(f"  {n:>5} ranks: all {figures['all']:>9,}  auto {figures['auto']:>7,}")
    # series: every rank all of its own under "all"; under "auto" the D detail ranks (rank 0 here) theirs, every
    # other rank its model-level ones, whatever steps it explained
    detail_series = auto["series_rank0"]
    other_series = auto["max_series_other_rank"]
    full_row = next(row for row in rows if row["ranks"] == largest and row["policy"] == "all")
    all_series = max(full_row["series_rank0"], full_row["max_series_other_rank"])
    series_projection = {str(n): {"all": all_series * n, "auto": detail_series + other_series * (n - 1)}
                         for n in (64, 256, 1000)}  # fmt: skip
    print(f"series at W ranks, D detail ranks: all = {all_series} x W; auto = D x {detail_series} + (W - D) x "
          f"{other_series} (measured at {largest} ranks, D = 1)")  # fmt: skip
    for n, figures in series_projection.items():
        print(f"  {n:>5} ranks: all {figures['all']:>9,}  auto {figures['auto']:>7,}")
    print(json.dumps({"ranks": rows, "projection": projection, "series_projection": series_projection}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
