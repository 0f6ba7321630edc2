"""Inference as it runs in production: a FastAPI app served by uvicorn, traced by OpenTelemetry and torchtrace.

    OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 python examples/fastapi_server.py --port 8000 --sample-ratio 0.1

    curl -s localhost:8000/classify -d '{"input_ids": [[5, 17, 42], [7, 8, 9, 10, 11]]}' \\
         -H 'content-type: application/json' \\
         -H 'traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'

opentelemetry-instrumentation-fastapi makes one SERVER span per request (parented by the client's W3C
``traceparent`` when it sends one); the model runs inside it, so torchtrace's module spans are its children, in
the same trace. The model is a HuggingFace BERT classifier built from a small config (no download) and takes a
batch of token-id sequences of any length (padded here, with an attention mask).

Sampling is decided once per request, by the SDK's ``ParentBased(TraceIdRatioBased(ratio))`` sampler: a request
whose caller sampled it (``traceparent`` flags ``01``) is traced, one whose caller did not (``00``) is not, and a
request without a caller is traced with probability ``--sample-ratio``. torchtrace follows the request's decision
(an unsampled parent means an untraced forward), so a trace holds the request and all of its module spans, or
nothing. Both exporters read the standard ``OTEL_EXPORTER_OTLP_*`` variables; torchtrace sends its spans with its
own OTLP encoder (``exporter="otlp"``: no SDK span objects per module call).

On SIGTERM / Ctrl-C uvicorn runs the app's shutdown, which removes the hooks and flushes both exporters.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
import transformers
import uvicorn
from fastapi import FastAPI, HTTPException
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from pydantic import BaseModel, Field

import torchtrace

VOCAB = 1000
MAX_TOKENS = 128
LABELS = 3


class ClassifyRequest(BaseModel):
    input_ids: list[list[int]] = Field(min_length=1, description="token-id sequences, each of any length >= 1")


class ClassifyReply(BaseModel):
    labels: list[int]
    probabilities: list[list[float]]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_TOKENS,
        num_labels=LABELS,
    )
    return transformers.BertForSequenceClassification(config).eval()


def pad(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (input_ids, attention_mask); HTTP 422 for ids or lengths out of range."""
    if any(not 1 <= len(ids) <= MAX_TOKENS for ids in sequences):
        raise HTTPException(422, f"each sequence needs 1..{MAX_TOKENS} tokens")
    if any(not 0 <= token < VOCAB for ids in sequences for token in ids):
        raise HTTPException(422, f"token ids must be in 0..{VOCAB - 1}")
    length = max(len(ids) for ids in sequences)
    input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


def create_app(sample_ratio: float) -> FastAPI:
    provider = TracerProvider(
        resource=Resource.create({"service.name": "fastapi-inference"}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    model = build_model()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        handle = torchtrace.instrument(model, exporter="otlp")
        try:
            yield
        finally:
            handle.remove()  # every module span recorded reaches the exporter
            provider.shutdown()  # the request spans too

    app = FastAPI(lifespan=lifespan)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/classify")
    def classify(request: ClassifyRequest) -> ClassifyReply:
        # A sync endpoint runs in Starlette's thread pool with the request's context copied in, so the model's
        # spans find the SERVER span as their parent.
        input_ids, attention_mask = pad(request.input_ids)
        with torch.inference_mode():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        probabilities = logits.softmax(dim=-1)
        return ClassifyReply(labels=probabilities.argmax(dim=-1).tolist(), probabilities=probabilities.tolist())

    # The SERVER span only (no internal span per ASGI send / receive message), and none for health checks.
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=provider, exclude_spans=["receive", "send"], excluded_urls="healthz"
    )
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sample-ratio", type=float, default=1.0, help="requests traced without a caller's decision")
    args = parser.parse_args(argv)
    if not 0.0 <= args.sample_ratio <= 1.0:
        parser.error("--sample-ratio must be in 0..1")
    uvicorn.run(create_app(args.sample_ratio), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
