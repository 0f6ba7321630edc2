"""What layer-drift scoring costs the worker: DriftScorer's time per forward, on a BertModel's real forwards.

The traced call's cost with a baseline is measured by overhead.py (its `*_baseline` variants); this script times the
scorer itself, which runs on torchtrace's worker thread (a sink), off the model's thread.

Method, per model (a BertModel built from a small config, hidden 128, 4 heads, intermediate 256, vocabulary 1000,
``--layers`` layers: 6 gives ~110 traced calls a forward, 12 ~220; eval, inference_mode, one torch thread):
  1. a baseline: ``--baseline-forwards`` traced forwards of random token batches (batch 1, seq 32), records kept,
     ``handle.baseline()``;
  2. real forwards to score: the model traced with that baseline and a sink that keeps each forward's ``CallBatch``
     (as the dispatcher hands them to the scorer): ``--forwards`` forwards of new random batches (in distribution),
     then as many with one layer's weights scaled (``encoder.layer[L/2].output.dense`` x3: that layer and those
     after it drift, their calls get marked). Meanwhile the scorer's own time in the pipeline, on the worker, is
     recorded (``in_pipeline``: wall time, the model's thread competing for the GIL);
  3. timed alone: a fresh DriftScorer(baseline), warmed up by one pass (its per-layout plans made, its windows
     filled), then each batch scored in turn (``scorer(batch)``, as the dispatcher calls it), ``--repeats`` times;
     microseconds per forward: the median and the range of the repeats. The first call of a layout (its plan) is
     timed apart, once.

Run: python benchmarks/drift.py [--layers 6,12] [--forwards 64] [--repeats 7] [--baseline-forwards 200] [--quick]
The last line printed is one JSON object: {"drift_scoring": {"bert6": {"calls_per_forward", "series",
"in_distribution_us", "drifted_us", "first_call_us", "in_pipeline_us", "drifted_statistics"}, ...}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torchtrace  # noqa: E402
from torchtrace._core.calls import CallBatch  # noqa: E402
from torchtrace._sinks.drift import DriftScorer  # noqa: E402

SEQ = 32


def bert(layers: int) -> torch.nn.Module:
    try:
        from transformers import BertConfig, BertModel
    except ImportError as error:  # a test extra, not a dependency of torchtrace
        raise SystemExit("drift.py needs transformers: pip install -e '.[test]'") from error
    torch.manual_seed(0)
    config = BertConfig(hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=256,
                        vocab_size=1000)  # fmt: skip
    return BertModel(config).eval()


def tokens(generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1000, (1, SEQ), generator=generator)


class KeepForwards:
    """A sink keeping each forward's CallBatch as delivered."""

    def __init__(self) -> None:
        self.batches: list[CallBatch] = []

    def __call__(self, calls: Sequence[Any]) -> None:
        for segment in getattr(calls, "segments", (calls,)):
            if isinstance(segment, CallBatch) and segment.kind == "forward" and len(segment):
                self.batches.append(segment)


