"""Overhead of tracing every module call, side by side: no tracing, empty hooks, naive OTel, profiler, torchtrace.

Every variant runs on its own copy of the model with its own hooks (installed once, removed at the end), and the
timed repetitions are interleaved round-robin (the starting variant rotates every round) so that machine noise hits
all variants alike. One timed repetition = N forwards, then the variant's flush: export work is inside the window.

Reported per variant (medians over repetitions, per forward):
  us_per_call = (variant_time - none_time) / module_calls_per_forward: the ADDED cost per module call, in us
  x_floor     = that added cost / the added cost of empty pre+post hooks (the floor of any hook-based tracer;
                torchtrace traces the modules inside the model through their forward, not hooks: see docs)
  x_none      = variant_time / none_time

Models: "cheap" = 64 x (Linear(32, 32) + ReLU) at batch 1 (default grad mode: 129 module calls per forward, the
tracer dominates); "encoder" = 6 x TransformerEncoderLayer(256, nhead=8, batch_first=True) in eval mode at batch 8,
seq 64 under torch.inference_mode(); "varlen" = the same encoder fed a new sequence length every forward (77
lengths in 7..160, as requests are; every variant sees the same lengths in the same order). Any forward hook on a
TransformerEncoderLayer (or its submodules) disables torch's fused encoder fast path (torchtrace's traced forwards
do not: with it on, a layer is one call), so every encoder variant runs with torch.backends.mha fast path OFF (the
same math and the same calls for all); the extra `none_fastpath` variant (encoder only) shows
what the fast path alone is worth.

torchtrace's variants by where spans go: `torchtrace_spans` / `torchtrace_stats` through an SDK TracerProvider,
`*_file` to the file exporter (the embedded default: OTLP/JSON lines in a temporary directory), `*_otlp` to a local
OTLP discard receiver (a separate process).

Layer drift (docs/drift.md): the `*_baseline` variants score every forward against a baseline of the same model,
made by the script first (BASELINE_FORWARDS traced forwards of the same inputs, records kept, `handle.baseline()`).
A baseline, like metrics, sends CPU forwards to the worker instead of delivering them at the forward's end, so each
baseline variant has its pair without one: `torchtrace_stats_otlp` / `torchtrace_stats_otlp_baseline` (shows that
delivery change too) and `torchtrace_stats_otlp_metrics` / `torchtrace_stats_otlp_metrics_baseline` (the scoring
alone). Printed per pair: the median of the per-round ratios (the variants of a round run back to back). Self-check:
every forward a baseline variant ran was scored (the scorer's `scored_forwards`), else the script exits 1; where
they were scored (on the worker, or in the flush on the model's thread) is reported.

Run: python benchmarks/overhead.py [--quick] [--repeats R] [--models cheap,encoder,varlen] [--otlp-protocol P]
     [--threads N]   (torch's intra-op threads; default torch's own: one pass of statistics is single-threaded)
     [--variants NAME,...]   (only these, and always `none` and `empty_hooks`; default: every variant)
The last line printed is one JSON object: {"cheap": {"variants": {name: {"us_per_call", "x_floor", "x_none"}},
"drift": {"baseline_forwards", "variants": {name: {"forwards", "scored_forwards", "scored_on_worker", "drifted"}},
"pairs": {name: {"without", "ratio", "round_ratios"}}}}, ...}
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torchtrace  # noqa: E402

# Large enough that no variant's spans are dropped between two flushes (the default 2048 would drop most of them,
# which makes a span look cheaper than it is).
BSP_QUEUE = 1 << 17

# model -> (forwards per timed repetition, repetitions) for a normal and a --quick run (varlen: every length each time)
PLAN = {"cheap": ((20, 40), (10, 5)), "encoder": ((3, 25), (1, 2)), "varlen": ((77, 4), (20, 2))}
# forwards traced to make the drift variants' baseline (a normal and a --quick run; at least 20 to score a statistic)
BASELINE_FORWARDS = (150, 30)


class DiscardExporter(SpanExporter):
    """Receives every span batch and throws it away."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def sdk_provider() -> tuple[TracerProvider, DiscardExporter]:
    exporter = DiscardExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=BSP_QUEUE, max_export_batch_size=512))
    return provider, exporter


