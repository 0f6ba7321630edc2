"""Where the host time of a traced GPU forward goes: cProfile around the model's forwards.

gpu.py's model (12 x TransformerEncoderLayer(768), bf16, inference_mode), batch 16 / seq 512 by default, or
gpu_models.py's BERT-base forward (``--model bert``, batch 32 / seq 128), traced with every statistic (the default)
and with spans only, each profiled twice: with the dispatch worker live (as in production) and held off until the
flush (its work then runs after the window, not beside it). On Python 3.12+ cProfile sees every thread, so the live
runs include the worker's functions; the model's thread waiting for the GIL shows up in the call that let it go (a
torch op, a launch): compare a torch builtin's time per forward with the worker live and held. Profiled figures are
inflated by the profiler; read them against each other only.

Run: python benchmarks/gpu_host_profile.py [--forwards N] [--top K] [--batch B] [--seq S] [--model encoder|bert]
The last line printed is one JSON object (on a machine without CUDA: {"gpu_host_profile": {"skipped": "..."}}).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import torchtrace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtrace._pipeline import worker as _worker  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_models  # noqa: E402
from gpu import encoder  # noqa: E402


def _label(function: tuple[str, int, str]) -> str:
    filename, line, name = function
    if filename == "~":  # a builtin: "<built-in method torch.layer_norm>"
        return name
    return f"{os.path.basename(filename)}:{line}({name})"


def profiled(
    model: torch.nn.Module, call: Callable[[torch.nn.Module], Any], forwards: int, worker_held: bool, top: int
) -> dict[str, Any]:
    """Wall and profiled ms per forward, and the ``top`` functions by own time (us per forward)."""
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with _worker.WORKER._condition if worker_held else contextlib.nullcontext(), torch.inference_mode():
        profile.enable()
        for _ in range(forwards):
            call(model)
        profile.disable()
    launched = time.perf_counter()
    table = pstats.Stats(profile).stats  # {function: (primitive calls, calls, own time, cumulative, callers)}
    ranked = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {
        "host_ms_per_forward": round((launched - start) / forwards * 1e3, 3),
        "top_us_per_forward": {
            _label(function): {"calls": row[1] // forwards, "own_us": round(row[2] / forwards * 1e6, 1)}
            for function, row in ranked
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forwards", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--model", choices=("encoder", "bert"), default="encoder", help="bert: gpu_models.py's BERT")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"gpu_host_profile": {"skipped": "no CUDA device"}}))
        return 0
    if args.model == "bert":  # gpu_models.py's BERT-base forward, B32 S128 (its costliest case per call)
        base = gpu_models.bert(torch.device("cuda"), quick=False).eval()
        ids = torch.randint(0, 30522, (32, 128), device="cuda")

        def call(model: torch.nn.Module) -> Any:
            return model(ids)
    else:
        base = encoder()
        torch.backends.mha.set_fastpath_enabled(False)  # as gpu.py: one call per module, the same math everywhere
        x = torch.randn(args.batch, args.seq, 768, device="cuda", dtype=torch.bfloat16)

        def call(model: torch.nn.Module) -> Any:
            return model(x)

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as trace_dir:
        with torch.inference_mode():  # warm-up: kernels, allocator
            call(base)
        report["none"] = profiled(base, call, args.forwards, False, args.top)
        for name, stats in (("torchtrace", True), ("torchtrace_spans", False)):
            trace_file = os.path.join(trace_dir, f"{name}.jsonl")
            handle = torchtrace.instrument(base, exporter="file", trace_file=trace_file, stats=stats)
            try:
                with torch.inference_mode():
                    for _ in range(5):  # warm-up: Triton compilation, event and row pools
                        call(base)
                handle.flush()
                for worker_held in (False, True):
                    key = f"{name}{'_worker_held' if worker_held else ''}"
                    report[key] = profiled(base, call, args.forwards, worker_held, args.top)
                    handle.flush()
            finally:
                handle.remove()
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key}: host {value['host_ms_per_forward']} ms/forward (profiled)")
            for label, row in value["top_us_per_forward"].items():
                print(f"  {row['own_us']:>10.1f} us {row['calls']:>6} calls  {label}")
    print(json.dumps({"gpu_host_profile": report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
