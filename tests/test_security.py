"""Security defaults: loopback metrics, no tensor values in exported spans unless asked, span limits (see
test_span_limits.py)."""

from __future__ import annotations

import json

import torch
from prometheus_client import CollectorRegistry
from torch import nn

import torchtrace


def test_metrics_bind_loopback_unless_told_otherwise() -> None:
    with torchtrace.serve_metrics(0, registry=CollectorRegistry()) as server:
        assert server.addr == "127.0.0.1"
        assert server.url.startswith("http://127.0.0.1:")


def test_captured_tensors_stay_in_records_and_never_reach_spans(tmp_path) -> None:
    secret = 1234.5678
    model = nn.Sequential(nn.Identity())
    trace_file = tmp_path / "t.jsonl"
    with torchtrace.instrument(
        model,
        exporter="file",
        trace_file=str(trace_file),
        stats=("shape", "dtype"),
        records=torchtrace.Records(capture_tensors=True),
    ) as handle:
        model(torch.full((3,), secret))
        handle.flush()
        (record, _) = handle.records
    assert torch.equal(record.tensors[""], torch.full((3,), secret))  # opted in: kept in memory
    exported = trace_file.read_text()
    spans = [
        span
        for line in exported.splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    assert len(spans) == 2
    assert "1234.5" not in exported  # no raw value anywhere in what left the process
