"""Where encoded spans go: OTLP over gRPC or HTTP, or an OTLP/JSON lines file.

The network senders are opentelemetry-exporter-otlp's own span exporters with the encoding step swapped for
torchtrace's pre-encoded bytes (``protobuf``), so endpoint, headers, timeout, compression, TLS
certificates, retries with backoff and gRPC reconnects all follow the standard ``OTEL_EXPORTER_OTLP_*``
variables exactly as they do for any OpenTelemetry Python application.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import grpc
from google.protobuf import json_format
from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as _GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http._common import _is_request_too_large
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as _HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_COMPRESSION,
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_HEADERS,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TIMEOUT,
    OTEL_EXPORTER_OTLP_TRACES_COMPRESSION,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_HEADERS,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_TIMEOUT,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from torchtrace._core.calls import Calls, ModuleCall, error_text
from torchtrace._otlp.file_writer import TraceFile
from torchtrace._otlp.json_lines import encode_otlp_json
from torchtrace._otlp.protobuf import encode_export_request
from torchtrace._otlp.request_threads import REQUEST_THREADS

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "EncodedSpans",
    "GrpcSender",
    "HttpSender",
    "JsonFileSender",
    "OtlpSink",
    "SdkJsonFileExporter",
    "SpanSender",
    "create_otlp_sender",
    "check_endpoint",
    "create_sdk_span_exporter",
    "default_resource",
    "export_timeout_s",
    "file_sender",
    "otlp_endpoint_configured",
    "resolve_protocol",
]

_logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "torchtrace"
PROTOCOLS = ("grpc", "http/protobuf")
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
DEFAULT_TIMEOUT_S = 10.0  # the OTel spec's default for OTEL_EXPORTER_OTLP_TIMEOUT
MAX_TIMEOUT_S = 3600.0  # longer is a typo (milliseconds?), and would hold remove() and exit as long
MIN_REQUEST_SPANS = 16  # the fewest spans per request a slow endpoint brings the batches down to
GROW_AFTER = 64  # requests delivered in a row before a smaller request size is doubled again
DEFAULT_RETRY_INTERVAL_S = 1.0  # while export fails: the pause after a failed request before the next one


# --- the SDK exporters' own log lines, during torchtrace's sends ----------------------------------------------

# The OTLP exporters log every failed (and every retried) batch. torchtrace's sink logs once per failure burst
# instead: records these loggers emit *while a torchtrace send runs on this thread* are kept (the last one is the
# reason in torchtrace's warning) and not printed. Everything else they log (the app's own exporters) is untouched.
_SDK_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.common.http",
)
_send_state = threading.local()


class _QuietDuringSend(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(_send_state, "active", False):
            if record.levelno >= logging.ERROR or getattr(_send_state, "last", None) is None:
                _send_state.last = record.getMessage()
            return False
        return True


_QUIET_FILTER = _QuietDuringSend()
for _name in _SDK_EXPORTER_LOGGERS:
    _sdk_logger = logging.getLogger(_name)
    if not any(isinstance(f, _QuietDuringSend) for f in _sdk_logger.filters):
        _sdk_logger.addFilter(_QUIET_FILTER)


@dataclass(frozen=True, slots=True)
class EncodedSpans:
    """One serialized ExportTraceServiceRequest and how many spans it holds: protobuf bytes, or OTLP/JSON text for
    a sender whose ``encode_request`` makes JSON."""

    payload: bytes | str
    span_count: int


class SpanSender(Protocol):
    def send(self, spans: EncodedSpans) -> bool: ...

    def shutdown(self) -> None: ...


# --- secrets ----------------------------------------------------------------------------------------------------

# Credentials in an endpoint's userinfo: "scheme://user:pw@host" and "scheme://token@host", and "user:pw@host"
# without a scheme, as gRPC's own messages write the target.
_USERINFO = re.compile(r"(?<=://)[^\s/@]+@|(?<![\w.:/-])[^\s/@:'\"(\[]+:[^\s/@'\"]*@(?=[\w\[])")


def redact(text: str) -> str:
    """``text`` (an endpoint, or a message naming one) with any userinfo shown as ``***@``."""
    return _USERINFO.sub("***@", text)


# --- configuration --------------------------------------------------------------------------------------------


def resolve_protocol() -> str:
    """OTLP protocol from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then OTEL_EXPORTER_OTLP_PROTOCOL.

    The OTel spec's default is ``http/protobuf``. ``http/json`` is not supported (use ``JsonFileSender`` for
    JSON); any other value raises ValueError.
    """
    for var in (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL):
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value not in PROTOCOLS:
                raise ValueError(
                    f"{var}={os.environ[var]!r} is not supported by torchtrace; use one of {', '.join(PROTOCOLS)}"
                )
            return value
    return "http/protobuf"


def otlp_endpoint_configured() -> bool:
    """True when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (non-empty)."""
    return bool(os.environ.get(OTEL_EXPORTER_OTLP_ENDPOINT) or os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT))


def default_resource() -> Resource:
    """``Resource.create()`` (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, SDK attributes), with service.name
    "torchtrace" instead of the SDK's "unknown_service" placeholder when neither variable names a service."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "unknown_service")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}, resource.schema_url))
    return resource


