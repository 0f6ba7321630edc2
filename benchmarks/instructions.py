"""Instructions per traced module call on the CPU hot path, counted with valgrind's callgrind: a deterministic guard.

Wall-clock overhead (benchmarks/overhead.py) moves with the load of a shared host; instruction counts hardly do. Each
variant runs in its own process under ``valgrind --tool=callgrind --instr-atstart=no``: the process (this script with
the hidden ``--child`` flag) warms up (5 forwards + flush), switches counting on for itself with ``callgrind_control
-i on <pid>``, runs N forwards and the flush, and switches counting off. That is done for two values of N; the
difference of the two "totals:" counts over the extra module calls is the cost of one module call, start-up and the
fixed part of the flush cancelling out. Children run with PYTHONHASHSEED=0, torch.set_num_threads(1),
torch.manual_seed(0), random.seed(0) (span ids), without the caller's OTEL_* and TORCHTRACE_* variables and with
TORCHTRACE_PRINT_SUMMARY=false.

Model: "cheap" = 64 x (Linear(32, 32) + ReLU) in nn.Sequential at batch 4, default grad mode (``--grad-mode
no_grad`` or ``inference``: every forward, warm-up included, under torch.no_grad() or torch.inference_mode()): 129
module calls per forward (the root included), so the tracer's work dominates.

Variants:
  untraced     the model as it is
  empty_hooks  a no-op forward pre-hook and forward hook on every module: the floor of any hook-based tracer
  spans        torchtrace.instrument(model, exporter="none", stats=False)
  stats        torchtrace.instrument(model, exporter="none"): every statistic (the default)
  cuda_spans   spans as on a GPU: the CUDA host path (two driver timing events a call) on a simulated device
               (benchmarks/simulated_cuda.py: C stubs for the driver's calls; needs a C compiler and Triton)
  cuda_stats   every statistic as on a GPU: the events, a statistics row and a C kernel launch per tensor
  cuda_batched the same with Stats(batch=8): each tensor queued from C, one launch per eight (the warm-up forwards
               include the two in which its kinds are checked)

Reported per variant: instructions per module call, those added over untraced, and that added count as a multiple of
the empty hooks' added count ("x empty hook"), and the instructions added on the model's thread alone (each thread is
counted on its own; the rest is torchtrace's dispatch thread, which on a GPU host shares the model's GIL). A CUDA
forward is read on the model's thread at the next forward's end (its count includes that), the window's last one by
the dispatch thread once the model is idle: before the flush that ends the counted window, the child waits for it,
so that the flush does not do that reading in its place. The
untraced and empty-hook counts repeat exactly from run to run; the traced ones move by up to ~1-2%: the dispatch
thread resolves records on wall-clock ticks, so how many forwards it takes at a time (and what its pools hold)
differs from run to run. Compare counts of the same script version only: a change to the child itself (even an
added call before the window) shifts every count a little.

``--hot-path``: only the instructions inside the compiled traced call (``callgrind --toggle-collect=traced_call``:
the start mark, the module's own forward, the end mark, the statistics), torchtrace's dispatch thread held still and
the garbage collector off while the counted forwards run (a collection falls in whichever call allocates when it is
due), per traced call (the root's call is timed by its hooks, not the compiled call). Runs of one build agree within
~0.1% (what is left of the threads' timing: the GIL handed over when another thread wakes), where the whole process's
count moves by ~1k a call; between two builds whose compiled call is the same code it still moves by up to ~0.6k a
call (the allocators' state, shaped by the rest of the process). For comparing two versions of the hot path; the
traced variants only, where ``torchtrace._native`` is built.

Run: python benchmarks/instructions.py [--variants untraced,empty_hooks,spans,stats] [--calls 2,8] [--json PATH]
     [--grad-mode default|no_grad|inference] [--hot-path]
Needs valgrind and callgrind_control on PATH, and for the cuda_* variants a C compiler and Triton (exits with status 2
without them); about 30-45 s per variant on 2 cores (two valgrind runs at once, --jobs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

VARIANTS = ("untraced", "empty_hooks", "spans", "stats", "cuda_spans", "cuda_stats", "cuda_batched")
WARMUP_FORWARDS = 5
LAYERS = 64
WIDTH = 32
BATCH = 4


# -- the child: one variant, N counted forwards, run under callgrind ---------------------------------------------------


def callgrind_instrumentation(state: str) -> None:
    """Switches callgrind's counting for this process on or off (blocks until callgrind has done it)."""
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, stdout=subprocess.DEVNULL)


GRAD_MODES = ("default", "no_grad", "inference")