# -- models ----------------------------------------------------------------------------------------------------------


def cheap_model() -> tuple[nn.Module, torch.Tensor, Callable[[], Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(64) for layer in (nn.Linear(32, 32), nn.ReLU())])
    return model, torch.randn(1, 32), contextlib.nullcontext


def encoder_model() -> tuple[nn.Module, torch.Tensor, Callable[[], Any]]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, nhead=8, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).eval()
    return model, torch.randn(8, 64, 256), torch.inference_mode


def varlen_model() -> tuple[nn.Module, list[torch.Tensor], Callable[[], Any]]:
    """The encoder fed a different sequence length every forward (77 lengths in 7..160), as inference on real
    requests is (more lengths than a cache of 64 templates per module would hold)."""
    model, _, grad_context = encoder_model()
    torch.manual_seed(1)
    lengths = [7 + 2 * ((i * 37) % 77) for i in range(77)]  # every other length once, in a scrambled order
    return model, [torch.randn(8, length, 256) for length in lengths], grad_context


MODELS = {"cheap": cheap_model, "encoder": encoder_model, "varlen": varlen_model}


def count_calls(model: nn.Module, x: torch.Tensor, grad_context: Callable[[], Any]) -> int:
    """Module calls in one forward: pre-hook invocations, counted once on a throwaway copy."""
    model = copy.deepcopy(model)
    count = [0]

    def pre(module: nn.Module, args: tuple) -> None:
        count[0] += 1

    handles = [module.register_forward_pre_hook(pre) for module in model.modules()]
    with grad_context():
        model(x)
    for handle in handles:
        handle.remove()
    return count[0]


# -- variants --------------------------------------------------------------------------------------------------------


def _nothing() -> None:
    return None


@dataclass
class Variant:
    name: str
    model: nn.Module
    flush: Callable[[], Any] = _nothing  # inside the timed window, after the N forwards
    close: Callable[[], Any] = _nothing  # after all repetitions
    window: Callable[[], Any] = contextlib.nullcontext  # entered/exited around each timed repetition
    times_ns: list[int] = field(default_factory=list)  # per forward, one per repetition
    drift: Any = None  # the drift variants' DriftScorer
    forwards_run: int = 0  # forwards run, warm-up included
    drift_report: dict = field(default_factory=dict)  # drift: filled at close, before the handle goes


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


def make_none(model: nn.Module) -> Variant:
    return Variant("none", model)


def make_empty_hooks(model: nn.Module) -> Variant:
    def pre(module: nn.Module, args: tuple) -> None:
        pass

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        pass

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return Variant("empty_hooks", model, close=lambda: [handle.remove() for handle in handles])


def _make_naive_otel(model: nn.Module, stats: bool) -> Variant:
    provider, _ = sdk_provider()
    tracer = provider.get_tracer("benchmarks.overhead")
    stack: list[tuple[Any, object]] = []
    set_span_in_context, attach, detach = trace.set_span_in_context, otel_context.attach, otel_context.detach

    def make_pre(name: str):
        def pre(module: nn.Module, args: tuple) -> None:
            span = tracer.start_span(name)  # parent: the current span, i.e. the enclosing module's
            stack.append((span, attach(set_span_in_context(span))))

        return pre

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        span, token = stack.pop()
        if stats:
            tensor = _first_tensor(output)
            if tensor is not None:
                tensor = tensor.detach().float()
                span.set_attributes(
                    {
                        "output.mean": tensor.mean().item(),
                        "output.std": tensor.std().item() if tensor.numel() > 1 else 0.0,
                        "output.min": tensor.min().item(),
                        "output.max": tensor.max().item(),
                        "output.norm": tensor.norm().item(),
                    }
                )
        detach(token)
        span.end()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(make_pre(name or type(module).__name__)))
        handles.append(module.register_forward_hook(post))

    def close() -> None:
        for handle in handles:
            handle.remove()
        provider.shutdown()

    return Variant("naive_otel_stats" if stats else "naive_otel", model, flush=provider.force_flush, close=close)


