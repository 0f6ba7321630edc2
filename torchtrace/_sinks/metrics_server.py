"""The Prometheus scrape endpoint: ``serve_metrics()`` and its environment form, ``metrics_from_env()``.

prometheus_client's WSGI app does the work: it answers ``Accept: application/openmetrics-text`` (what Prometheus
sends first) with OpenMetrics, the only exposition that carries exemplars, and plain text otherwise. Its server
starts a thread per connection (500 idle connections, 500 threads); here connections wait for their request in
one selector and a pool of ``MAX_THREADS`` answers them (``_PooledWSGIServer``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from torchtrace._core.options import ENV_METRICS_PORT

__all__ = ["ENV_METRICS_ADDR", "ENV_METRICS_PORT", "MetricsServer", "metrics_from_env", "serve_metrics"]

ENV_METRICS_ADDR = "TORCHTRACE_METRICS_ADDR"
DEFAULT_METRICS_ADDR = "127.0.0.1"  # loopback: tensor statistics are not for the whole network unless asked
MAX_THREADS = 4  # connections answered at once (a scrape takes milliseconds; Prometheus scrapes one at a time)
IDLE_TIMEOUT_S = 10.0  # a connection that sends no request within this is closed
MAX_WAITING = 256  # connections waiting for their request at once; past this the longest waiting is closed

_logger = logging.getLogger(__name__)

# An endpoint beside a model traced without metrics serves no torchtrace series (metrics are opt-in), which looks
# broken: said once per process, by whichever of serve_metrics() and instrument() comes second.
_endpoints: weakref.WeakSet[MetricsServer] = weakref.WeakSet()
_unmetered: weakref.WeakSet[object] = weakref.WeakSet()  # live handles of models traced without metrics
_pairing_lock = threading.Lock()
_pairing_warned = False


@dataclass(frozen=True)
class MetricsServer:
    """A running metrics endpoint. ``shutdown()`` (or leaving the ``with`` block) stops it and frees the port."""

    server: WSGIServer
    thread: threading.Thread
    addr: str
    port: int  # the bound port (the OS's choice when 0 was asked for)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def serve_metrics(port: int, addr: str = DEFAULT_METRICS_ADDR, registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread; ``port=0`` picks a free port.

    Binds loopback unless ``addr`` says otherwise (``"0.0.0.0"`` in a container that Prometheus scrapes).
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer in 0..65535, got {port!r}")
    family, host = _address_family(addr, port)
    server_class = type("PooledWSGIServer", (_PooledWSGIServer,), {"address_family": family})
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="torchtrace-metrics", daemon=True)
    thread.start()
    served = MetricsServer(server, thread, addr, server.server_address[1])
    _endpoints.add(served)
    _warn_once_if_unpaired()
    return served


class _PooledWSGIServer(WSGIServer):
    """A WSGI server answering connections on a bounded pool of threads (daemons: they never hold up exit). A
    connection waits for its request in one selector, not on a thread: idle connections take no thread, cannot
    starve a scrape, and are closed after IDLE_TIMEOUT_S; past MAX_WAITING of them, the longest waiting is closed."""

    def server_activate(self) -> None:
        super().server_activate()
        self._pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="torchtrace-metrics-request")
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[Any, tuple[Any, float]] = {}  # connection -> (client address, deadline)
        self._waiting_lock = threading.Lock()
        self._closed = False
        self._wake, self._woken = socket.socketpair()  # a new connection wakes the selector: no polling delay
        self._woken.setblocking(False)
        self._selector.register(self._woken, selectors.EVENT_READ)
        threading.Thread(target=self._wait_for_requests, name="torchtrace-metrics-wait", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._waiting_lock:
            if self._closed:
                self.shutdown_request(request)
                return
            if len(self._waiting) >= MAX_WAITING:  # the longest waiting goes: a new scrape is always answered
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                self._selector.unregister(oldest)
                self.shutdown_request(oldest)
            self._waiting[request] = (client_address, time.monotonic() + IDLE_TIMEOUT_S)
            self._selector.register(request, selectors.EVENT_READ)
        with contextlib.suppress(OSError):  # its buffer full: the selector is awake already
            self._wake.send(b"\0")

    def _wait_for_requests(self) -> None:
        while not self._closed:
            try:
                ready = [key.fileobj for key, _ in self._selector.select(timeout=1.0)]
            except (OSError, ValueError):  # the selector closed under it: the server is closing
                return
            if self._woken in ready:
                ready.remove(self._woken)
                with contextlib.suppress(OSError):
                    self._woken.recv(4096)
            now = time.monotonic()
            with self._waiting_lock:
                expired = [connection for connection, (_, deadline) in self._waiting.items() if deadline < now]
                for connection in {*ready, *expired}:
                    client_address, _ = self._waiting.pop(connection, (None, 0.0))
                    self._selector.unregister(connection)
                    if connection in ready:
                        self._pool.submit(self._answer, connection, client_address)
                    else:
                        self.shutdown_request(connection)

    def _answer(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    _selector: selectors.BaseSelector | None = None  # none until activated (a port that cannot be bound: never)
    request_queue_size = 128  # the listen backlog (socketserver's 5 makes a burst of connections retry for seconds)

    def server_close(self) -> None:
        super().server_close()
        if self._selector is None:
            return
        with self._waiting_lock:
            self._closed = True
            for connection in self._waiting:
                self.shutdown_request(connection)
            self._waiting.clear()
        self._selector.close()
        self._wake.close()
        self._woken.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _QuietHandler(WSGIRequestHandler):
    """No request logged on stderr; a connection idle past IDLE_TIMEOUT_S is dropped."""

    timeout = IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _address_family(addr: str, port: int) -> tuple[int, str]:
    """(socket family, host) for binding ``addr``: IPv6 where it is an IPv6 address (as prometheus_client does)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, sockaddr[0]


