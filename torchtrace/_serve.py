"""The Prometheus scrape endpoint: ``serve_metrics()`` and its environment form, ``metrics_from_env()``.

prometheus_client's own WSGI server does the work: it answers ``Accept: application/openmetrics-text`` (what
Prometheus sends first) with OpenMetrics, the only exposition that carries exemplars, and plain text otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

__all__ = ["ENV_METRICS_ADDR", "ENV_METRICS_PORT", "MetricsServer", "metrics_from_env", "serve_metrics"]

ENV_METRICS_PORT = "TORCHTRACE_METRICS_PORT"
ENV_METRICS_ADDR = "TORCHTRACE_METRICS_ADDR"
DEFAULT_METRICS_ADDR = "127.0.0.1"  # loopback: tensor statistics are not for the whole network unless asked

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
    server, thread = start_http_server(port, addr=addr, registry=registry)
    thread.name = "torchtrace-metrics"
    served = MetricsServer(server, thread, addr, server.server_address[1])
    _endpoints.add(served)
    _warn_once_if_unpaired()
    return served


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