def make_torch_profiler(model: nn.Module) -> Variant:
    def window():
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    return Variant("torch_profiler", model, window=window)


def _make_torchtrace(model: nn.Module, stats: bool) -> Variant:
    provider, _ = sdk_provider()
    handle = torchtrace.instrument(model, stats=stats, tracer_provider=provider)

    def close() -> None:
        handle.remove()
        provider.shutdown()

    return Variant("torchtrace_stats" if stats else "torchtrace_spans", model, flush=handle.flush, close=close)


def _make_torchtrace_otlp(
    model: nn.Module, stats: bool, metrics: bool = False, baseline: torchtrace.Baseline | None = None
) -> Variant:
    handle = torchtrace.instrument(model, stats=stats, exporter="otlp", metrics=metrics, baseline=baseline)
    # TraceHandle.flush() drains into the sinks; if the OTLP sink sends in the background, flush it too.
    extra = [
        getattr(sink, name)
        for sink in handle._dispatcher.sinks
        for name in ("force_flush", "flush")
        if type(sink).__module__.startswith("torchtrace._otlp.exporters") and callable(getattr(sink, name, None))
    ][:1]

    counted = [sink for sink in handle._dispatcher.sinks if hasattr(sink, "exported") and hasattr(sink, "failed")]
    name = "torchtrace_stats_otlp" if stats else "torchtrace_spans_otlp"
    name += "_metrics" if metrics else ""
    name += "_baseline" if baseline is not None else ""
    scorer = handle._drift
    on_model_thread = [0]
    if scorer is not None:  # counts the forwards a flush scored on the model's thread (one thread-id test each)
        score, model_thread = scorer._score, threading.get_ident()

        def counted_score(batch: Any) -> None:
            if threading.get_ident() == model_thread:
                on_model_thread[0] += 1
            score(batch)

        scorer._score = counted_score

    def flush() -> None:
        handle.flush()
        for function in extra:
            function()

    def close() -> None:
        if scorer is not None:
            variant.drift_report = {
                "forwards": variant.forwards_run,
                "scored_forwards": scorer.scored_forwards,
                "scored_on_worker": scorer.scored_forwards - on_model_thread[0],
                "drifted": len(handle.drift().drifted),  # layer statistics over the threshold at the end
            }
        handle.remove()
        for sink in counted:  # a failing export is cheap: its numbers would mean nothing
            if sink.failed:
                print(f"WARNING: {name}: {sink.failed} spans failed to export ({sink.exported} exported)")

    variant = Variant(name, model, flush=flush, close=close, drift=scorer)
    return variant


def _make_torchtrace_file(model: nn.Module, stats: bool) -> Variant:
    """The embedded default (no endpoint configured): OTLP/JSON lines appended to a trace file, here in a temporary
    directory removed at the end."""
    directory = tempfile.mkdtemp(prefix="torchtrace-overhead-")
    handle = torchtrace.instrument(model, stats=stats, exporter="file", trace_file=os.path.join(directory, "t.jsonl"))

    def close() -> None:
        handle.remove()
        shutil.rmtree(directory, ignore_errors=True)

    name = "torchtrace_stats_file" if stats else "torchtrace_spans_file"
    return Variant(name, model, flush=handle.flush, close=close)


def make_none_fastpath(model: nn.Module) -> Variant:
    @contextlib.contextmanager
    def window():
        torch.backends.mha.set_fastpath_enabled(True)
        try:
            yield
        finally:
            torch.backends.mha.set_fastpath_enabled(False)

    return Variant("none_fastpath", model, window=window)


