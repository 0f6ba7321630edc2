"""GPU overhead and timing accuracy of torchtrace on 12 x TransformerEncoderLayer(768) in bfloat16.

Four questions, answered on one CUDA device in one run:

1. Overhead. Variants, each on its own copy of the model, timed round-robin (the starting variant rotates every
   round): `none` (no hooks), `empty_hooks` (a no-op forward pre-hook and hook on every module: the floor of any
   hook-based tracer, as in overhead.py), `torchtrace` (a span per module call, every statistic on every module's
   output, CUDA-event timing, the embedded file exporter), `torchtrace_spans` (the same without statistics: what
   the statistics cost), `torchtrace_spans_host_clock` (spans without statistics or CUDA events: what the events
   cost), `torchtrace_torch_ops` (every statistic, reduced by torch ops instead of the fused Triton kernel) and
   `torchtrace_sampled` (Stats(sample=65536)) and `torchtrace_batched` (Stats(batch=8): eight tensors' statistics
   a launch; tensors made under inference_mode have no version counter and are launched one by one, so it differs
   from `torchtrace` only with --grad-mode no_grad). One timed repetition =
   N forwards under inference_mode (or no_grad), the variant's flush, then torch.cuda.synchronize(): device work
   and export are in the window. Targets (every statistic): <= 1.12x at batch 16 / seq 512, <= 1.35x at batch 1 /
   seq 128. All variants run with torch's fused encoder fast path off (hooks on a layer turn it off; with it on,
   torchtrace would see one call per layer): the same math and the same calls for all; `none_fastpath` shows what
   the fast path alone is worth. Also reported: the host's time per forward until the loop returned, which
   tells a host-bound variant (hooks and launches slower than the device) from a device-bound one.
2. Timing accuracy. For a few modules, the median span duration against the module run alone on the same input,
   timed with CUDA events (median of many runs). Target: within 5%. Measured with spans only ("timing": the
   fidelity of event timing) and with every statistic on ("timing_with_stats": a container's span then also
   holds its children's statistics kernels).
3. Host syncs. Synchronizing CUDA calls during one traced forward, counted with
   torch.cuda.set_sync_debug_mode("warn"), minus those of the untraced model. Target: 0.
4. Peak memory. The device memory a B16 S512 forward peaks at, traced with every statistic against untraced
   (the same model, after warm-up). Target: at most 64 MiB added. Also with Stats(batch=8) under no_grad
   ("peak_memory_batched"): what the tensors waiting for their batch add, at most Stats.batch_mb (64 MiB).

With --split, three more variants say where a traced forward's host time goes (compare their host ms per forward
with torchtrace's): `torchtrace_worker_at_flush` (the dispatch worker held off while the forwards run: the model's
thread alone, which reads each forward's device work at a later forward's end, as it does with the worker live; the
exports at the flush), `torchtrace_driver_stubbed` (the CUDA driver's event records,
elapsed-time reads and statistics launches replaced by C stubs that return at once, benchmarks/simulated_cuda.py:
everything but the driver; the rows then hold no statistics) and `torchtrace_driver_stubbed_worker_at_flush` (both:
the Python and compiled code of the model's thread alone), and `torchtrace_events_read_in_line` (no device-times
reader: each forward's events read where it is resolved, on the model's thread, as before the reader).

Run: python benchmarks/gpu.py [--quick] [--repeats R] [--forwards N] [--grad-mode no_grad] [--split]
The last line printed is one JSON object (on a machine without CUDA: {"gpu": {"skipped": "..."}}, exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import torchtrace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtrace._capture import device as _device
from torchtrace._capture.cuda_driver import driver  # noqa: E402
from torchtrace._pipeline import device_times  # noqa: E402
from torchtrace._pipeline import worker as _worker  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import make_empty_hooks  # noqa: E402

# targets of the default (every statistic), x untraced: exact statistics read every element once, ~8% of the b16/s512
# forward's device time on an H200; the rest is the host's per-call work (issue 41)
CONFIGS = ({"batch": 16, "seq": 512, "target": 1.12}, {"batch": 1, "seq": 128, "target": 1.35})
TIMED_MODULES = ("layers.0.linear1", "layers.0.self_attn", "layers.0.norm1", "layers.5", "layers.11.linear2")
TIMING_TARGET = 0.05
PEAK_TARGET_MIB = 64  # device memory a traced B16 S512 forward may add at its peak (issue 41's bound)
SAMPLE = 65536  # the torchtrace_sampled variant's stats_sample
SPLIT = False  # --split: the variants that take a traced forward's host time apart (see the docstring)
GRAD_MODE: Callable[[], Any] = torch.inference_mode  # --grad-mode no_grad: tensors keep version counters, so a
# container returning its child's tensor reuses the child's statistics (inference tensors are summarised again)


def encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(768, nhead=12, dim_feedforward=3072, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
    return model.to("cuda", torch.bfloat16).eval()


@dataclass
class Variant:
    name: str
    model: nn.Module
    flush: Callable[[], Any] = lambda: None
    close: Callable[[], Any] = lambda: None
    before: Callable[[], Any] = lambda: None  # set-up around each timed repetition (e.g. the stats path)
    after: Callable[[], Any] = lambda: None
    worker_at_flush: bool = False  # the dispatch worker is held off while the forwards run: its exports are at flush


def make_variants(base: nn.Module, trace_dir: str) -> list[Variant]:
    variants = [Variant("none", copy.deepcopy(base))]
    fastpath = Variant("none_fastpath", copy.deepcopy(base))
    fastpath.before = lambda: torch.backends.mha.set_fastpath_enabled(True)
    fastpath.after = lambda: torch.backends.mha.set_fastpath_enabled(False)
    variants.append(fastpath)
    empty = make_empty_hooks(copy.deepcopy(base))  # overhead.py's floor, the same no-op hooks
    variants.append(Variant("empty_hooks", empty.model, close=empty.close))
    names = [
        "torchtrace",
        "torchtrace_spans",
        "torchtrace_spans_host_clock",
        "torchtrace_torch_ops",
        "torchtrace_sampled",
        "torchtrace_batched",
    ]
    if SPLIT:
        names += [
            "torchtrace_worker_at_flush",
            "torchtrace_driver_stubbed",
            "torchtrace_driver_stubbed_worker_at_flush",
            "torchtrace_events_read_in_line",
        ]
    for name in names:
        model = copy.deepcopy(base)
        torchtrace.configure(cuda_events=name != "torchtrace_spans_host_clock", print_summary=False)
        handle = torchtrace.instrument(
            model,
            exporter="file",
            trace_file=os.path.join(trace_dir, f"{name}.jsonl"),
            stats=torchtrace.Stats(
                names=not name.startswith("torchtrace_spans"),
                sample=SAMPLE if name == "torchtrace_sampled" else None,
                batch=8 if name == "torchtrace_batched" else 1,
            ),
        )
        variant = Variant(
            name, model, flush=handle.flush, close=handle.remove, worker_at_flush=name.endswith("_worker_at_flush")
        )
        if "_driver_stubbed" in name:
            variant.before, variant.after = stub_driver(trace_dir)
        if name == "torchtrace_events_read_in_line":  # no device-times thread: read where the forward is resolved
            applies = device_times.applies
            variant.before = lambda: setattr(device_times, "applies", lambda forward: False)
            variant.after = lambda applies=applies: setattr(device_times, "applies", applies)
        if name == "torchtrace_torch_ops":
            fused = _device.fused_kernel
            variant.before = lambda: setattr(_device, "fused_kernel", lambda x: None)
            variant.after = lambda fused=fused: setattr(_device, "fused_kernel", fused)
        variants.append(variant)
    return variants


def stub_driver(directory: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(before, after) a timed repetition: the driver's event records and elapsed-time reads and the statistics
    kernel's C launches go to C stubs that return success at once (benchmarks/simulated_cuda.py), and back."""
    import simulated_cuda

    stubs = simulated_cuda.Stubs(directory)
    triton_stats = importlib.import_module("torchtrace._capture.triton_stats")
    saved: dict[str, Any] = {}

    def before() -> None:
        cuda = driver()
        if cuda is not None:
            saved["elapsed"], cuda.elapsed_address = cuda.elapsed_address, stubs.address("elapsed")
        timers = [timer for timer in _device._timers.values() if isinstance(timer, _device.DriverEventTimer)]
        saved["records"] = [(timer, timer.marking) for timer in timers]
        for timer in timers:
            pool, _, index, current_device, current_stream = timer.marking
            timer.marking = (pool, stubs.address("record"), index, current_device, current_stream)
        saved["direct"] = dict(triton_stats._direct)
        for key, native in saved["direct"].items():
            if native is not None:
                triton_stats._direct[key] = native._replace(launch=stubs.address("launch"))

    def after() -> None:
        if "elapsed" in saved:
            driver().elapsed_address = saved.pop("elapsed")
        for timer, marking in saved.pop("records", []):
            timer.marking = marking
        triton_stats._direct.update(saved.pop("direct", {}))

    return before, after


