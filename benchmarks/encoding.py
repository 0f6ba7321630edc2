"""Cost of turning finished module calls into OTLP request bytes, per span.

(a) sdk: ReadableSpans (built beforehand, not timed) through opentelemetry-exporter-otlp's ``encode_spans`` +
    ``SerializeToString``, i.e. one protobuf object per span, what the SDK's OTLP exporters do;
(b) torchtrace: ``encode_export_request`` on the ModuleCall records.

~6,000 spans shaped like a transformer forward (paths "layers.3.linear1", 14 attributes: an int-array shape, a
dtype string, 10 float stats, 2 more ints), repetitions interleaved so machine noise hits both alike.
Run: python benchmarks/encoding.py [--spans N] [--reps R]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtrace._core.calls import ModuleCall  # noqa: E402
from torchtrace._otlp.protobuf import encode_export_request  # noqa: E402

SUBMODULES = ["self_attn", "self_attn.out_proj", "linear1", "dropout", "linear2", "norm1", "norm2", "dropout1"]
STATS = ["mean", "std", "min", "max", "abs_mean", "l2", "nan_frac", "inf_frac", "zero_frac", "sparsity"]


def make_calls(n_spans: int, seed: int = 0) -> list[ModuleCall]:
    rng = random.Random(seed)
    calls: list[ModuleCall] = []
    t = time.time_ns()
    step = 0
    while len(calls) < n_spans:
        trace_id = rng.getrandbits(128)
        root_id = rng.getrandbits(64) | 1
        calls.append(ModuleCall("", "Transformer", 0, trace_id, root_id, 0, t, t + 10_000_000, {"step": step}))
        for layer in range(12):
            for sub in SUBMODULES:
                attrs = {"shape": [8, 64, 256], "dtype": "torch.float32", "numel": 131072}
                attrs.update((s, rng.random()) for s in STATS)
                attrs["layer"] = layer
                start = t + rng.randrange(1_000_000)
                calls.append(
                    ModuleCall(
                        f"layers.{layer}.{sub}",
                        "Linear",
                        2,
                        trace_id,
                        rng.getrandbits(64) | 1,
                        root_id,
                        start,
                        start + 20_000,
                        attrs,
                    )
                )
        step += 1
    return calls[:n_spans]


def make_sdk_spans(calls: list[ModuleCall], resource: Resource) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("torchtrace", "0")
    for c in calls:
        ctx = None
        if c.parent_span_id:
            parent = SpanContext(c.trace_id, c.parent_span_id, is_remote=False, trace_flags=TraceFlags(1))
            ctx = set_span_in_context(NonRecordingSpan(parent))
        span = tracer.start_span(c.name, context=ctx, attributes=c.attributes, start_time=c.start_ns)
        span.end(end_time=c.end_ns)
    return list(exporter.get_finished_spans())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=6000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    resource = Resource.create({"service.name": "bench"})
    calls = make_calls(args.spans)
    sdk_spans = make_sdk_spans(calls, resource)
    n = len(calls)

    def sdk() -> int:
        return len(encode_spans(sdk_spans).SerializeToString())

    def ours() -> int:
        return len(encode_export_request(calls, resource, "torchtrace", "0"))

    ours()  # warm the template cache once, as a running trainer would have it
    timings: dict[str, list[float]] = {"sdk": [], "torchtrace": []}
    sizes = {}
    for _ in range(args.reps):
        for name, fn in (("sdk", sdk), ("torchtrace", ours)):
            t0 = time.perf_counter()
            sizes[name] = fn()
            timings[name].append((time.perf_counter() - t0) / n * 1e6)

    print(f"{n} spans, {len(calls[1].attributes)} attributes per module span, {args.reps} interleaved reps")
    print(f"{'encoder':<12}{'median us/span':>16}{'min':>10}{'bytes':>12}")
    for name, ts in timings.items():
        print(f"{name:<12}{statistics.median(ts):>16.2f}{min(ts):>10.2f}{sizes[name]:>12}")
    result = {name: round(statistics.median(ts), 3) for name, ts in timings.items()}
    print(json.dumps({"encoding": {"sdk_us_per_span": result["sdk"], "torchtrace_us_per_span": result["torchtrace"]}}))


if __name__ == "__main__":
    main()