BASE_VARIANTS: list[Callable[[nn.Module], Variant]] = [
    make_none,
    make_empty_hooks,
    partial(_make_naive_otel, stats=False),
    partial(_make_naive_otel, stats=True),
    make_torch_profiler,
    partial(_make_torchtrace, stats=False),
    partial(_make_torchtrace, stats=True),
    partial(_make_torchtrace_file, stats=False),
    partial(_make_torchtrace_file, stats=True),
]
OTLP_VARIANTS = [partial(_make_torchtrace_otlp, stats=False), partial(_make_torchtrace_otlp, stats=True)]


@dataclass(frozen=True)
class WithBaseline:
    """A variant factory that also takes the model's baseline: ``measure_model`` makes one per model, first."""

    name: str
    make: Callable[..., Variant]  # (model, baseline=) -> Variant


# drift: each *_baseline variant beside the same variant without a baseline (its pair, in DRIFT_PAIRS)
DRIFT_VARIANTS: list[Callable[[nn.Module], Variant] | WithBaseline] = [
    WithBaseline("torchtrace_stats_otlp_baseline", partial(_make_torchtrace_otlp, stats=True)),
    partial(_make_torchtrace_otlp, stats=True, metrics=True),
    WithBaseline("torchtrace_stats_otlp_metrics_baseline", partial(_make_torchtrace_otlp, stats=True, metrics=True)),
]
DRIFT_PAIRS = {
    "torchtrace_stats_otlp_baseline": "torchtrace_stats_otlp",
    "torchtrace_stats_otlp_metrics_baseline": "torchtrace_stats_otlp_metrics",
}
ALWAYS = ("none", "empty_hooks")  # every ratio is to these


# -- the local OTLP discard receiver (a separate process: it must not take the benchmark's GIL) ---------------------


def serve_discard(protocol: str) -> None:
    """Accepts OTLP trace exports on 127.0.0.1, answers success, keeps nothing. Prints the port, then serves."""
    if protocol == "grpc":
        from concurrent import futures

        import grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")},  # raw bytes both ways
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(port, flush=True)
        server.wait_for_termination()
        return
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like a collector

        def do_POST(self) -> None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().strip() or b"0", 16)
                    self.rfile.read(size + 2)
                    if size == 0:
                        break
            else:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")  # an empty ExportTraceServiceResponse
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@contextlib.contextmanager
def discard_receiver(protocol: str):
    """Starts the receiver process; yields its endpoint URL."""
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve-discard", protocol], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


# -- measuring -------------------------------------------------------------------------------------------------------


def timed_repetition(variant: Variant, inputs: list[torch.Tensor], forwards: int, first: int = 0) -> int:
    """Nanoseconds per forward for N forwards (inputs taken in turn from ``first``) plus the variant's flush."""
    model, flush = variant.model, variant.flush
    start = time.perf_counter_ns()
    with variant.window():
        for i in range(first, first + forwards):
            model(inputs[i % len(inputs)])
        flush()
    elapsed = time.perf_counter_ns() - start
    variant.forwards_run += forwards
    return elapsed // forwards


def build_baseline(base: nn.Module, inputs: list[torch.Tensor], grad_context: Callable[[], Any], forwards: int,
                   calls: int) -> torchtrace.Baseline:  # fmt: skip
    """The drift variants' baseline: ``forwards`` traced forwards of a copy of the model on the inputs the timing
    uses (in turn), every statistic, records kept, ``handle.baseline()``. The timed forwards are then in
    distribution: their scores stay near 0, as a model that behaves as it did (the common case) gives."""
    model = copy.deepcopy(base)
    handle = torchtrace.instrument(
        model, exporter="none", records=torchtrace.Records(max_records=(forwards + 1) * calls)
    )
    try:
        with grad_context():
            for i in range(forwards):
                model(inputs[i % len(inputs)])
        handle.flush()
        return handle.baseline()
    finally:
        handle.remove()


