"""Misbehaving OTLP endpoints on 127.0.0.1, for fault tests (real sockets, OS-chosen ports).

- ``FaultyHttpReceiver``: an ``OtlpHttpReceiver`` whose ``mode`` can be switched at any time:
  ``"ok"`` (accept), ``"stall"`` (hold each request ``stall_s`` seconds, then accept), ``"error"`` (reply
  ``error_status``), ``"close"`` (close the connection without a reply).
- ``FaultyGrpcReceiver``: an ``OtlpGrpcReceiver`` with modes ``"ok"``, ``"stall"``, ``"error"`` (abort with
  ``error_code``), ``"headers"`` (send the response headers, then stall ``stall_s`` seconds).
- ``DrippingHttpServer``: reads each request, answers 200 with a long body, one byte every ``drip_s`` seconds:
  every socket read succeeds in time, the response never completes.
- ``Blackhole``: a TCP listener that never accepts: connects succeed (the kernel's backlog), nothing is ever read
  or answered. A collector hung mid-request.
- ``free_port()``: a port with nothing listening on it (connections are refused) until something binds it.
"""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver

MODES = ("ok", "stall", "error", "close")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now (refused until a receiver binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class FaultyHttpReceiver(OtlpHttpReceiver):
    def __init__(
        self, mode: str = "ok", *, port: int = 0, stall_s: float = 5.0, error_status: int = 503, max_spans: int = 0
    ) -> None:
        super().__init__()
        self.mode = mode
        self.stall_s = stall_s
        self.error_status = error_status
        self.max_spans = max_spans  # mode "slow": a request of more spans does not complete (stalls)
        self.request_sizes: list[int] = []  # mode "slow": spans of each request seen
        self.attempts = 0  # requests seen, whatever the mode
        self._wanted_port = port
        self._release = threading.Event()  # set at stop(): stalled handlers return at once

    def start(self) -> FaultyHttpReceiver:
        super().start() if not self._wanted_port else self._start_on(self._wanted_port)
        handler = self._server.RequestHandlerClass  # type: ignore[union-attr]
        receiver = self
        accept = handler.do_POST

        def do_post(request_handler: Any) -> None:
            receiver.attempts += 1
            mode = receiver.mode
            if mode == "stall":
                receiver._release.wait(receiver.stall_s)
            elif mode == "slow":  # a collector that takes at most max_spans within the client's timeout
                body = request_handler.rfile.read(int(request_handler.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                spans = sum(len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans)
                receiver.request_sizes.append(spans)
                if spans > receiver.max_spans:
                    receiver._release.wait(receiver.stall_s)
                    return
                request_handler.rfile = io.BytesIO(body)  # read again by the receiver's own handler
            elif mode == "error":
                request_handler.rfile.read(int(request_handler.headers.get("Content-Length", 0)))
                request_handler.send_response(receiver.error_status)
                request_handler.send_header("Content-Length", "0")
                request_handler.end_headers()
                return
            elif mode == "close":
                request_handler.close_connection = True  # no reply: the connection just closes
                return
            # a stalled request's client may have given up (timed out) before the reply: what the test wants
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                accept(request_handler)

        handler.do_POST = do_post
        return self

    def _start_on(self, port: int) -> None:
        # OtlpHttpReceiver binds port 0; bind the wanted one by patching the address it uses
        import http.server

        original = http.server.ThreadingHTTPServer.__init__

        def init(server: Any, address: Any, *args: Any, **kwargs: Any) -> None:
            original(server, ("127.0.0.1", port), *args, **kwargs)

        http.server.ThreadingHTTPServer.__init__ = init  # type: ignore[method-assign]
        try:
            super().start()
        finally:
            http.server.ThreadingHTTPServer.__init__ = original  # type: ignore[method-assign]

    def stop(self) -> None:
        self._release.set()
        super().stop()


class FaultyGrpcReceiver(OtlpGrpcReceiver):
    def __init__(
        self, mode: str = "ok", *, port: int = 0, stall_s: float = 5.0, error_code: grpc.StatusCode | None = None
    ) -> None:
        super().__init__()
        self.mode = mode
        self.stall_s = stall_s
        self.error_code = error_code or grpc.StatusCode.UNAVAILABLE
        self.attempts = 0
        self._wanted_port = port
        self._release = threading.Event()

    def Export(self, request: ExportTraceServiceRequest, context: grpc.ServicerContext) -> ExportTraceServiceResponse:  # noqa: N802
        self.attempts += 1
        if self.mode == "headers":
            context.send_initial_metadata(())
        if self.mode in ("stall", "headers"):
            self._release.wait(self.stall_s)
        elif self.mode == "error":
            context.abort(self.error_code, "injected failure")
        return super().Export(request, context)

    def start(self) -> FaultyGrpcReceiver:
        if not self._wanted_port:
            super().start()
            return self
        from concurrent.futures import ThreadPoolExecutor

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self._wanted_port}")
        self._server.start()
        return self

    def stop(self) -> None:
        self._release.set()
        super().stop()


class DrippingHttpServer:
    """``endpoint`` is "http://127.0.0.1:PORT". Each connection: the request is read, then "200 OK" headers with a
    Content-Length of ``body_bytes``, then one body byte every ``drip_s`` seconds until the client goes or stop()."""

    def __init__(self, drip_s: float = 0.5, body_bytes: int = 10_000) -> None:
        self.drip_s = drip_s
        self.body_bytes = body_bytes
        self.requests = 0
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(16)
        self.port = self._socket.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(connection,), daemon=True).start()

    def _drip(self, connection: socket.socket) -> None:
        with connection:
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = connection.recv(65536)
                if not chunk:
                    return
                received += chunk
            head, _, body = received.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            while len(body) < length:
                body += connection.recv(65536)
            self.requests += 1
            headers = (
                f"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: {self.body_bytes}\r\n\r\n"
            )
            with contextlib.suppress(OSError):
                connection.sendall(headers.encode())
                for _ in range(self.body_bytes):
                    if self._stop.wait(self.drip_s):
                        return
                    connection.sendall(b"\0")

    def stop(self) -> None:
        self._stop.set()
        self._socket.close()


class Blackhole:
    """Listens, never accepts. ``endpoint`` is "http://127.0.0.1:PORT"."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        self.port = self._socket.getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc: object) -> None:
        self._socket.close()


def wait_until(condition: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Polls ``condition()`` until true or ``timeout`` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(interval)
