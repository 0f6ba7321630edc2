"""Always-on inference as a server runs it: the export worker in the background, nothing flushed by hand.

Two measurements, one JSON line last:

1. rate: forwards per second of the cheap model (64 x (Linear(32) + ReLU), 129 module calls per forward) over
   ``--seconds`` (default 60) of blocks interleaved round-robin: untraced; traced with OTLP export by the background
   worker every second (``background``); traced with the export flushed at the end of each forward batch inside the
   timed window (``flushed``, as benchmarks/overhead.py measures). Between blocks one untimed second lets the
   background worker finish what the previous block recorded. Reported: forwards/s per variant (median over its
   blocks), and each traced variant's cost per forward relative to untraced (``x_none``).
2. memory: RSS of this process while ``--calls`` module calls (default 1,000,000) are traced to the file exporter
   (the embedded default; statistics, records and summary as configured by default), background export. RSS is
   read after a warm-up (5% of the calls, at least 1,025 forwards: the bounded records and summary reservoirs are
   full by then), then after each tenth of the remaining calls (each reading after a flush): ``growth_mib`` is the
   last reading less the first, what tracing kept beyond its bounds (target: <= 5 MiB). One reading moves by tens
   of MiB with what the allocator keeps of the last export batches, so the readings are reported too, with their
   least-squares trend per million calls (``trend_mib_per_million_calls``): a leak shows as a steady slope.

Run: python benchmarks/serving.py [--seconds S] [--calls N] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

import torchtrace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from overhead import cheap_model, discard_receiver  # noqa: E402

BLOCK_S = 5.0  # one timed block; blocks of the three variants alternate
FLUSH_EVERY = 20  # forwards between two flushes of the flushed variant (as overhead.py's repetitions)


def rss_mib() -> float:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed_block(forward: Callable[[], None], seconds: float, flush: Callable[[], object] | None) -> float:
    """Forwards per second for ``seconds`` of back-to-back forwards (``flush`` after every FLUSH_EVERY)."""
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(FLUSH_EVERY):
            forward()
        if flush is not None:
            flush()
        done += FLUSH_EVERY
    return done / (time.perf_counter() - start)


def measure_rate(seconds: float) -> dict:
    model, x, _ = cheap_model()
    plain, background, flushed = model, copy.deepcopy(model), copy.deepcopy(model)
    handles = {
        "background": torchtrace.instrument(
            background, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=1000)
        ),
        "flushed": torchtrace.instrument(
            flushed, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=10**9)
        ),  # only by hand
    }
    variants: dict[str, tuple[Callable[[], None], Callable[[], object] | None]] = {
        "untraced": (lambda: plain(x), None),
        "background": (lambda: background(x), None),
        "flushed": (lambda: flushed(x), handles["flushed"].flush),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    with torch.inference_mode():
        for forward, flush in variants.values():  # warm-up, untimed
            timed_block(forward, 0.5, flush)
        rounds = max(1, round(seconds / (BLOCK_S * len(names))))
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                time.sleep(1.0)  # the background worker finishes the previous block's export here
                forward, flush = variants[name]
                rates[name].append(timed_block(forward, BLOCK_S, flush))
    exported = {name: handle.exported_spans for name, handle in handles.items()}
    for handle in handles.values():
        handle.remove()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    untraced = medians["untraced"]
    return {
        "forwards_per_s": {name: round(rate, 1) for name, rate in medians.items()},
        "x_none": {name: round(untraced / rate, 3) for name, rate in medians.items()},
        "blocks_per_variant": rounds,
        "block_s": BLOCK_S,
        "exported_spans": exported,
    }


def measure_memory(calls: int) -> dict:
    model, x, _ = cheap_model()
    per_forward = 129
    forwards = max(1, calls // per_forward)
    # warm-up: 5% of the calls, and at least until the records (max_records, default 10,000) and the summary's
    # per-layer reservoirs (1,024 durations: one a forward) are full: what they hold is bounded, not growth
    warm_up = min(forwards, max(forwards // 20, 10_000 // per_forward + 1, 1_025))
    with tempfile.TemporaryDirectory() as directory:
        trace_file = os.path.join(directory, "traces.jsonl")
        handle = torchtrace.instrument(
            model, exporter="file", trace_file=trace_file, limits=torchtrace.Limits(export_interval_ms=1000)
        )
        readings = []  # (calls so far, RSS MiB), each after a flush
        with torch.inference_mode():
            done = 0
            for target in [warm_up, *(warm_up + (forwards - warm_up) * tenth // 10 for tenth in range(1, 11))]:
                for _ in range(target - done):
                    model(x)
                done = target
                handle.flush()
                readings.append((done * per_forward, rss_mib()))
        exported = handle.exported_spans
        handle.remove()
        file_mib = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)) / 2**20
    before, after = readings[0][1], readings[-1][1]
    return {
        "calls": forwards * per_forward,
        "rss_after_warm_up_mib": round(before, 1),
        "rss_at_end_mib": round(after, 1),
        "growth_mib": round(after - before, 2),
        "readings_mib": [round(rss, 1) for _, rss in readings],
        "trend_mib_per_million_calls": round(_slope(readings) * 1e6, 2),
        "exported_spans": exported,
        "trace_files_mib": round(file_mib, 1),
    }


def _slope(points: list[tuple[int, float]]) -> float:
    """The least-squares slope of (x, y) points (0 for fewer than two distinct x)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="timed seconds of the rate measurement, in all")
    parser.add_argument("--calls", type=int, default=1_000_000, help="module calls of the memory measurement")
    parser.add_argument("--quick", action="store_true", help="a smoke run (~25 s)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.calls = 15.0, 160_000
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    with discard_receiver("http/protobuf") as endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        rate = measure_rate(args.seconds)
    print(f"rate (forwards/s, median of {rate['blocks_per_variant']} blocks of {BLOCK_S:.0f} s each):")
    for name, value in rate["forwards_per_s"].items():
        print(f"  {name:<11} {value:>10.1f}  x_none {rate['x_none'][name]:.3f}")
    memory = measure_memory(args.calls)
    print(
        f"memory: {memory['calls']} calls to the file exporter: RSS {memory['rss_after_warm_up_mib']} -> "
        f"{memory['rss_at_end_mib']} MiB (growth {memory['growth_mib']} MiB; trend "
        f"{memory['trend_mib_per_million_calls']} MiB per million calls over readings {memory['readings_mib']}), "
        f"trace files {memory['trace_files_mib']} MiB"
    )
    print(json.dumps({"rate": rate, "memory": memory}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