def per_forward_us(scorer: DriftScorer, batches: list[CallBatch], repeats: int) -> list[float]:
    """Microseconds per forward of scoring ``batches`` in turn, once per repeat."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for batch in batches:
            scorer(batch)
        times.append((time.perf_counter_ns() - start) / len(batches) / 1e3)
    return times


def measure(layers: int, args: argparse.Namespace) -> dict:
    model = bert(layers)
    generator = torch.Generator().manual_seed(1)
    max_records = 400 * (args.baseline_forwards + 1)
    handle = torchtrace.instrument(model, exporter="none", records=torchtrace.Records(max_records=max_records))
    with torch.inference_mode():
        for _ in range(args.baseline_forwards):
            model(tokens(generator))
    handle.flush()
    baseline = handle.baseline()
    handle.remove()

    kept = KeepForwards()
    handle = torchtrace.instrument(model, exporter="none", baseline=baseline, sinks=[kept])
    scorer, pipeline_ns, model_thread = handle._drift, [], threading.get_ident()
    score = scorer._score

    def timed_score(batch: CallBatch) -> None:  # the scorer's time in the pipeline, where it ran
        start = time.perf_counter_ns()
        score(batch)
        pipeline_ns.append((time.perf_counter_ns() - start, threading.get_ident() != model_thread))

    scorer._score = timed_score
    with torch.inference_mode():
        for _ in range(args.forwards):
            model(tokens(generator))
        handle.flush()
        calm = list(kept.batches)
    weight = model.encoder.layer[layers // 2].output.dense.weight
    with torch.no_grad():
        weight.mul_(3.0)
    with torch.inference_mode():
        for _ in range(args.forwards):
            model(tokens(generator))
        handle.flush()
    with torch.no_grad():
        weight.div_(3.0)
    drifted_batches = kept.batches[len(calm) :]
    drifted_statistics = len(handle.drift().drifted)
    handle.remove()
    on_worker = [ns / 1e3 for ns, worker in pipeline_ns if worker]

    fresh = DriftScorer(baseline, scorer.window, scorer.threshold)
    start = time.perf_counter_ns()
    fresh(calm[0])  # a new layout: its plan is made
    first_call_us = (time.perf_counter_ns() - start) / 1e3
    per_forward_us(fresh, calm, 1)  # windows filled
    calm_us = per_forward_us(fresh, calm, args.repeats)
    drifted_scorer = DriftScorer(baseline, scorer.window, scorer.threshold)
    per_forward_us(drifted_scorer, calm, 1)
    per_forward_us(drifted_scorer, drifted_batches, 1)  # the marked layouts' plans, windows over the threshold
    drifted_us = per_forward_us(drifted_scorer, drifted_batches, args.repeats)

    result = {
        "calls_per_forward": len(calm[0]),
        "series": len(baseline.references),
        "forwards": len(calm),
        "in_distribution_us": summary(calm_us),
        "drifted_us": summary(drifted_us),
        "first_call_us": round(first_call_us, 1),
        "in_pipeline_us": summary(on_worker) | {"scored_on_worker": len(on_worker), "scored": len(pipeline_ns)},
        "drifted_statistics": drifted_statistics,
        "drifted_statistics_in_replay": len(drifted_scorer.status().drifted),
    }
    print(f"\n== bert{layers}: {result['calls_per_forward']} calls a forward, {result['series']} layer statistics "
          f"in the baseline ({args.baseline_forwards} forwards)")  # fmt: skip
    print(f"scoring a forward, alone (median, range of {args.repeats} passes over {len(calm)} forwards):")
    for label, key in (("in distribution", "in_distribution_us"), ("drifted (calls marked)", "drifted_us")):
        values = result[key]
        print(f"  {label:<24} {values['median']:>8.1f} us  ({values['min']:.1f}-{values['max']:.1f})")
    print(f"  first call of a layout   {first_call_us:>8.1f} us (its plan; once per layout)")
    pipeline = result["in_pipeline_us"]
    print(f"  in the pipeline, on the worker (wall time, GIL shared with the model): median {pipeline['median']:.1f} "
          f"us, {pipeline['scored_on_worker']} of {pipeline['scored']} forwards scored there")  # fmt: skip
    print(f"  drifted layer statistics after the scaled layer's forwards: {drifted_statistics} (replay: "
          f"{result['drifted_statistics_in_replay']})")  # fmt: skip
    return result


def summary(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="6,12", help="comma-separated BertModel depths")
    parser.add_argument("--forwards", type=int, default=64, help="forwards to score, in distribution and drifted")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes over the forwards")
    parser.add_argument("--baseline-forwards", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 layers, few forwards")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.forwards, args.repeats, args.baseline_forwards = "2", 8, 2, 30
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, torchtrace {torchtrace.__version__}, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, torch threads 1")  # fmt: skip
    results = {f"bert{layers}": measure(int(layers), args) for layers in args.layers.split(",")}
    print(json.dumps({"drift_scoring": results}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
