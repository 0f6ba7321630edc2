"""Long run: a million traced module calls with a flat memory profile.

A small model (10 module calls per forward, statistics on) runs until ``--calls`` module calls were traced, with
the exporter writing OTLP JSON to a temporary file (``--exporter file``, default) or nowhere (``none``: records and
summary only). RSS is sampled every ``--sample-every`` forwards; growth is reported after a warm-up (the first
``--warmup`` fraction of the run: allocator pools, template caches, the bounded records store filling up).

Run: python benchmarks/longrun.py [--calls 1000000] [--exporter file|none]
The last line printed is one JSON object (RSS in MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import torch
from torch import nn

import torchtrace

CALLS_PER_FORWARD = 10  # Net + 3 x (Linear, LayerNorm, GELU)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(32) for _ in range(3))
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = self.act(norm(layer(x)))
        return x


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="module calls to trace (default: 1M)")
    parser.add_argument("--exporter", choices=("file", "none"), default="file")
    parser.add_argument("--sample-every", type=int, default=1000, help="forwards between RSS samples")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the run before growth is measured")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net().eval()
    x = torch.randn(4, 32)
    forwards = max(1, args.calls // CALLS_PER_FORWARD)
    warmup_forwards = int(forwards * args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = os.path.join(tmp, "traces.jsonl")
        samples: list[tuple[int, float]] = [(0, rss_mib())]
        started = time.perf_counter()
        with torchtrace.instrument(
            model, exporter=args.exporter, trace_file=trace_file, limits=torchtrace.Limits(export_interval_ms=200)
        ) as handle:
            with torch.inference_mode():
                for i in range(1, forwards + 1):
                    model(x)
                    if i % args.sample_every == 0:
                        samples.append((i, rss_mib()))
            handle.flush()
            elapsed = time.perf_counter() - started
            records_kept = len(handle.records)
            report = {
                "calls": forwards * CALLS_PER_FORWARD,
                "forwards": forwards,
                "exporter": args.exporter,
                "seconds": round(elapsed, 2),
                "us_per_call": round(elapsed / (forwards * CALLS_PER_FORWARD) * 1e6, 2),
                "dropped_calls": handle.dropped_calls,
                "exported_spans": handle.exported_spans,
                "failed_spans": handle.failed_spans,
                "records_kept": records_kept,
            }
        trace_bytes = os.path.getsize(trace_file) if os.path.exists(trace_file) else 0
    after_warmup = [rss for i, rss in samples if i >= warmup_forwards] or [samples[-1][1]]
    second_half = [rss for i, rss in samples if i >= forwards // 2] or [samples[-1][1]]
    first_half = [rss for i, rss in samples if warmup_forwards <= i < forwards // 2] or after_warmup
    report.update(
        {
            "rss_mib_start": round(samples[0][1], 1),
            "rss_mib_after_warmup": round(after_warmup[0], 1),
            "rss_mib_end": round(samples[-1][1], 1),
            "rss_mib_max": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_growth_mib_after_warmup": round(samples[-1][1] - after_warmup[0], 2),
            "rss_mean_mib_first_half_vs_second_half": [
                round(sum(first_half) / len(first_half), 1),
                round(sum(second_half) / len(second_half), 1),
            ],
            "rss_samples": len(samples),
            "trace_file_mib": round(trace_bytes / 2**20, 1),
        }
    )
    print(
        f"{report['calls']} module calls in {report['seconds']} s; RSS {report['rss_mib_after_warmup']} MiB after "
        f"warm-up -> {report['rss_mib_end']} MiB at the end ({report['rss_growth_mib_after_warmup']:+} MiB)",
        file=sys.stderr,
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
