"""Tail latency of forwards, traced vs untraced, and the full (gen2) garbage collections behind it.

Inference as a server runs it: one forward after another on one thread, each timed. Each variant runs in its own
process (the garbage collector's state is per process: one variant's objects must not trigger another's
collections), and the processes take turns in slices of --slice seconds (the starting variant rotates every
round), so machine noise hits all variants alike. Before the first timed slice each process warms up for
--warmup seconds (the records fill up to max_records) and then runs one full collection, as a long-running server
has long since had: the objects made at start-up (torch's and the model's, tens of thousands) count as new to the
collector, so the process's next full collection (100-150 ms) comes as soon as its young generations have been
collected ten more times, whatever the process keeps afterwards, and would otherwise land in the timed slices of
whichever variant collects most often.

Variants:
  untraced          the model alone (torchtrace imported, nothing instrumented)
  empty_hooks       a no-op forward pre-hook and forward hook on every module: the floor of any hook-based tracer
                    (torch's hooked call path alone; overhead.py's floor), against which the traced tail is read
  traced            instrument(model, exporter="none"): records kept (default max_records), nothing exported
  traced_gc_freeze  the same, then gc.freeze() once after warm-up: what a server can do after loading its model
                    (the objects alive then are never traversed again); torchtrace itself never freezes

Reported per variant: p50 / p99 / max forward latency (ms), p99 / p50 (the tail's shape: where the per-call cost of
statistics makes every traced forward slower, this tells a tail that grew beyond it), and the full collections that
ran in the timed slices: their number, total and longest pause (ms, from gc.callbacks). Per model: p99 ratio traced
/ untraced (target <= 1.2), the same ratio for the empty hooks (where that is above 1.2 no hook-based tracer can
meet the target: the model's calls are too short for the hooks alone), p99 traced / empty hooks, the tail's shape
traced against untraced (p99 / p50 over p99 / p50: near 1 where the p99 ratio is the per-call cost alone, above it
where tracing adds a tail of its own), and the extra full collections per minute (target 0 in steady state).
Targets are reported, not asserted.

Models: "linear8" = 8 x Linear(48, 48), batch 4 (small, fast forwards); "mlp64" = 64 x (Linear(32, 32), ReLU),
batch 1 (129 calls per forward, more than the collector's young generation holds: overhead.py's cheap model);
"encoder" = 2 x TransformerEncoderLayer(128, nhead=4, dim_feedforward=256, batch_first=True), batch 1, seq 32;
"encoder6" (not run unless named) = overhead.py's encoder: 6 x TransformerEncoderLayer(256, nhead=8,
batch_first=True), batch 8, seq 64 (a forward of milliseconds, where the calls' own cost is not microseconds);
"bert" (not run unless named; needs transformers) = a 2-layer BertModel built from its config (hidden 128, 4 heads,
intermediate 256), batch 1, seq 32: 45 calls a forward, most returning tuples or model outputs. All eval,
torch.inference_mode, torch's fused fast path off for every variant (hooks on the layer turn it off: the same math
and the same calls for all). torch.set_num_threads(1) everywhere.

Run: python benchmarks/latency.py [--duration S] [--quick] [--models linear8,mlp64,encoder[,bert]]
--duration is the timed inference per variant and model (default 60 s). The last line printed is one JSON object:
{"linear8": {"variants": {name: {"p50_ms", "p99_ms", "max_ms", "p99_over_p50", "forwards", "gen2",
"gen2_total_ms", "gen2_max_ms"}}, "p99_ratio", "floor_p99_ratio", "p99_over_floor", "tail_shape_ratio",
"extra_gen2_per_min"}, ..., "duration_s": S}
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from overhead import cheap_model, encoder_model, make_empty_hooks  # noqa: E402

import torchtrace  # noqa: E402

VARIANTS = ("untraced", "empty_hooks", "traced", "traced_gc_freeze")


def linear8() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(*[nn.Linear(48, 48) for _ in range(8)]).eval(), torch.randn(4, 48)


def encoder() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(128, nhead=4, dim_feedforward=256, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval(), torch.randn(1, 32, 128)


def mlp64() -> tuple[nn.Module, torch.Tensor]:
    model, x, _ = cheap_model()
    return model.eval(), x


def encoder6() -> tuple[nn.Module, torch.Tensor]:
    model, x, _ = encoder_model()
    return model, x


def bert() -> tuple[nn.Module, torch.Tensor]:
    try:
        from transformers import BertConfig, BertModel
    except ImportError as error:  # a test extra, not a dependency of torchtrace
        raise SystemExit("the bert model needs transformers: pip install -e '.[test]'") from error
    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                        vocab_size=1000)  # fmt: skip
    return BertModel(config).eval(), torch.randint(0, 1000, (1, 32))


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "linear8": linear8,
    "mlp64": mlp64,
    "encoder": encoder,
    "encoder6": encoder6,
    "bert": bert,
}


class FullCollections:
    """Times every gen2 collection while ``counting`` (gc.callbacks)."""

    def __init__(self) -> None:
        self.counting = False
        self.pauses_ns: list[int] = []
        self._started = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2 or not self.counting:
            return
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            self.pauses_ns.append(time.perf_counter_ns() - self._started)
            self._started = 0


def child(model_name: str, variant: str, warmup_s: float) -> None:
    """One variant's process: warms up, then runs a slice per "run SECONDS" line on stdin; "report" ends it."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)
    model, x = MODELS[model_name]()
    handle = torchtrace.instrument(model, exporter="none") if variant.startswith("traced") else None
    if variant == "empty_hooks":
        make_empty_hooks(model)
    collections = FullCollections()
    latencies: list[int] = []
    clock = time.perf_counter_ns

    def run(seconds: float, keep: bool) -> None:
        deadline = clock() + int(seconds * 1e9)
        with torch.inference_mode():
            while True:
                start = clock()
                model(x)
                end = clock()
                if keep:
                    latencies.append(end - start)
                if end > deadline:
                    return

    run(warmup_s, keep=False)
    gc.collect()  # the start-up's full collection (see the docstring), for every variant
    if variant == "traced_gc_freeze":
        gc.freeze()
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "run":
            collections.counting = True
            run(float(command[1]), keep=True)
            collections.counting = False
            print("done", flush=True)
        else:
            break
    latencies.sort()
    pauses = collections.pauses_ns
    report = {
        "forwards": len(latencies),
        "p50_ms": latencies[len(latencies) // 2] / 1e6,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] / 1e6,
        "max_ms": latencies[-1] / 1e6,
        "gen2": len(pauses),
        "gen2_total_ms": sum(pauses) / 1e6,
        "gen2_max_ms": max(pauses, default=0) / 1e6,
    }
    if handle is not None:
        handle.remove()
    gc.unfreeze()  # objects left frozen are never freed at exit: Triton's bindings then print pages of "leaked"
    print(json.dumps(report), flush=True)


def measure(model_name: str, duration_s: float, slice_s: float, warmup_s: float) -> dict[str, Any]:
    processes = {
        variant: subprocess.Popen(
            [sys.executable, __file__, "--child", model_name, variant, str(warmup_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for variant in VARIANTS
    }
    try:
        for process in processes.values():  # warm-ups overlap: only the timed slices take turns
            assert process.stdout.readline().strip() == "ready"
        rounds = max(1, round(duration_s / slice_s))
        for round_ in range(rounds):
            order = VARIANTS[round_ % len(VARIANTS) :] + VARIANTS[: round_ % len(VARIANTS)]
            for variant in order:
                process = processes[variant]
                process.stdin.write(f"run {duration_s / rounds}\n")
                process.stdin.flush()
                assert process.stdout.readline().strip() == "done"
        reports = {}
        for variant, process in processes.items():
            process.stdin.write("report\n")
            process.stdin.flush()
            reports[variant] = json.loads(process.stdout.readline())
    finally:
        for process in processes.values():
            process.stdin.close()
            process.wait(timeout=60)
    untraced, floor, traced = reports["untraced"], reports["empty_hooks"], reports["traced"]
    minutes = duration_s / 60
    for report in reports.values():
        report["p99_over_p50"] = report["p99_ms"] / report["p50_ms"]  # the tail's shape, apart from per-call cost
    return {
        "variants": reports,
        "p99_ratio": traced["p99_ms"] / untraced["p99_ms"],
        "floor_p99_ratio": floor["p99_ms"] / untraced["p99_ms"],
        "p99_over_floor": traced["p99_ms"] / floor["p99_ms"],
        # the tail's shape traced against untraced: above 1, tracing adds a tail beyond its per-call cost (the full
        # collections this benchmark was made for); at 1, the p99 ratio is the per-call cost alone
        "tail_shape_ratio": traced["p99_over_p50"] / untraced["p99_over_p50"],
        "extra_gen2_per_min": (traced["gen2"] - untraced["gen2"]) / minutes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="timed seconds per variant and model")
    parser.add_argument("--slice", type=float, default=2.0, help="seconds per turn")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before timing, per process")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 s per variant")
    parser.add_argument(
        "--models", default="linear8,mlp64,encoder", help="comma-separated: linear8, mlp64, encoder, encoder6, bert"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], float(args.child[2]))
        return 0
    if args.quick:
        args.duration, args.slice, args.warmup = 1.0, 0.5, 0.5
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    print(f"torch {torch.__version__}, torchtrace {torchtrace.__version__}, python {sys.version.split()[0]}")
    print(f"{args.duration:g} s timed per variant and model, slices of {args.slice:g} s, warm-up {args.warmup:g} s")
    results: dict[str, Any] = {}
    for name in models:
        result = results[name] = measure(name, args.duration, args.slice, args.warmup)
        for variant, report in result["variants"].items():
            print(
                f"{name:8} {variant:17} p50 {report['p50_ms']:.3f} ms  p99 {report['p99_ms']:.3f} ms "
                f"({report['p99_over_p50']:.1f}x p50)  "
                f"max {report['max_ms']:.1f} ms  full collections {report['gen2']} "
                f"(total {report['gen2_total_ms']:.0f} ms, max {report['gen2_max_ms']:.0f} ms)"
            )
        print(
            f"{name:8} p99 traced / untraced {result['p99_ratio']:.2f} (target <= 1.2; empty hooks alone "
            f"{result['floor_p99_ratio']:.2f}, traced / empty hooks {result['p99_over_floor']:.2f}; p99/p50 traced / "
            f"untraced {result['tail_shape_ratio']:.2f}); "
            f"extra full collections per minute {result['extra_gen2_per_min']:.1f} (target 0)"
        )
    results["duration_s"] = args.duration
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
