"""Where encoded spans go: OTLP over gRPC or HTTP, or an OTLP/JSON lines file.

The network senders are opentelemetry-exporter-otlp's own span exporters with the encoding step swapped for
torchtrace's pre-encoded bytes (``_otlp_encoding``), so endpoint, headers, timeout, compression, TLS
certificates, retries with backoff and gRPC reconnects all follow the standard ``OTEL_EXPORTER_OTLP_*``
variables exactly as they do for any OpenTelemetry Python application.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf import json_format
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
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_COMPRESSION,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from torchtrace._calls import ModuleCall
from torchtrace._otlp_encoding import encode_export_request

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "EncodedSpans",
    "GrpcSender",
    "HttpSender",
    "JsonFileSender",
    "OtlpSink",
    "SpanSender",
    "create_otlp_sender",
    "default_resource",
    "otlp_endpoint_configured",
    "resolve_protocol",
]

_logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "torchtrace"
PROTOCOLS = ("grpc", "http/protobuf")
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass(frozen=True, slots=True)
class EncodedSpans:
    """One serialized ExportTraceServiceRequest and how many spans it holds."""

    payload: bytes
    span_count: int


class SpanSender(Protocol):
    def send(self, spans: EncodedSpans) -> bool: ...

    def shutdown(self) -> None: ...


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


def create_otlp_sender(protocol: str | None = None) -> GrpcSender | HttpSender:
    """A sender for ``protocol`` (default: ``resolve_protocol()``), configured from the environment."""
    protocol = protocol or resolve_protocol()
    if protocol == "grpc":
        return GrpcSender()
    if protocol == "http/protobuf":
        return HttpSender()
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")


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
        if compression is None:
            # The spec allows OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION=none; the SDK's gRPC exporter rejects it.
            for var in (OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, OTEL_EXPORTER_OTLP_COMPRESSION):
                value = os.environ.get(var, "").strip().lower()
                if value:
                    if value == "none":
                        compression = grpc.Compression.NoCompression
                    break
        super().__init__(*args, compression=compression, **kwargs)

    def _initialize_channel_and_stub(self) -> None:
        super()._initialize_channel_and_stub()  # also called on reconnect: replace the stub every time
        self._client = _PreEncodedTraceServiceStub(self._channel)

    def _translate_data(self, data: EncodedSpans) -> bytes:  # type: ignore[override]
        return data.payload

    def _count_data(self, data: EncodedSpans) -> int:  # type: ignore[override]
        return data.span_count

    def send(self, spans: EncodedSpans) -> bool:
        return self._export(spans) is SpanExportResult.SUCCESS


class HttpSender(_HttpSpanExporter):
    """OTLP/HTTP protobuf: the SDK's HTTP span exporter and its client (retries, headers, compression, TLS)."""

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

    Converting to JSON goes through protobuf objects, so it costs what the SDK encoder costs: meant for debugging
    and offline collection, not for the hot path.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: Any = None
        self._closed = False

    def send(self, spans: EncodedSpans) -> bool:
        line = request_to_otlp_json(spans.payload) + "\n"
        with self._lock:
            if self._closed:
                return False
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open until shutdown
            self._file.write(line)
            self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None


# --- sink -----------------------------------------------------------------------------------------------------


class OtlpSink:
    """A ``Sink``: encodes each batch of ModuleCalls (at most ``max_spans_per_request`` spans per request) and
    hands the bytes to ``sender``. Never raises; ``exported`` and ``failed`` count spans; one warning is logged
    when sending starts failing, and one line when it recovers."""

    def __init__(
        self,
        sender: SpanSender,
        resource: Resource | None = None,
        scope_name: str = "torchtrace",
        scope_version: str = "",
        max_spans_per_request: int = 4096,
    ) -> None:
        self.sender = sender
        self.resource = resource if resource is not None else default_resource()
        self.scope_name = scope_name
        self.scope_version = scope_version
        self.max_spans_per_request = max(1, max_spans_per_request)
        self.exported = 0
        self.failed = 0
        self._failing = False
        self._shut_down = False
        self._lock = threading.Lock()

    def __call__(self, calls: Sequence[ModuleCall]) -> None:
        step = self.max_spans_per_request
        for i in range(0, len(calls), step):
            chunk = calls[i : i + step]
            ok = False
            error: BaseException | None = None
            if not self._shut_down:
                try:
                    payload = encode_export_request(chunk, self.resource, self.scope_name, self.scope_version)
                    ok = self.sender.send(EncodedSpans(payload, len(chunk)))
                except Exception as e:  # a sink must not break the traced program
                    error = e
            self._record(len(chunk), ok, error)

    def _record(self, count: int, ok: bool, error: BaseException | None) -> None:
        with self._lock:
            if ok:
                self.exported += count
                if self._failing:
                    self._failing = False
                    _logger.info("torchtrace: OTLP export recovered")
                return
            self.failed += count
            if self._failing or self._shut_down:
                return
            self._failing = True
        _logger.warning(
            "torchtrace: OTLP export failed (%s); dropping spans until it recovers (see OtlpSink.failed)",
            f"{type(error).__name__}: {error}" if error is not None else "exporter reported failure",
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
            _logger.warning("torchtrace: OTLP sender shutdown failed: %s", e)
