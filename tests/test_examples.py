"""examples/fastapi_server.py run as users run it: uvicorn in its own process, spans checked at a real OTLP receiver."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from extras import require_modules
from otlp_receiver import OtlpHttpReceiver, attributes_dict

ROOT = Path(__file__).resolve().parent.parent
SERVER_SPAN = "POST /classify"
SAMPLED_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
UNSAMPLED_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "b7ad6b7169203331"
UNHEADED_REQUESTS = 24


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict, traceparent: str | None = None) -> dict:
    headers = {"content-type": "application/json"}
    if traceparent:
        headers["traceparent"] = traceparent
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def _wait_until_up(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"server exited with {server.returncode}: {server.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
            time.sleep(0.2)  # not up yet (or, on a port no one listens on, connected to itself: a BadStatusLine)
    raise AssertionError(f"server not up at {url} within {timeout}s")


def _status_code(span) -> int:
    attributes = attributes_dict(span.attributes)  # the stable semantic conventions' name, else the older one
    return attributes.get("http.response.status_code", attributes.get("http.status_code"))


def test_fastapi_server_module_spans_sit_under_their_request_span() -> None:
    require_modules("fastapi", "uvicorn", "opentelemetry.instrumentation.fastapi")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHTRACE_"))}
    with OtlpHttpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        server = subprocess.Popen(
            [sys.executable, "examples/fastapi_server.py", "--port", str(port), "--sample-ratio", "0.5"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait_until_up(base + "/healthz", server)
            lengths = [[3, 9], [1], [17, 4, 30], [8]]  # a new padded length per request
            sampled = f"00-{SAMPLED_TRACE_ID}-{CALLER_SPAN_ID}-01"
            for batch in lengths:
                reply = _post(base + "/classify", {"input_ids": [list(range(n)) for n in batch]}, sampled)
                assert len(reply["labels"]) == len(batch) and len(reply["probabilities"][0]) == 3
            unsampled = f"00-{UNSAMPLED_TRACE_ID}-{CALLER_SPAN_ID}-00"
            _post(base + "/classify", {"input_ids": [[1, 2, 3]]}, unsampled)
            for n in range(UNHEADED_REQUESTS):
                _post(base + "/classify", {"input_ids": [list(range(1 + n % 7))]})
            with pytest.raises(urllib.error.HTTPError) as bad:
                _post(base + "/classify", {"input_ids": [[]]})
            assert bad.value.code == 422
            server.send_signal(signal.SIGTERM)  # uvicorn's shutdown flushes both exporters
            _, stderr = server.communicate(timeout=60)
        finally:
            server.kill()
        # uvicorn shuts down gracefully, then ends the process with the signal it caught (its documented behaviour)
        assert server.returncode == -signal.SIGTERM, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        spans = receiver.spans()

    by_id = {span.span_id: span for span in spans}
    requests = [span for span in spans if span.name == SERVER_SPAN]
    modules = [span for span in spans if span.kind != span.SPAN_KIND_SERVER]
    assert all(span.kind == span.SPAN_KIND_SERVER for span in requests)
    assert len(requests) + len(modules) == len(spans)  # health checks are not traced
    assert {span.trace_id.hex() for span in spans} >= {SAMPLED_TRACE_ID}
    assert UNSAMPLED_TRACE_ID not in {span.trace_id.hex() for span in spans}  # the caller's "not sampled" holds

    headed = [span for span in requests if span.trace_id.hex() == SAMPLED_TRACE_ID]
    assert len(headed) == len(lengths)
    assert {span.parent_span_id.hex() for span in headed} == {CALLER_SPAN_ID}
    unheaded = [span for span in requests if span.trace_id.hex() != SAMPLED_TRACE_ID]
    assert all(not span.parent_span_id for span in unheaded)
    assert 0 < len(unheaded) < UNHEADED_REQUESTS  # the ratio sampled some requests, not all (p = 2 * 2**-24 to fail)
    assert len({span.trace_id for span in unheaded}) == len(unheaded)  # one trace per request

    answered = [span for span in requests if _status_code(span) == 200]
    roots_by_request: dict[bytes, list] = {span.span_id: [] for span in answered}
    for span in modules:
        root = span
        while by_id[root.parent_span_id].name != SERVER_SPAN:
            root = by_id[root.parent_span_id]  # KeyError: a module span whose chain misses its request span
            assert root.trace_id == span.trace_id
        request = by_id[root.parent_span_id]
        assert span.trace_id == request.trace_id
        assert request.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= request.end_time_unix_nano
        if root is span:
            roots_by_request[request.span_id].append(span)
    # Every sampled request ran the model once, traced whole: one model root span each, with the same tree.
    assert [len(roots) for roots in roots_by_request.values()] == [1] * len(answered)
    assert {root.name for roots in roots_by_request.values() for root in roots} == {"BertForSequenceClassification"}
    per_request = len(modules) / len(answered)
    assert per_request == int(per_request) and per_request > 10