def process_resource() -> Resource:
    """This process's resource: ``default_resource()`` plus, in a distributed job, the rank attributes and the
    rank's stable ``service.instance.id`` (also right in a forked child)."""
    from torchtrace._core.ranks import rank_info

    resource = default_resource()
    rank = rank_info()
    return resource if rank is None else resource.merge(Resource(rank.resource_attributes()))


def export_timeout_s() -> float:
    """Seconds one OTLP request may take, retries included: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, then
    OTEL_EXPORTER_OTLP_TIMEOUT (seconds, as opentelemetry-exporter-otlp reads them), else 10."""
    for var in (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, OTEL_EXPORTER_OTLP_TIMEOUT):
        value = os.environ.get(var, "").strip()
        if value:
            try:
                timeout = float(value)
            except ValueError:
                raise ValueError(f"{var}={value!r}: expected a number of seconds") from None
            if not 0 < timeout <= MAX_TIMEOUT_S:  # NaN and infinity too: deadlines are computed from it
                raise ValueError(f"{var}={value!r}: expected a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}")
            return timeout
    return DEFAULT_TIMEOUT_S


_URL_SCHEMES = ("http", "https")


def _port_ok(url: Any, required: bool) -> bool:
    try:
        port = url.port
    except ValueError:  # not a number, or out of range
        return False
    return port is not None if required else True


def _usable_endpoint(value: str, protocol: str) -> bool:
    if any(character.isspace() for character in value):  # "my host:4318": urlparse takes it, no resolver does
        return False
    if protocol == "grpc" and "://" not in value:  # gRPC targets: host:port, unix:path
        if value.startswith("unix:"):
            return True
        target = urlparse(f"//{value}")
        return bool(target.hostname) and _port_ok(target, required=True)
    url = urlparse(value)
    return url.scheme in _URL_SCHEMES and bool(url.hostname) and _port_ok(url, required=False)


