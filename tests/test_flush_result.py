"""``flush()`` tells the truth: True only when everything recorded since the previous flush was delivered, False
when any of it failed (a refused endpoint, an unwritable trace file) or was dropped."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fault_receivers import free_port
from otlp_receiver import otlp_http_receiver as otlp_http_receiver  # noqa: F401 - fixture
from torch import nn

import torchtrace


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4))


@pytest.fixture
def otlp_env(monkeypatch):
    def configure(endpoint: str, protocol: str) -> None:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")

    return configure


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_flush_is_false_when_the_endpoint_refuses(otlp_env, protocol):
    otlp_env(f"http://127.0.0.1:{free_port()}", protocol)
    model = _model()
    with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=60_000)) as handle:
        model(torch.ones(1, 4))
        assert handle.flush() is False
        assert handle.failed_spans == 2
        assert handle.flush() is True  # nothing recorded since: nothing more was lost
        model(torch.ones(1, 4))
        assert handle.flush() is False  # dropped during the backoff: counted, and said
        assert handle.failed_spans == 4


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_flush_is_false_when_the_trace_file_cannot_be_written():
    model = _model()
    with torchtrace.instrument(
        model, exporter="file", trace_file="/dev/full", limits=torchtrace.Limits(export_interval_ms=60_000)
    ) as handle:
        model(torch.ones(1, 4))
        assert handle.flush() is False
        assert handle.failed_spans == 2


def test_flush_is_false_when_the_buffer_dropped_calls(tmp_path):
    model = _model()
    limits = torchtrace.Limits(max_pending_calls=2, export_interval_ms=60_000)
    with torchtrace.instrument(model, exporter="file", trace_file=str(tmp_path / "t.jsonl"), limits=limits) as handle:
        model(torch.ones(1, 4))
        model(torch.ones(1, 4))  # over max_pending_calls waiting for the exporter: dropped whole, counted
        assert handle.flush() is False
        assert handle.dropped_calls == 2


def test_flush_is_true_when_everything_arrived(otlp_env, otlp_http_receiver, tmp_path):
    otlp_env(otlp_http_receiver.endpoint, "http/protobuf")
    model = _model()
    with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=60_000)) as handle:
        model(torch.ones(1, 4))
        assert handle.flush() is True
        assert handle.exported_spans == 2
    assert len(otlp_http_receiver.spans()) == 2
    trace_file = tmp_path / "t.jsonl"
    with torchtrace.instrument(model, exporter="file", trace_file=str(trace_file)) as handle:
        model(torch.ones(1, 4))
        assert handle.flush() is True
    lines = trace_file.read_text().splitlines()
    assert sum(len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in lines) == 2