def timed(variant: Variant, x: torch.Tensor, forwards: int) -> tuple[float, float]:
    """Seconds per forward for one repetition: N forwards, the flush, and the device's completion; and the host's
    share: seconds per forward until the last forward returned (launches and hooks; the device may still run)."""
    variant.before()
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        # the worker takes this lock before any work: held, it waits (the hooks never take it)
        with _worker.WORKER._condition if variant.worker_at_flush else contextlib.nullcontext(), GRAD_MODE():
            for _ in range(forwards):
                variant.model(x)
        launched = time.perf_counter()
        variant.flush()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / forwards, (launched - start) / forwards
    finally:
        variant.after()


def overhead(base: nn.Module, batch: int, seq: int, forwards: int, repeats: int) -> dict[str, Any]:
    x = torch.randn(batch, seq, 768, device="cuda", dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as trace_dir:
        variants = make_variants(base, trace_dir)
        try:
            for variant in variants:  # warm-up: allocator, Triton compilation, event and row pools
                timed(variant, x, 3)
            samples: dict[str, list[float]] = {variant.name: [] for variant in variants}
            host: dict[str, list[float]] = {variant.name: [] for variant in variants}
            for round_number in range(repeats):
                shift = round_number % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    total, launched = timed(variant, x, forwards)
                    samples[variant.name].append(total)
                    host[variant.name].append(launched)
        finally:
            for variant in variants:
                variant.close()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    none = medians["none"]
    return {
        "ms_per_forward": {name: round(value * 1e3, 4) for name, value in medians.items()},
        # host time per forward until the loop ended: above ms_per_forward's device share, the host is the bound
        "host_ms_per_forward": {name: round(statistics.median(values) * 1e3, 4) for name, values in host.items()},
        "x_none": {name: round(value / none, 4) for name, value in medians.items()},
        # against the floor of any hook-based tracer: where x_none["empty_hooks"] is above the target, none can meet it
        "x_empty_hooks": {name: round(value / medians["empty_hooks"], 4) for name, value in medians.items()},
        "iqr_pct": {name: round(_iqr(values) / statistics.median(values) * 100, 1) for name, values in samples.items()},
    }


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 4:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def timing_accuracy(base: nn.Module, runs: int, stats: bool) -> dict[str, Any]:
    """Median span duration per module vs the module alone on the same input, timed with CUDA events. With
    statistics on, a container's span also holds its children's statistics kernels (work tracing adds)."""
    model = copy.deepcopy(base)
    x = torch.randn(16, 512, 768, device="cuda", dtype=torch.bfloat16)
    modules = dict(model.named_modules())
    inputs: dict[str, tuple] = {}

    def keep(path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs.setdefault(path, (args, kwargs))

        return hook

    keepers = [modules[path].register_forward_pre_hook(keep(path), with_kwargs=True) for path in TIMED_MODULES]
    with GRAD_MODE():
        model(x)
    for keeper in keepers:
        keeper.remove()
    with torchtrace.instrument(
        model, exporter="none", stats=stats, records=torchtrace.Records(max_records=runs * 200)
    ) as handle:
        with GRAD_MODE():
            for _ in range(runs):
                model(x)
        records = handle.records
    result = {}
    for path in TIMED_MODULES:
        spans = [(r.end_ns - r.start_ns) / 1e6 for r in records if r.path == path and r.kind == "forward"]
        alone = _alone_ms(modules[path], *inputs[path], runs)
        span_ms = statistics.median(spans)
        result[path] = {
            "span_ms": round(span_ms, 4),
            "alone_ms": round(alone, 4),
            "error": round(abs(span_ms - alone) / alone, 4),
        }
    return result


def _alone_ms(module: nn.Module, args: tuple, kwargs: dict, runs: int) -> float:
    times = []
    with GRAD_MODE():
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # a busy stream: `start` then times the kernels, not the host's launch gap
            start.record()
            module(*args, **kwargs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_syncs(base: nn.Module) -> dict[str, int]:
    """Synchronizing CUDA calls in one forward (after warm-up), untraced and traced."""
    x = torch.randn(1, 128, 768, device="cuda", dtype=torch.bfloat16)

    def count(model: nn.Module) -> int:
        with GRAD_MODE():
            model(x)  # warm-up: first-use allocations and compilations may synchronize
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(x)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        # only torch's per-call warning: turning the debug mode on also warns once that it is a prototype
        return sum("called a synchronizing CUDA operation" in str(warning.message) for warning in caught)

    untraced = count(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with torchtrace.instrument(model, exporter="none"):
        traced = count(model)
    return {"untraced": untraced, "traced": traced, "added": traced - untraced}


def peak_memory(
    base: nn.Module, batch: int = 16, seq: int = 512, device: str = "cuda", stats_batch: int = 1, grad_mode: Any = None
) -> dict[str, Any]:
    """Device memory a forward peaks at above what was allocated before it (MiB), untraced and then traced with
    every statistic (the same model, instrumented after its untraced forwards; ``stats_batch``: Stats.batch): the
    statistics rows, the event pools and anything tracing holds or defers. Target: at most PEAK_TARGET_MIB added."""
    model = copy.deepcopy(base)
    x = torch.randn(batch, seq, 768, device=device, dtype=torch.bfloat16)

    def peak() -> float:
        # each phase above what is allocated as it begins (the model, its input): garbage of the benchmark's earlier
        # parts collected during one phase would otherwise count against it
        gc.collect()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        with (grad_mode or GRAD_MODE)():
            for _ in range(3):  # warm-up: allocator, kernels, the traced model's pools; batched kinds checked (two)
                model(x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            model(x)
            torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - allocated) / 2**20

    untraced = peak()
    with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(batch=stats_batch)):
        traced = peak()
    added = traced - untraced
    return {
        "untraced_mib": round(untraced, 1),
        "traced_mib": round(traced, 1),
        "added_mib": round(added, 1),
        "target_mib": PEAK_TARGET_MIB,
        "met": added <= PEAK_TARGET_MIB,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--forwards", type=int, default=None, help="forwards per timed repetition")
    parser.add_argument("--grad-mode", choices=("inference", "no_grad"), default="inference")
    parser.add_argument(
        "--split",
        action="store_true",
        help="also time torchtrace with the dispatch worker held off, with the CUDA driver's calls stubbed, and with "
        "both: where a traced forward's host time goes (the docstring says how)",
    )
    args = parser.parse_args(argv)
    global GRAD_MODE, SPLIT
    SPLIT = args.split
    GRAD_MODE = torch.no_grad if args.grad_mode == "no_grad" else torch.inference_mode
    if not torch.cuda.is_available():
        print(json.dumps({"gpu": {"skipped": "no CUDA device"}}))
        return 0
    repeats = args.repeats or (3 if args.quick else 15)
    forwards = args.forwards or (2 if args.quick else 10)
    torch.backends.mha.set_fastpath_enabled(False)  # same math and calls for every variant (docstring)
    base = encoder()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "grad_mode": args.grad_mode,
        "fused_kernel": _device.fused_kernel(torch.empty(1, device="cuda", dtype=torch.bfloat16)) is not None,
        "configs": [],
    }
    for config in CONFIGS:
        result = overhead(base, config["batch"], config["seq"], forwards, repeats)
        ratio = result["x_none"]["torchtrace"]
        result.update(config, met=ratio <= config["target"])
        report["configs"].append(result)
        print(json.dumps(result), flush=True)
    runs = 5 if args.quick else 30
    for name, stats in (("timing", False), ("timing_with_stats", True)):
        accuracy = timing_accuracy(base, runs, stats)
        worst = max(entry["error"] for entry in accuracy.values())
        report[name] = {"modules": accuracy, "max_error": worst, "target": TIMING_TARGET, "met": worst <= TIMING_TARGET}
    report["host_syncs"] = host_syncs(base)
    report["peak_memory"] = peak_memory(base)
    report["peak_memory_batched"] = peak_memory(base, stats_batch=8, grad_mode=torch.no_grad)
    # a kernel that failed to compile or launch is replaced by torch ops for good (one warning): say if it happened
    report["fused_kernel_failed"] = _device._triton is False and report["fused_kernel"]
    print(json.dumps({"gpu": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
