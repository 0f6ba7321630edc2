"""``torchtrace demo`` / ``python -m torchtrace demo``: runs end to end in a subprocess, and its argument parsing."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import checkout_env
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from torchtrace.cli import build_parser, main
from torchtrace.testing import check_traces

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 3
CALLS_PER_FORWARD = 8  # model, embedding, encoder, 4 layers (torch runs them fused: no submodule is called), head


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("demo")
    trace_file = tmp / "t.jsonl"
    env = checkout_env()
    result = subprocess.run(
        [sys.executable, "-m", "torchtrace", "demo", "--batches", str(BATCHES), "--trace-file", str(trace_file)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return result, trace_file


def test_demo_exits_zero_and_prints_the_summary(demo: tuple[subprocess.CompletedProcess, Path]) -> None:
    result, _ = demo
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("layer"))
    assert all(column in header for column in ("calls", "total ms", "mean ms", "p95 ms", "share"))
    start = lines.index(header) + 2  # the header, then a line of dashes
    rows = lines[start : lines.index("", start)]
    assert any(row.startswith("encoder.layers.0") for row in rows), result.stdout
    assert any(row.startswith("DemoTransformer") and f" {BATCHES} " in row for row in rows), result.stdout
    # the modules the model calls: in inference torch runs each TransformerEncoderLayer fused, its sub-modules
    # uncalled (tracing leaves that fast path on: the model runs as it does untraced)
    assert sorted(row.split()[0] for row in rows) == sorted(
        ["DemoTransformer", "embedding", "encoder", "head", *(f"encoder.layers.{i}" for i in range(4))]
    )
    assert "traces:" in result.stdout


def test_demo_ends_with_the_report_beside_the_trace_file(demo: tuple[subprocess.CompletedProcess, Path]) -> None:
    result, trace_file = demo
    report = trace_file.parent / "report.html"
    assert result.stdout.splitlines()[-1] == f"report: {report} (open it in a browser)"
    assert "DemoTransformer" in report.read_text(encoding="utf-8")


def test_demo_writes_otlp_json_lines_to_the_trace_file(demo: tuple[subprocess.CompletedProcess, Path]) -> None:
    result, trace_file = demo
    assert result.returncode == 0, result.stderr[-4000:]
    assert trace_file.is_file()
    spans = []
    for line in trace_file.read_text().splitlines():
        request = json.loads(line)
        assert request["resourceSpans"]
        for resource_spans in request["resourceSpans"]:
            for scope_spans in resource_spans["scopeSpans"]:
                spans.extend(scope_spans["spans"])
    assert len(spans) == BATCHES * (CALLS_PER_FORWARD + 1)  # the model's spans under one request span per batch
    assert {span["name"] for span in spans} >= {"DemoTransformer", "encoder.layers.0", "head"}
    requests = {span["spanId"]: span for span in spans if span["name"] == "demo.inference"}
    models = [span for span in spans if span["name"] == "DemoTransformer"]
    assert len(requests) == len(models) == BATCHES
    assert {span["parentSpanId"] for span in models} == set(requests)
    assert all("parentSpanId" not in span for span in requests.values())
    check_traces(_otlp_spans(trace_file))
    assert str(trace_file) in result.stdout
    assert f"{BATCHES * CALLS_PER_FORWARD} model spans under {BATCHES} demo.inference spans" in result.stdout


def _otlp_spans(path: Path) -> list:
    """The protobuf spans of an OTLP JSON lines file, parsed as the OTLP/JSON spec says (hex ids)."""
    spans = []
    for line in path.read_text().splitlines():
        request = json.loads(line)
        for resource_spans in request["resourceSpans"]:
            for scope_spans in resource_spans["scopeSpans"]:
                for span in scope_spans["spans"]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if span.get(key):  # protobuf's JSON mapping reads bytes as base64
                            span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
        spans.extend(
            span
            for resource_spans in json_format.ParseDict(request, ExportTraceServiceRequest()).resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        )
    return spans


def test_no_subcommand_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_demo_options_are_parsed() -> None:
    args = build_parser().parse_args(
        ["demo", "--batches", "7", "--otlp-endpoint", "http://localhost:4318", "--protocol", "grpc", "--no-stats"]
    )
    assert (args.command, args.batches, args.otlp_endpoint, args.protocol, args.no_stats) == (
        "demo",
        7,
        "http://localhost:4318",
        "grpc",
        True,
    )
    assert build_parser().parse_args(["demo"]).batches == 50


@pytest.mark.parametrize("argv", [["demo", "--batches", "0"], ["demo", "--protocol", "http/json"], ["nope"]])
def test_invalid_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
