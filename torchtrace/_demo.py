"""``torchtrace demo``: trace a small transformer's inference with the default options and say where spans went."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TextIO

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from torch import nn

import torchtrace
from torchtrace._core.calls import ModuleCall
from torchtrace._otlp.exporters import create_sdk_span_exporter, default_resource, otlp_endpoint_configured

SEED = 0
VOCAB = 1000
D_MODEL = 128
HEADS = 4
LAYERS = 4
CLASSES = 10
BATCH = 8
SEQUENCE = 32


class DemoTransformer(nn.Module):
    """Token embedding, a stack of encoder layers, mean pooling, a linear classification head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens)).mean(dim=1))


class _CallCounter:
    """A sink counting the calls handed to the exporters (the dispatcher gives every sink the same batches)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        with self._lock:
            self.calls += len(calls)


def _progress(items: Iterable[int], total: int, stream: TextIO) -> Iterator[int]:
    """tqdm when it is installed (it is not a dependency), else a one-line progress counter on ``stream``."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc="inference", unit="batch", file=stream)
        return
    for done, item in enumerate(items, start=1):
        yield item
        stream.write(f"\rinference: {done}/{total} batches")
        stream.flush()
    stream.write("\n")
    stream.flush()


def _exporter_counts(handle: torchtrace.TraceHandle) -> tuple[int, int] | None:
    """(exported, failed) span counts of the OTLP/file exporter sink, when it keeps them."""
    if handle.exported_spans is None:
        return None
    return handle.exported_spans, handle.failed_spans


def _where(handle: torchtrace.TraceHandle, spans: int, requests: int = 0) -> str:
    """Where the model's ``spans`` went, and the demo's own ``requests`` spans (0: the application's provider's)."""
    counts = _exporter_counts(handle)
    failed = f" ({counts[1]} failed to export)" if counts and counts[1] else ""
    if counts:
        spans = counts[0]
    what = f"{spans} model spans under {requests} demo.inference" if requests else str(spans)
    if handle.exporter == "file" or (requests and handle.exporter == "sdk"):  # sdk: the demo's own, to the file
        path = os.path.abspath(handle.options.trace_file.path)
        return f"traces: {what} spans appended as OTLP JSON lines to {path}{failed}"
    if handle.exporter == "otlp":
        protocol = (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint:
            endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
            if protocol == "http/protobuf":  # the generic variable is a base URL: the exporter appends the path
                endpoint = endpoint.rstrip("/") + "/v1/traces"
        from torchtrace._otlp.exporters import redact

        return f"traces: {what} spans sent over OTLP ({protocol}) to {redact(endpoint)}{failed}"
    if handle.exporter == "sdk":
        return f"traces: {what} spans handed to the OpenTelemetry SDK TracerProvider (its exporters decide where)"
    return f"traces: not exported (exporter={handle.exporter!r}); {spans} calls recorded"


def run_demo(
    *,
    batches: int = 50,
    otlp_endpoint: str | None = None,
    protocol: str | None = None,
    trace_file: str | None = None,
    stats: bool = True,
    out: TextIO | None = None,
    progress: TextIO | None = None,
) -> int:
    """Runs the demo; returns the exit status (1 if spans failed to export)."""
    out = out or sys.stdout
    progress = progress or sys.stderr
    # a flag beats the environment: the traces-specific variables would otherwise win over the generic ones
    if otlp_endpoint:
        os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    if protocol:
        os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)
        os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol

    torch.manual_seed(SEED)
    model = DemoTransformer().eval()
    generator = torch.Generator().manual_seed(SEED)
    inputs = [torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator) for _ in range(min(batches, 8))]

    counter = _CallCounter()
    provider, owned = _request_tracer_provider(trace_file)
    handle = torchtrace.instrument(
        model,
        exporter="otlp" if otlp_endpoint else None,
        # no endpoint: the model's spans go through the same provider as the requests, to the same file
        tracer_provider=None if otlp_endpoint_configured() else provider,
        trace_file=trace_file,
        stats=None if stats else False,
        sinks=[counter],
    )
    tracer = provider.get_tracer("torchtrace.demo", torchtrace.__version__)
    try:
        with torch.inference_mode():
            for batch in _progress(range(batches), batches, progress):
                # the production pattern: each request a span of the application, the model's spans its children
                with tracer.start_as_current_span("demo.inference", attributes={"demo.batch": batch}):
                    model(inputs[batch % len(inputs)])
        handle.flush()
        print(handle.summary(limit=20), file=out)
        print(file=out)
        print(_where(handle, counter.calls, batches if owned else 0), file=out)
        counts = _exporter_counts(handle)
        in_file = handle.exporter == "file" or (owned and handle.exporter == "sdk")
        spans_file = os.path.abspath(handle.options.trace_file.path)
    finally:
        handle.remove()
        if owned:
            provider.shutdown()  # delivers the request spans
    if in_file:
        from torchtrace._offline.report import write_report

        report = os.path.join(os.path.dirname(spans_file), "report.html")
        write_report([spans_file], report)
        print(f"report: {report} (open it in a browser)", file=out)
    return 1 if counts and counts[1] else 0


def _request_tracer_provider(trace_file: str | None) -> tuple[trace.TracerProvider, bool]:
    """The SDK TracerProvider of the demo's request spans: the application's, when one is installed (e.g. by
    ``opentelemetry-instrument``), else one of the demo's own exporting where torchtrace does (the endpoint, else
    the trace file); and whether it is the demo's own."""
    current = trace.get_tracer_provider()
    if hasattr(current, "add_span_processor"):
        return current, False
    provider = TracerProvider(resource=default_resource(), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(create_sdk_span_exporter(trace_file)))
    return provider, True