def note_unmetered(handle: object) -> None:
    """``handle`` traces a model without metrics (and was not told ``metrics=False``) until ``forget_unmetered``."""
    _unmetered.add(handle)
    _warn_once_if_unpaired()


def forget_unmetered(handle: object) -> None:
    _unmetered.discard(handle)


def _warn_once_if_unpaired() -> None:
    global _pairing_warned
    with _pairing_lock:
        if _pairing_warned or not _unmetered or not any(e.thread.is_alive() for e in _endpoints):
            return
        _pairing_warned = True
    _logger.warning(
        "torchtrace: a metrics endpoint is served but a model is traced without metrics, so it shows no torchtrace "
        "series: metrics are opt-in; pass metrics=True (or a MetricsSink) to instrument(), or set TORCHTRACE_METRICS=1"
    )


def metrics_from_env(registry: CollectorRegistry = REGISTRY) -> MetricsServer | None:
    """``serve_metrics()`` as ``TORCHTRACE_METRICS_PORT`` / ``TORCHTRACE_METRICS_ADDR`` say; None when no port is
    set. Under torchrun each rank serves on the base port + ``LOCAL_RANK``. An invalid port raises ``ValueError``."""
    text = os.environ.get(ENV_METRICS_PORT, "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_METRICS_PORT}={text!r} is not a port number (0 to 65535)")
    addr = os.environ.get(ENV_METRICS_ADDR, "").strip() or DEFAULT_METRICS_ADDR
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    if port and local_rank.isdigit():
        port += int(local_rank)  # one endpoint per rank on a node: base port + local rank, no collision
    key = (addr, port, id(registry))
    with _env_servers_lock:
        server = _env_servers.get(key)
        if server is None or not server.thread.is_alive():  # once per process: instrument() asks for it too
            server = _env_servers[key] = serve_metrics(port, addr=addr, registry=registry)
    return server


_env_servers: dict[tuple[str, int, int], MetricsServer] = {}  # what metrics_from_env started, by address
_env_servers_lock = threading.Lock()
