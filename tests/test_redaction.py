"""Credentials in an endpoint URL never reach the terminal or the logs: ``torchtrace config``, the export failure
warnings (gRPC's messages name the target with its userinfo) and the demo's closing line."""

from __future__ import annotations

import base64
import logging
import socket

import otlp_receiver
import pytest
import torch
from torch import nn

import torchtrace
from torchtrace._otlp.exporters import redact
from torchtrace._run import effective_config

SECRET = "s3cret-pw"
otlp_http_receiver = otlp_receiver.otlp_http_receiver


def _refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connections to it are refused


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"http://user:{SECRET}@127.0.0.1:4318", "http://***@127.0.0.1:4318"),
        (f"https://{SECRET}@collector.example/v1/traces", "https://***@collector.example/v1/traces"),
        (f"grpc://u:{SECRET}@[::1]:4317", "grpc://***@[::1]:4317"),
        (
            f"Failed to export traces to user:{SECRET}@127.0.0.1:9, error",
            "Failed to export traces to ***@127.0.0.1:9, error",
        ),
        ("http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/traces"),
        ("ratio 1:2 @ step 3", "ratio 1:2 @ step 3"),
    ],
)
def test_redact_hides_userinfo_and_nothing_else(text, shown):
    assert redact(text) == shown


def test_config_shows_the_endpoint_without_its_password(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{SECRET}@127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://user:{SECRET}@127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer {SECRET}")
    rows = {row["name"]: row["value"] for row in effective_config()}
    assert rows["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://***@127.0.0.1:4318"
    assert rows["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://***@127.0.0.1:4318/v1/traces"
    assert rows["OTEL_EXPORTER_OTLP_HEADERS"] == "(set, hidden)"
    assert SECRET not in repr(rows)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_export_failure_warnings_do_not_show_the_password(monkeypatch, caplog, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{SECRET}@127.0.0.1:{_refused_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    model = nn.Sequential(nn.Linear(2, 2))
    with caplog.at_level(logging.DEBUG), torchtrace.instrument(model, exporter="otlp") as handle:
        model(torch.ones(1, 2))
        handle.flush()
    assert handle.failed_spans == 2
    failures = [record.getMessage() for record in caplog.records if "OTLP export failed" in record.getMessage()]
    assert len(failures) == 1
    assert all(SECRET not in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "endpoint",
    [f"htp://alice:{SECRET}@collector:4318", f"http://alice:{SECRET}@collector:99999", f"http://alice:{SECRET}@:4318"],
    ids=["bad-scheme", "bad-port", "no-host"],
)
def test_a_refused_endpoint_is_named_without_its_password(monkeypatch, endpoint):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    with pytest.raises(ValueError, match="not an endpoint torchtrace can use") as raised:
        torchtrace.instrument(nn.Linear(2, 2), exporter="otlp")
    assert SECRET not in str(raised.value) and "***@" in str(raised.value)


def test_userinfo_in_an_http_endpoint_is_sent_as_basic_auth(monkeypatch, otlp_http_receiver):
    """As the SDK's own OTLP/HTTP exporter does (requests turns the URL's userinfo into Basic auth): a collector
    that requires it accepts the spans."""
    endpoint = otlp_http_receiver.endpoint.replace("http://", f"http://alice:{SECRET}@")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    model = nn.Sequential(nn.Linear(2, 2))
    with torchtrace.instrument(model, exporter="otlp") as handle:
        model(torch.ones(1, 2))
        handle.flush()
    otlp_http_receiver.wait_for_spans(2)
    expected = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
    assert {headers.get("authorization") for headers in otlp_http_receiver.headers} == {expected}