# OTEL_EXPORTER_OTLP_HEADERS items as the SDK's exporters parse them (``opentelemetry.util.re``, liberal): a key of
# token characters, "=", a value (URL-encoded, or plain as other SDKs accept). An item that is neither, the SDK logs
# with its text: a token there would reach the logs.
_HEADER_ITEM = re.compile(r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*=[ \t]*"
                          r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*[ \t]*")  # fmt: skip
_COMPRESSIONS = ("gzip", "deflate", "none")  # what the SDK's exporters know


def check_otlp_settings(protocol: str) -> None:
    """ValueError naming the variable for OTLP settings the exporter would fail on or log: the endpoint
    (``check_endpoint``), a compression it does not know, headers that are not ``key=value`` pairs (their values
    never shown: they carry tokens)."""
    check_endpoint(protocol)
    for var in (OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, OTEL_EXPORTER_OTLP_COMPRESSION):
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value not in _COMPRESSIONS:
                raise ValueError(f"{var}={value!r}: expected one of {', '.join(_COMPRESSIONS)}")
            break
    for var in (OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_EXPORTER_OTLP_HEADERS):
        items = re.split(r"[ \t]*,[ \t]*", os.environ.get(var, ""))
        for position, item in enumerate(items, 1):
            if item and not _HEADER_ITEM.fullmatch(item):
                raise ValueError(
                    f"{var}: item {position} of {len(items)} is not a header (expected key=value pairs separated "
                    "by commas, values URL-encoded; the value is not shown)"
                )


def check_endpoint(protocol: str) -> None:
    """ValueError naming the variable when the endpoint the exporter will use is not one it can reach: a URL with
    an http(s) scheme and a host, or for gRPC also ``host:port`` (and ``unix:`` targets)."""
    for var in (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT):
        value = os.environ.get(var, "").strip()
        if not value:
            continue
        if not _usable_endpoint(value, protocol):
            expected = "http(s)://host[:port][/path]" + (" or host:port" if protocol == "grpc" else "")
            raise ValueError(f"{var}={redact(value)!r} is not an endpoint torchtrace can use; expected {expected}")
        return


def create_otlp_sender(protocol: str | None = None) -> GrpcSender | HttpSender:
    """A sender for ``protocol`` (default: ``resolve_protocol()``), configured from the environment."""
    protocol = protocol or resolve_protocol()
    check_otlp_settings(protocol)
    timeout = export_timeout_s()
    if protocol == "grpc":
        return GrpcSender(timeout=timeout)
    if protocol == "http/protobuf":
        return HttpSender(timeout=timeout)
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")


def grpc_compression_none() -> grpc.Compression | None:
    """NoCompression where OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION=none (the spec allows it; the SDK's gRPC
    exporter rejects it), else None: the SDK reads the variable itself."""
    for var in (OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, OTEL_EXPORTER_OTLP_COMPRESSION):
        value = os.environ.get(var, "").strip().lower()
        if value:
            return grpc.Compression.NoCompression if value == "none" else None
    return None


def create_sdk_span_exporter(trace_file: str | os.PathLike[str] | None = None) -> SpanExporter:
    """An SDK ``SpanExporter`` for the app's own spans that goes where torchtrace's would: the SDK's OTLP exporter
    for the configured protocol when an endpoint is set, else OTLP JSON lines in ``trace_file``
    (``TORCHTRACE_TRACE_FILE`` or the default)."""
    if otlp_endpoint_configured():
        timeout = export_timeout_s()
        protocol = resolve_protocol()
        check_otlp_settings(protocol)
        if protocol == "grpc":
            return _GrpcSpanExporter(timeout=timeout, compression=grpc_compression_none())
        return _HttpSpanExporter(timeout=timeout)
    from torchtrace._core.options import TraceFile

    return SdkJsonFileExporter(file_sender(TraceFile(path=trace_file).resolved()))


_MIB = 1024 * 1024


def file_sender(trace_file: Any) -> JsonFileSender:
    """The ``file`` exporter's sender for a resolved ``TraceFile``: rotation as configured, the trace directory made
    now (a ValueError naming the option where it cannot be), symlinks refused at the default path."""
    from torchtrace._core.options import DEFAULT_TRACE_FILE, ENV_TRACE_FILE

    path = trace_file.path
    sender = JsonFileSender(
        path,
        max_bytes=int(trace_file.max_mb * _MIB),
        backups=trace_file.backups,
        follow_symlinks=os.path.abspath(path) != os.path.abspath(DEFAULT_TRACE_FILE),  # however it is written
    )
    try:
        sender.file.make_directory()
    except OSError as error:
        reason = f"{error.strerror}: {error.filename}" if error.strerror else str(error)
        raise ValueError(f"trace_file ({ENV_TRACE_FILE})={path!r}: cannot write traces there ({reason})") from None
    return sender


# --- senders --------------------------------------------------------------------------------------------------


def _identity(payload: bytes) -> bytes:
    return payload


class _PreEncodedTraceServiceStub:
    """TraceServiceStub whose Export takes the already-serialized request bytes."""

    def __init__(self, channel: Any) -> None:
        self.Export = channel.unary_unary(
            _EXPORT_METHOD,
            request_serializer=_identity,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )


class GrpcSender(_GrpcSpanExporter):
    """OTLP/gRPC: the SDK's gRPC span exporter (retries, reconnects, headers, gzip, TLS, env) sending bytes."""

    def __init__(self, *args: Any, compression: grpc.Compression | None = None, **kwargs: Any) -> None:
        super().__init__(*args, compression=compression or grpc_compression_none(), **kwargs)
        self.timeout_s = kwargs.get("timeout")  # a request that took this long ran out of time (OtlpSink)

    def _initialize_channel_and_stub(self) -> None:
        super()._initialize_channel_and_stub()  # also called on reconnect: replace the stub every time
        self._client = _PreEncodedTraceServiceStub(self._channel)

    def _translate_data(self, data: EncodedSpans) -> bytes:  # type: ignore[override]
        return data.payload

    def _count_data(self, data: EncodedSpans) -> int:  # type: ignore[override]
        return data.span_count

    def send(self, spans: EncodedSpans) -> bool:
        return self._export(spans) is SpanExportResult.SUCCESS


@dataclass(frozen=True, slots=True)
class _NoResponse(BaseHTTPResult):
    """A request that got no complete response within its deadline."""

    def content(self) -> bytes:
        return b""

    def headers(self) -> dict[str, str]:
        return {}


class _DeadlineTransport(BaseHTTPTransport):
    """The SDK's HTTP transport with a total deadline per request.

    Its ``timeout`` bounds each socket read, not the request: a peer that sends headers and then one byte every
    half second holds a request (and ``remove()``, and exit) for as long as it likes. Here each request runs on a
    kept daemon thread (``request_threads``) that the caller waits for at most ``timeout`` seconds; a request still
    running then is abandoned (it ends when the peer gives up, and never holds exit). At most ``MAX_ABANDONED`` of
    a transport's may be running at once; past that, its requests fail at once until one ends.
    """

    MAX_ABANDONED = 4

    def __init__(self, inner: BaseHTTPTransport) -> None:
        self._inner = inner
        self._abandoned: list[threading.Lock] = []  # each held while its request runs

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        data: bytes | None = None,
    ) -> BaseHTTPResult:
        self._abandoned = [running for running in self._abandoned if running.locked()]
        if timeout is not None and timeout <= 0:
            return _NoResponse(error=TimeoutError("no time left before the export deadline"))
        if len(self._abandoned) >= self.MAX_ABANDONED:
            return _NoResponse(error=TimeoutError(f"{len(self._abandoned)} earlier requests still have no response"))
        outcome: list[BaseHTTPResult] = []
        running = threading.Lock()  # held while the request runs
        running.acquire()

        def send() -> None:
            try:
                outcome.append(self._inner.request(method, url, headers=headers, timeout=timeout, data=data))
            except Exception as error:  # the SDK's transports return their errors; anything else is one too
                outcome.append(_NoResponse(error=error))
            finally:
                running.release()

        REQUEST_THREADS.run(send)
        if running.acquire(timeout=-1 if timeout is None else timeout):
            return outcome[0]
        self._abandoned.append(running)
        return _NoResponse(error=TimeoutError(f"no complete response within {timeout:.3g}s"))

    def is_connection_error(self, exception: Exception | None) -> bool:
        return self._inner.is_connection_error(exception)

    def close(self) -> None:
        self._inner.close()
        REQUEST_THREADS.end_idle()


