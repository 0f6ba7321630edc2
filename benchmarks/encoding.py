"""Cost of turning finished module calls into OTLP request bytes, per span.

(a) sdk: ReadableSpans (built beforehand, not timed) through opentelemetry-exporter-otlp's ``encode_spans`` +
    ``SerializeToString``, i.e. one protobuf object per span, what the SDK's OTLP exporters do;
(b) torchtrace: ``encode_export_request`` on the ModuleCall records.

~6,000 spans shaped like a transformer forward (paths "layers.3.linear1", 14 attributes: an int-array shape, a
dtype string, 10 float stats, 2 more ints), repetitions interleaved so machine noise hits both alike.

Then the spans of real forwards as the exporters get them (the columns of 64 x (Linear(32) + ReLU) traced with every
statistic, 129 calls a forward), the same input shape every forward and then a new one every forward (a new batch
size: as a new sequence length every request): OTLP protobuf (the OTLP exporters), OTLP/JSON (the file exporter)
with its templates filled in C (``torchtrace._otlp._json_text``) and by Python's ``%`` (an install without a C
compiler), interleaved in the same way. The worker spends this per span; on one GIL, beside a host-bound model,
the model's thread waits for it.
Run: python benchmarks/encoding.py [--spans N] [--reps R] [--forwards F]
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

import torch  # noqa: E402

import torchtrace  # noqa: E402
from torchtrace._core.calls import Calls, ModuleCall  # noqa: E402
from torchtrace._otlp import json_lines  # noqa: E402
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


def forward_segments(forwards: int, new_shapes: bool = False) -> list:
    """What the exporters get for ``forwards`` forwards of the cheap model with every statistic: columns, one
    segment a forward, no ModuleCall made; with ``new_shapes``, forward i's batch is i + 1 rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(64) for m in (torch.nn.Linear(32, 32), torch.nn.ReLU())])
    delivered: list = []
    with torchtrace.instrument(model, exporter="none", sinks=[delivered.append]) as handle, torch.no_grad():
        for i in range(forwards):
            model(torch.randn(i + 1 if new_shapes else 1, 32))
        handle.flush()
    return [segment for calls in delivered for segment in calls.segments]


def encode_forwards(resource: Resource, forwards: int, reps: int, new_shapes: bool = False) -> dict[str, float]:
    """Median us a span of each encoder over the same forwards, interleaved."""
    calls = Calls(forward_segments(forwards, new_shapes))
    compiled_text = json_lines._percent_format

    def protobuf() -> None:
        encode_export_request(calls, resource, "torchtrace", "0")

    def json_text(writer: object) -> None:
        json_lines._percent_format = writer
        try:
            json_lines.encode_otlp_json(calls, resource, "torchtrace", "0")
        finally:
            json_lines._percent_format = compiled_text

    encoders = {"protobuf": protobuf, "json_python_text": lambda: json_text(None)}
    if compiled_text is not None:
        encoders["json"] = lambda: json_text(compiled_text)
    timings: dict[str, list[float]] = {name: [] for name in encoders}
    for encode in encoders.values():
        encode()  # the templates made once, as a running job has them
    for _ in range(reps):
        for name, encode in encoders.items():
            t0 = time.perf_counter()
            encode()
            timings[name].append((time.perf_counter() - t0) / len(calls) * 1e6)
    shapes = "a new input shape every forward" if new_shapes else "one input shape"
    print(f"{len(calls)} spans of {forwards} forwards (columns), every statistic, {shapes}, {reps} interleaved reps")
    print(f"{'encoder':<18}{'median us/span':>16}{'min':>10}")
    for name, ts in timings.items():
        print(f"{name:<18}{statistics.median(ts):>16.2f}{min(ts):>10.2f}")
    if compiled_text is None:
        print("torchtrace._otlp._json_text is not built: the JSON text is filled by Python's % only")
    return {f"{name}_us_per_span": round(statistics.median(ts), 3) for name, ts in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=6000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--forwards", type=int, default=50, help="real forwards for the second part")
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
    forwards = encode_forwards(resource, args.forwards, args.reps)
    new_shapes = encode_forwards(resource, args.forwards, args.reps, new_shapes=True)
    report = {"sdk_us_per_span": result["sdk"], "torchtrace_us_per_span": result["torchtrace"], "forwards": forwards,
              "forwards_new_shapes": new_shapes}  # fmt: skip
    print(json.dumps({"encoding": report}))


if __name__ == "__main__":
    main()