def measure_model(name: str, factories: Sequence[Callable[[nn.Module], Variant]], args: argparse.Namespace) -> dict:
    base, x, grad_context = MODELS[name]()
    inputs = x if isinstance(x, list) else [x]
    (forwards, repeats), (quick_forwards, quick_repeats) = PLAN[name]
    if args.quick:
        forwards, repeats = quick_forwards, quick_repeats
    if args.repeats:
        repeats = args.repeats
    if args.forwards:
        forwards = args.forwards
    encoder = name in ("encoder", "varlen")
    fastpath_before = torch.backends.mha.get_fastpath_enabled()
    if encoder:
        torch.backends.mha.set_fastpath_enabled(False)  # same math and calls for every variant (docstring)
        factories = [*factories, make_none_fastpath]
    calls = count_calls(base, inputs[0], grad_context)
    chosen = set(args.variants.split(",")) | set(ALWAYS) if args.variants else None
    baseline, baseline_forwards = None, BASELINE_FORWARDS[1 if args.quick else 0]
    if any(isinstance(f, WithBaseline) and (chosen is None or f.name in chosen) for f in factories):
        started = time.perf_counter()
        baseline = build_baseline(base, inputs, grad_context, baseline_forwards, calls)
        print(f"{name}: baseline of {baseline.forwards} forwards, {len(baseline.references)} layer statistics "
              f"({time.perf_counter() - started:.1f} s)")  # fmt: skip
    variants = []
    for factory in factories:
        if isinstance(factory, WithBaseline):
            if chosen is None or factory.name in chosen:
                variants.append(factory.make(copy.deepcopy(base), baseline=baseline))
            continue
        variant = factory(copy.deepcopy(base))
        if chosen is None or variant.name in chosen:
            variants.append(variant)
        else:
            variant.close()
    unknown = chosen - {variant.name for variant in variants} - {"none_fastpath"} if chosen else set()
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}")
    try:
        with grad_context():
            for variant in variants:  # warm-up round, not timed (first calls, lazy imports, thread starts)
                timed_repetition(variant, inputs, 1)
            for round_index in range(repeats):
                shift = round_index % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    gc.collect()
                    # every variant gets the same inputs in a round (varlen: a new length each forward)
                    variant.times_ns.append(timed_repetition(variant, inputs, forwards, round_index * forwards))
    finally:
        for variant in variants:
            variant.close()
        torch.backends.mha.set_fastpath_enabled(fastpath_before)
    result = report(name, variants, calls, forwards, repeats)
    if baseline is not None:
        result["drift"] = drift_report(name, variants, baseline_forwards)
    return result


def drift_report(name: str, variants: list[Variant], baseline_forwards: int) -> dict:
    """The drift variants' self-check (every forward they ran was scored) and each one against its pair."""
    by_name = {variant.name: variant for variant in variants}
    checks = {variant.name: variant.drift_report for variant in variants if variant.drift is not None}
    pairs = {}
    print(f"\n-- {name}: drift ({baseline_forwards} baseline forwards); per-round ratios, with / without a baseline")
    for with_name, without_name in DRIFT_PAIRS.items():
        if with_name not in by_name or without_name not in by_name:
            continue
        rounds = [a / b for a, b in zip(by_name[with_name].times_ns, by_name[without_name].times_ns)]
        low, high = (min(rounds), max(rounds)) if rounds else (math.nan, math.nan)
        ratio = statistics.median(rounds) if rounds else math.nan
        pairs[with_name] = {"without": without_name, "ratio": round(ratio, 4),
                            "round_ratios": [round(value, 4) for value in rounds]}  # fmt: skip
        print(f"{with_name:<40} / {without_name:<30} median {ratio:.3f} (rounds {low:.3f}-{high:.3f})")
    for variant_name, check in checks.items():
        scored, forwards, on_worker = check["scored_forwards"], check["forwards"], check["scored_on_worker"]
        print(f"{variant_name}: {scored} of {forwards} forwards scored, {on_worker} on the worker (the rest in a "
              f"flush); {check['drifted']} layer statistics drifted at the end")  # fmt: skip
    return {"baseline_forwards": baseline_forwards, "variants": checks, "pairs": pairs}