def run_child(variant: str, forwards: int, grad_mode: str, hot_path: bool = False) -> None:
    """Builds the model and the variant, warms up, counts ``forwards`` forwards and the flush. Prints one JSON line."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
    import torch
    from torch import nn

    import torchtrace

    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)  # span and trace ids (torchtrace draws them from random): the same values every run
    model = nn.Sequential(*[layer for _ in range(LAYERS) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    x = torch.randn(BATCH, WIDTH)
    calls_per_forward = len(list(model.modules()))  # nn.Sequential calls each child once, plus the root

    def flush() -> None:
        pass

    if variant == "empty_hooks":

        def pre(module: nn.Module, args: tuple) -> None:
            pass

        def post(module: nn.Module, args: tuple, output: object) -> None:
            pass

        for module in model.modules():
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)
    elif variant in ("spans", "stats", "cuda_spans", "cuda_stats", "cuda_batched"):
        if variant.startswith("cuda_"):
            import simulated_cuda

            simulated_cuda.install(setattr)
        # only exporter= and stats=: the summary print is off through TORCHTRACE_PRINT_SUMMARY (set by the parent)
        stats = {"stats": False} if variant.endswith("spans") else {}  # "stats": the default, every statistic
        if variant == "cuda_batched":
            stats = {"stats": torchtrace.Stats(batch=8)}
        handle = torchtrace.instrument(model, exporter="none", **stats)

        def flush() -> None:  # what the worker resolves stays on its thread, not the flush's (the model's)
            from torchtrace._pipeline.worker import WORKER

            WORKER.resolve_soon()
            while handle._dispatcher.has_unresolved():
                time.sleep(0.05)  # few wake-ups: the model's thread adds next to nothing while it waits
            handle.flush()

    mode = {"no_grad": torch.no_grad, "inference": torch.inference_mode}.get(grad_mode, contextlib.nullcontext)
    with mode():
        for _ in range(WARMUP_FORWARDS):  # first calls, lazy imports, caches
            model(x)
        flush()
        gc.collect()  # both runs start counting from the same collector state
        callgrind_instrumentation("on")
        with held_worker() if hot_path else contextlib.nullcontext():
            if hot_path:  # a young collection lands in whichever call allocates when it is due: not this call's cost
                gc.disable()
            for _ in range(forwards):
                model(x)
            gc.enable()
        flush()
        callgrind_instrumentation("off")
    print(json.dumps({"calls_per_forward": calls_per_forward, "torch": torch.__version__}))


def held_worker() -> Any:
    """torchtrace's dispatch thread held still (its condition's lock taken): nothing it does interleaves with the
    counted calls."""
    from torchtrace._pipeline.worker import WORKER

    return WORKER._condition


# -- the parent: valgrind runs, the difference, the report -------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHTRACE_"))}
    env.update(PYTHONHASHSEED="0", TORCHTRACE_PRINT_SUMMARY="false")
    return env


def count_instructions(
    variant: str, forwards: int, directory: str, grad_mode: str, hot_path: bool = False
) -> tuple[int, int, dict]:
    """(callgrind's total instructions while counting was on, those of the model's thread, the child's JSON line)
    for one child run. Each thread is counted on its own (``--separate-threads=yes``: one file a thread, the main
    thread's first): the model's thread and torchtrace's dispatch thread share one GIL, so on a host-bound GPU
    forward the worker's instructions delay the model as well, but they are not part of a call's own path."""
    out_file = os.path.join(directory, f"callgrind.{variant}.{forwards}.out")
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        *(["--toggle-collect=traced_call", "--collect-atstart=no"] if hot_path else []),
        "--separate-threads=yes",
        f"--callgrind-out-file={out_file}",
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        str(forwards),
        "--grad-mode",
        grad_mode,
        *(["--hot-path"] if hot_path else []),
    ]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{variant} with {forwards} forwards exited {result.returncode}:\n{result.stderr[-4000:]}")
    threads = sorted(
        name for name in os.listdir(directory) if re.fullmatch(re.escape(os.path.basename(out_file)) + r"-\d+", name)
    )
    totals = []
    for name in threads:
        with open(os.path.join(directory, name)) as lines:
            totals += [int(line.split()[1]) for line in lines if line.startswith("totals:")]
    if len(totals) != len(threads) or not threads or totals[0] <= 0:
        raise RuntimeError(f"{out_file}-NN: expected one 'totals:' line a thread, the first positive, found {totals}")
    return sum(totals), totals[0], json.loads(result.stdout.strip().splitlines()[-1])


def measure(
    variants: Sequence[str], calls: tuple[int, int], jobs: int, grad_mode: str = "default", hot_path: bool = False
) -> dict:
    runs = [(variant, forwards) for variant in variants for forwards in calls]
    with tempfile.TemporaryDirectory(prefix="torchtrace-callgrind-") as directory, ThreadPoolExecutor(jobs) as pool:
        counted = dict(zip(runs, pool.map(lambda run: count_instructions(*run, directory, grad_mode, hot_path), runs)))
    child_lines = [line for _, _, line in counted.values()]
    calls_per_forward = child_lines[0]["calls_per_forward"]
    # with --hot-path, the compiled calls: every call but the root's
    extra_calls = (calls[1] - calls[0]) * (calls_per_forward - 1 if hot_path else calls_per_forward)
    results: dict[str, dict] = {}
    for variant in variants:
        totals = [counted[(variant, forwards)][0] for forwards in calls]
        model = [counted[(variant, forwards)][1] for forwards in calls]
        results[variant] = {
            "totals": totals,
            "per_call": round((totals[1] - totals[0]) / extra_calls, 1),
            "model_thread_totals": model,
            "model_thread_per_call": round((model[1] - model[0]) / extra_calls, 1),
        }
    untraced = results.get("untraced", {}).get("per_call")
    untraced_model = results.get("untraced", {}).get("model_thread_per_call")
    floor = results["empty_hooks"]["per_call"] - untraced if untraced and "empty_hooks" in results else None
    for values in results.values():
        added = None if untraced is None else round(values["per_call"] - untraced, 1)
        values["added_per_call"] = added
        values["model_thread_added_per_call"] = (
            None if untraced_model is None else round(values["model_thread_per_call"] - untraced_model, 1)
        )
        values["x_empty_hook"] = None if added is None or not floor else round(added / floor, 3)
    return {
        "model": f"{LAYERS} x (Linear({WIDTH}, {WIDTH}) + ReLU), batch {BATCH}",
        "grad_mode": grad_mode,
        "hot_path": hot_path,
        "calls_per_forward": calls_per_forward,
        "forwards": list(calls),
        "torch": child_lines[0]["torch"],
        "python": platform.python_version(),
        "variants": results,
    }


def print_table(report: dict) -> None:
    forwards = report["forwards"]
    counted = report["calls_per_forward"] - 1 if report["hot_path"] else report["calls_per_forward"]
    extra = (forwards[1] - forwards[0]) * counted
    print(
        f"{report['model']}, grad mode {report['grad_mode']}: {report['calls_per_forward']} module calls per forward; "
        f"{forwards[0]} and {forwards[1]} counted forwards, the difference over {extra} module calls"
    )
    if report["hot_path"]:
        print("only inside the compiled traced call (the module's own forward included), the dispatch thread held")
    header = f"{'variant':<12} {'instr/call':>11} {'added/call':>11} {'x empty hook':>13} {'model thread added':>19}"
    print(header)
    print("-" * len(header))
    for name, values in report["variants"].items():
        added = "n/a" if values["added_per_call"] is None else f"{values['added_per_call']:,.0f}"
        ratio = "n/a" if values["x_empty_hook"] is None else f"{values['x_empty_hook']:.3f}"
        on_model = values["model_thread_added_per_call"]
        on_model = "n/a" if on_model is None else f"{on_model:,.0f}"
        print(f"{name:<12} {values['per_call']:>11,.0f} {added:>11} {ratio:>13} {on_model:>19}")


def parse_calls(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not match or not 0 < int(match[1]) < int(match[2]):
        raise argparse.ArgumentTypeError(f"expected N1,N2 with 0 < N1 < N2, got {text!r}")
    return int(match[1]), int(match[2])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--calls", type=parse_calls, default=(2, 8), help="counted forwards of the two runs (2,8)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="valgrind runs at once (counts do not change)"
    )
    parser.add_argument(
        "--grad-mode", choices=GRAD_MODES, default="default", help="the forwards' mode: torch's default, no_grad, or "
        "inference (torch.inference_mode)"
    )  # fmt: skip
    parser.add_argument(
        "--hot-path", action="store_true", help="only the instructions inside the compiled traced call, the dispatch "
        "thread held (traced variants)"
    )  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "FORWARDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child[0], int(args.child[1]), args.grad_mode, args.hot_path)
        return 0
    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown or not variants:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if args.hot_path and {"untraced", "empty_hooks"} & set(variants):
        parser.error("--hot-path counts the compiled traced call: the traced variants only")
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"instructions.py needs {' and '.join(missing)} on PATH (valgrind's callgrind)", file=sys.stderr)
        return 2
    if any(name.startswith("cuda_") for name in variants):
        import simulated_cuda

        reason = simulated_cuda.available()
        if reason is not None:
            print(f"the cuda_* variants cannot run here: {reason}", file=sys.stderr)
            return 2

    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"{version}, python {platform.python_version()}, PYTHONHASHSEED=0, 1 torch thread")
    start = time.monotonic()
    report = measure(variants, args.calls, max(1, args.jobs), args.grad_mode, args.hot_path)
    report["valgrind"] = version
    print(f"torch {report['torch']}; {len(variants) * 2} valgrind runs in {time.monotonic() - start:.0f} s\n")
    print_table(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
