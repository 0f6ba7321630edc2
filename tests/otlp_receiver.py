"""Real OTLP receivers for tests: gRPC (TraceService/Export) and HTTP (POST /v1/traces, protobuf, gzip/deflate).

Both listen on 127.0.0.1 on an OS-chosen port and keep every ExportTraceServiceRequest they receive.

    with OtlpGrpcReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
        ...
        spans = receiver.wait_for_spans(3, timeout=5)

Fixtures ``otlp_grpc_receiver`` and ``otlp_http_receiver`` yield started receivers (import them into conftest).
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attributes_dict(key_values: Any) -> dict[str, Any]:
    """Repeated KeyValue -> {key: python value} (arrays as lists)."""
    return {kv.key: _value(kv.value) for kv in key_values}


class _Collector:
    """Received requests and headers, shared by both receivers."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self._cond = threading.Condition()

    def _add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        with self._cond:
            self.requests.append(request)
            self.headers.append(headers)
            self._cond.notify_all()

    def spans(self) -> list[Span]:
        with self._cond:
            return [s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def resource_attributes(self) -> dict[str, Any]:
        """Attributes of the first received resource."""
        with self._cond:
            for r in self.requests:
                for rs in r.resource_spans:
                    return attributes_dict(rs.resource.attributes)
        return {}

    def wait_for_spans(self, n: int, timeout: float = 5.0) -> list[Span]:
        """Block until at least ``n`` spans arrived; AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                count = sum(len(ss.spans) for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans)
                if count >= n:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"received {count} spans, expected {n} within {timeout}s")
                self._cond.wait(left)
        return self.spans()

    def clear(self) -> None:
        with self._cond:
            self.requests.clear()
            self.headers.clear()

    def __enter__(self) -> Any:
        self.start()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()  # type: ignore[attr-defined]


class OtlpGrpcReceiver(_Collector, trace_service_pb2_grpc.TraceServiceServicer):
    """opentelemetry.proto TraceService on a grpc.server; ``endpoint`` is "http://127.0.0.1:PORT"."""

    def __init__(self) -> None:
        super().__init__()
        self._server: grpc.Server | None = None
        self.port = 0

    def Export(self, request: ExportTraceServiceRequest, context: grpc.ServicerContext) -> ExportTraceServiceResponse:  # noqa: N802
        self._add(request, {k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        return ExportTraceServiceResponse()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpGrpcReceiver:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


class OtlpHttpReceiver(_Collector):
    """POST /v1/traces with an application/x-protobuf body; ``endpoint`` is the base "http://127.0.0.1:PORT"
    (for OTEL_EXPORTER_OTLP_ENDPOINT) and ``traces_endpoint`` the full URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""

    def __init__(self) -> None:
        super().__init__()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.content_encodings: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_endpoint(self) -> str:
        return f"{self.endpoint}/v1/traces"

    def start(self) -> OtlpHttpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "").lower()
                if self.path != "/v1/traces" or self.headers.get_content_type() != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                try:
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    request = ExportTraceServiceRequest.FromString(body)
                except Exception as e:
                    self.send_error(400, str(e))
                    return
                receiver.content_encodings.append(encoding)
                receiver._add(request, {k.lower(): v for k, v in self.headers.items()})
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="otlp-http-receiver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


@pytest.fixture
def otlp_grpc_receiver() -> Iterator[OtlpGrpcReceiver]:
    with OtlpGrpcReceiver() as receiver:
        yield receiver


@pytest.fixture
def otlp_http_receiver() -> Iterator[OtlpHttpReceiver]:
    with OtlpHttpReceiver() as receiver:
        yield receiver