def _plain_http_transport(endpoint: str) -> BaseHTTPTransport | None:
    """The SDK's urllib3 transport for a plain ``http://`` endpoint without userinfo that no proxy setting and no
    .netrc entry applies to (an in-cluster collector, usually): what requests would send there, for half its Python
    per request (~450 -> ~215 us to a local receiver). None elsewhere: requests (the SDK's default) keeps honouring
    proxies, .netrc, its CA bundle and REQUESTS_CA_BUNDLE."""
    try:
        import requests.utils
        from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
    except ImportError:
        return None
    url = urlparse(endpoint)
    if url.scheme != "http" or url.username is not None or url.password is not None:
        return None  # userinfo: requests sends it as Basic auth, as the SDK's exporter does
    try:
        if requests.utils.get_environ_proxies(endpoint) or requests.utils.get_netrc_auth(endpoint):
            return None
        return Urllib3HTTPTransport()
    except Exception:  # an unreadable .netrc, a proxy setting requests cannot parse: requests decides
        return None


class HttpSender(_HttpSpanExporter):
    """OTLP/HTTP protobuf: the SDK's HTTP span exporter and its client (retries, headers, compression, TLS), each
    request bounded by the timeout in total (``_DeadlineTransport``); to a plain ``http://`` endpoint with no proxy,
    through urllib3 (``_plain_http_transport``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = kwargs.get("timeout")  # a request that took this long ran out of time (OtlpSink)
        inner = _plain_http_transport(self._endpoint) or self._client._transport
        self._client._transport = _DeadlineTransport(inner)

    def send(self, spans: EncodedSpans) -> bool:
        if self._shutdown:
            return False
        with self._metrics.export_operation(spans.span_count) as result:
            if _is_request_too_large(spans.payload, self._max_request_size):
                _logger.warning(
                    "Dropping span batch: %d bytes exceeds max_request_size %d",
                    len(spans.payload),
                    self._max_request_size,
                )
                return False
            outcome = self._client.export(spans.payload)
            if not outcome.success:
                result.error = outcome.error
                return False
        return True


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _ids_to_hex(node: Any) -> None:
    """OTLP/JSON writes trace and span ids as hex, where the protobuf JSON mapping has base64."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_FIELDS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _ids_to_hex(value)
    elif isinstance(node, list):
        for item in node:
            _ids_to_hex(item)