def report(name: str, variants: list[Variant], calls: int, forwards: int, repeats: int) -> dict:
    medians = {v.name: statistics.median(v.times_ns) for v in variants}
    none = medians["none"]
    floor_added = medians["empty_hooks"] - none
    results: dict[str, dict[str, float | None]] = {}
    print(f"\n== {name}: {calls} module calls per forward, {forwards} forwards x {repeats} repetitions per variant")
    width = max(22, *(len(variant.name) for variant in variants))
    header = f"{'variant':<{width}} {'ms/forward':>11} {'IQR':>6} {'us_per_call':>12} {'x_floor':>8} {'x_none':>7}"
    print(header)
    print("-" * len(header))
    for variant in variants:
        times = sorted(variant.times_ns)
        median = medians[variant.name]
        if len(times) >= 4:
            quartiles = statistics.quantiles(times, n=4)
            spread = f"{(quartiles[2] - quartiles[0]) / median:>6.1%}"
        else:
            spread = f"{'-':>6}"
        added_per_call = (median - none) / calls / 1e3
        x_floor = (median - none) / floor_added if floor_added > 0 else None
        x_none = median / none
        results[variant.name] = {
            "us_per_call": round(added_per_call, 3),
            "x_floor": None if x_floor is None else round(x_floor, 3),
            "x_none": round(x_none, 3),
        }
        floor_text = f"{x_floor:>8.2f}" if x_floor is not None else f"{'n/a':>8}"
        figures = f"{median / 1e6:>11.3f} {spread} {added_per_call:>12.2f} {floor_text} {x_none:>7.3f}"
        print(f"{variant.name:<{width}} {figures}")
    if floor_added <= 0:
        print("note: empty hooks measured no slower than no hooks (noise): x_floor is null")
    return {"variants": results, "calls_per_forward": calls, "forwards_per_repetition": forwards, "repeats": repeats}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test; < 60 s)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--forwards", type=int, default=None, help="forwards per timed repetition")
    parser.add_argument("--models", default="cheap,encoder,varlen", help="comma-separated: cheap, encoder, varlen")
    parser.add_argument("--otlp-protocol", default="http/protobuf", choices=("http/protobuf", "grpc"))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (none, empty_hooks always)")
    parser.add_argument("--serve-discard", choices=("http/protobuf", "grpc"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_discard:
        serve_discard(args.serve_discard)
        return 0
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    chosen = "set by --threads" if args.threads is not None else "default, not changed"
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()} ({chosen})")
    print(f"torchtrace {torchtrace.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    factories = list(BASE_VARIANTS)
    with discard_receiver(args.otlp_protocol) as endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = args.otlp_protocol
        print(f"OTLP variants export to a local discard receiver at {endpoint} ({args.otlp_protocol})")
        factories += [*OTLP_VARIANTS, *DRIFT_VARIANTS]
        results = {name: measure_model(name, factories, args) for name in models}
    unscored = [f"{name}: {variant}: {check['scored_forwards']} of {check['forwards']} forwards scored"
                for name, result in results.items() if "drift" in result
                for variant, check in result["drift"]["variants"].items()
                if check["scored_forwards"] != check["forwards"]]  # fmt: skip
    for model_results in results.values():
        for values in model_results["variants"].values():
            for key, value in values.items():
                if isinstance(value, float) and not math.isfinite(value):
                    values[key] = None
    print(json.dumps(results, separators=(",", ":")))
    if unscored:  # the drift variants must have scored every forward they ran, or their timing means nothing
        print("self-check failed: " + "; ".join(unscored), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