def request_to_otlp_json(payload: bytes) -> str:
    """One ExportTraceServiceRequest in the OTLP/JSON encoding (lowerCamelCase keys, hex ids, enums as ints)."""
    request = ExportTraceServiceRequest.FromString(payload)
    as_dict = json_format.MessageToDict(request, use_integers_for_enums=True)
    _ids_to_hex(as_dict)
    return json.dumps(as_dict, separators=(",", ":"))


class JsonFileSender:
    """Appends one OTLP/JSON line per request to ``path`` (the OTLP file exporter format). Thread-safe.

    The file is a ``TraceFile``: whole lines only (a failed write is cut back), rotated past ``max_bytes`` into
    ``path.1`` (newest) ... ``path.<backups>``, followed when moved or deleted (logrotate), created 0600 in a 0700
    directory. ``OtlpSink`` encodes straight to JSON for it (``encode_request``); protobuf bytes (the SDK
    exporter's) are converted through protobuf objects, which costs what the SDK encoder costs.
    """

    kind = "file"  # how failure warnings name this sink
    encode_request = staticmethod(encode_otlp_json)
    max_request_bytes = None  # a line may be any length: no receiver refuses it, and halving re-encodes

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = 100 * _MIB,
        backups: int = 5,
        follow_symlinks: bool = True,
    ) -> None:
        self.path = Path(path)
        self.file = TraceFile(path, max_bytes, backups, follow_symlinks)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, spans: EncodedSpans) -> bool:
        payload = spans.payload
        line = (payload if isinstance(payload, str) else request_to_otlp_json(payload)) + "\n"
        with self._lock:
            if self._closed:
                return False
            self.file.append(line.encode())  # OSError (disk full, read-only...): counted and warned by the sink
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self.file.close()


class SdkJsonFileExporter(SpanExporter):
    """SDK span exporter writing OTLP JSON lines (the SDK's encoder, then ``JsonFileSender``)."""

    def __init__(self, path: str | os.PathLike[str] | JsonFileSender) -> None:
        self.sender = path if isinstance(path, JsonFileSender) else JsonFileSender(path)
        self._failing = False  # one warning per failure burst, not the SDK processor's one per batch

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        if not spans:
            return SpanExportResult.SUCCESS
        payload = encode_spans(spans).SerializeToString()
        try:
            ok = self.sender.send(EncodedSpans(payload, len(spans)))
        except OSError as error:  # disk full, read-only...: the SDK's spans are lost, said once per burst
            if not self._failing:
                self._failing = True
                _logger.warning(
                    "torchtrace: file export failed (%s); dropping spans until it recovers", error_text(error)
                )
            return SpanExportResult.FAILURE
        if self._failing:
            self._failing = False
            _logger.warning("torchtrace: file export recovered")
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.sender.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


# --- sink -----------------------------------------------------------------------------------------------------

# gRPC servers (the OTel Collector's OTLP receiver included) refuse messages over 4 MiB by default: requests stay
# below, split by span count first (max_spans_per_request), then in halves until they fit.
MAX_REQUEST_BYTES = 3_500_000


def _requests_of(calls: Sequence[ModuleCall], step: int) -> list[Sequence[ModuleCall]]:
    """``calls`` in requests of at most ``step`` spans, cut between forwards wherever a whole forward fits: a
    forward cut in two is encoded span by span (several times the cost of a whole one, encoded as a block)."""
    if not isinstance(calls, Calls):
        return [calls[i : i + step] for i in range(0, len(calls), step)]
    requests: list[Sequence[ModuleCall]] = []
    whole: list[Sequence[ModuleCall]] = []
    size = 0
    for segment in calls.segments:
        if size + len(segment) > step and whole:
            requests.append(Calls(whole))
            whole, size = [], 0
        if len(segment) > step:  # a forward larger than a request: cut
            requests += (Calls([segment[i : i + step]]) for i in range(0, len(segment), step))
        else:
            whole.append(segment)
            size += len(segment)
    if whole:
        requests.append(Calls(whole))
    return requests


class OtlpSink:
    """A ``Sink``: encodes each batch of ModuleCalls (at most ``max_spans_per_request`` spans per request) and
    hands the bytes to ``sender``. Never raises; ``exported`` and ``failed`` count spans.

    Failures are bounded in time and in log lines: one request takes at most the sender's timeout
    (``OTEL_EXPORTER_OTLP_TIMEOUT``, retries included). After a failed request, requests for the next
    ``retry_interval_s`` are not attempted (their spans are counted in ``failed`` at once), then one request
    probes the endpoint again; so a dead endpoint costs one timeout per probe, never one per batch. One warning
    is logged when sending starts failing (with the exporter's reason), and one line when it recovers with the
    number of spans lost meanwhile; the OTLP exporters' own per-batch log lines are kept quiet during these sends.

    A slow endpoint gets what it can take: a request that fails by running out of time (the sender's timeout)
    halves the spans per request (down to ``MIN_REQUEST_SPANS``), and ``GROW_AFTER`` delivered in a row double
    them again, up to ``max_spans_per_request``; a collector accepting 100 spans a second took no 4,096-span
    request within 10 s, and so none at all.
    """

    def __init__(
        self,
        sender: SpanSender,
        resource: Resource | None = None,
        scope_name: str = "torchtrace",
        scope_version: str = "",
        max_spans_per_request: int = 4096,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self.sender = sender
        self.kind = getattr(sender, "kind", "OTLP")  # names the sink in failure warnings: "file" or "OTLP"
        self._encode = getattr(sender, "encode_request", encode_export_request)  # protobuf unless it wants JSON
        self.resource = resource if resource is not None else default_resource()
        self.scope_name = scope_name
        self.scope_version = scope_version
        self.max_spans_per_request = max(1, max_spans_per_request)
        self.request_spans = self.max_spans_per_request  # what a request holds now (adapted to the endpoint)
        self._timeout_s = getattr(sender, "timeout_s", None)  # a request that takes this long ran out of time
        self._delivered_in_row = 0
        self.max_request_bytes = getattr(sender, "max_request_bytes", max_request_bytes) or 1 << 62
        self.retry_interval_s = retry_interval_s
        self.exported = 0
        self.failed = 0
        self.failure_bursts = 0  # how many times export went from working to failing
        self._failing = False
        self._failed_in_burst = 0
        self._retry_at = 0.0
        self._shut_down = False
        self._lock = threading.Lock()

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        chunks = _requests_of(calls, self.request_spans)
        while chunks:
            chunk = chunks.pop(0)
            if self._shut_down or (self._failing and time.monotonic() < self._retry_at):
                self._record(len(chunk), False, None)
                continue
            try:
                payload = self._encode(chunk, self.resource, self.scope_name, self.scope_version)
            except Exception as e:  # a bug of ours, not the endpoint's: no backoff for the batches after it
                _logger.exception("torchtrace: could not encode %d spans", len(chunk))
                self._record(len(chunk), False, error_text(e), backoff=False)
                continue
            if len(payload) > self.max_request_bytes and len(chunk) > 1:  # receivers refuse larger messages
                half = len(chunk) // 2
                chunks[:0] = [chunk[:half], chunk[half:]]
                continue
            started = time.monotonic()
            ok, reason = self._send(EncodedSpans(payload, len(chunk)))
            self._adapt(len(chunk), ok, time.monotonic() - started)
            self._record(len(chunk), ok, reason)

    def _adapt(self, spans: int, ok: bool, seconds: float) -> None:
        """Half the spans per request after one that ran out of time; twice as many again (up to the maximum)
        after ``GROW_AFTER`` delivered in a row: an endpoint that got faster gets larger requests back."""
        if ok:
            self._delivered_in_row += 1
            if self._delivered_in_row >= GROW_AFTER and self.request_spans < self.max_spans_per_request:
                self.request_spans = min(self.max_spans_per_request, 2 * self.request_spans)
                self._delivered_in_row = 0
        elif self._timeout_s is not None and seconds >= 0.8 * self._timeout_s and spans > MIN_REQUEST_SPANS:
            self.request_spans = max(MIN_REQUEST_SPANS, spans // 2)
            self._delivered_in_row = 0

    def _send(self, spans: EncodedSpans) -> tuple[bool, str | None]:
        _send_state.active, _send_state.last = True, None
        try:
            if self.sender.send(spans):
                return True, None
            return False, getattr(_send_state, "last", None) or "exporter reported failure"
        except Exception as e:  # a sink must not break the traced program
            return False, error_text(e)
        finally:
            _send_state.active = False

    def _record(self, count: int, ok: bool, reason: str | None, backoff: bool = True) -> None:
        """Counts a request's spans; a failed send (``reason`` given) starts the backoff and warns once."""
        with self._lock:
            if not ok and reason is not None and backoff:
                self._retry_at = time.monotonic() + self.retry_interval_s
            if ok:
                self.exported += count
                if not self._failing:
                    return
                self._failing = False
                lost, self._failed_in_burst = self._failed_in_burst, 0
            else:
                self.failed += count
                self._failed_in_burst += count
                if self._failing or self._shut_down:
                    return
                self._failing = True
                self.failure_bursts += 1
        if ok:
            _logger.warning("torchtrace: %s export recovered; %d spans were lost while it failed", self.kind, lost)
            return
        _logger.warning(
            "torchtrace: %s export failed (%s); dropping spans until it recovers, retrying every %.3gs "
            '(counted in failed_spans / torchtrace_spans_dropped_total{reason="export_failed"})',
            self.kind,
            redact(reason or ""),
            self.retry_interval_s,
        )

    def shutdown(self) -> None:
        """Shut the sender down (idempotent); later batches are counted as failed, silently."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        try:
            self.sender.shutdown()
        except Exception as e:
            _logger.warning("torchtrace: %s sender shutdown failed: %s", self.kind, e)
