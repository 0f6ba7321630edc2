"""Sending torchtrace's encoded spans: real OTLP over gRPC and HTTP to a local receiver, and OTLP/JSON files.

Everything is configured the standard OpenTelemetry way, through OTEL_EXPORTER_OTLP_* / OTEL_RESOURCE_ATTRIBUTES /
OTEL_SERVICE_NAME environment variables, because the senders are opentelemetry-exporter-otlp's own exporters.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import socket
import threading
import time

import otlp_receiver
import pytest
from fault_receivers import DrippingHttpServer
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_receiver import attributes_dict

from torchtrace._core.calls import ModuleCall
from torchtrace._demo import run_demo
from torchtrace._otlp.exporters import (
    EncodedSpans,
    GrpcSender,
    HttpSender,
    JsonFileSender,
    OtlpSink,
    create_otlp_sender,
    create_sdk_span_exporter,
    default_resource,
    otlp_endpoint_configured,
    resolve_protocol,
)
from torchtrace._otlp.protobuf import encode_export_request

TRACE_ID = 0xA1A2A3A4A5A6A7A8B1B2B3B4B5B6B7B8
T0 = 1_700_000_000_000_000_000
OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SERVICE_NAME",
)


# the receiver fixtures (conftest may import them too)
otlp_grpc_receiver = otlp_receiver.otlp_grpc_receiver
otlp_http_receiver = otlp_receiver.otlp_http_receiver


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)


def forward_calls() -> list[ModuleCall]:
    """Three calls of one forward: the model, a Linear inside it, and a ReLU with a NaN stat."""
    return [
        ModuleCall("", "Net", 0, TRACE_ID, 0x1, 0, T0, T0 + 1000, {"dtype": "torch.float32"}),
        ModuleCall("fc", "Linear", 1, TRACE_ID, 0x2, 0x1, T0 + 10, T0 + 500, {"shape": [4, 8], "mean": 0.5}),
        ModuleCall("act", "ReLU", 1, TRACE_ID, 0x3, 0x1, T0 + 510, T0 + 900, {"shape": [4, 8], "mean": math.nan}),
    ]


def check_received(spans: list, resource: dict) -> None:
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["Net", "act", "fc"]
    assert {s.trace_id for s in spans} == {TRACE_ID.to_bytes(16, "big")}
    assert by_name["fc"].span_id == (2).to_bytes(8, "big")
    assert by_name["fc"].parent_span_id == by_name["Net"].span_id
    assert attributes_dict(by_name["fc"].attributes) == {"shape": [4, 8], "mean": 0.5}
    assert math.isnan(attributes_dict(by_name["act"].attributes)["mean"])
    assert resource["service.name"] == "trainer"
    assert resource["deployment.environment"] == "test"
    assert resource["telemetry.sdk.name"] == "opentelemetry"


def configure(monkeypatch: pytest.MonkeyPatch, protocol: str, compression: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", compression)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=secret")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=ignored")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")  # wins over service.name in OTEL_RESOURCE_ATTRIBUTES


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_grpc_export_to_a_real_receiver(monkeypatch, otlp_grpc_receiver, compression):
    configure(monkeypatch, "grpc", compression)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_grpc_receiver.endpoint)
    sender = create_otlp_sender()
    assert isinstance(sender, GrpcSender)
    sink = OtlpSink(sender, default_resource(), "torchtrace", "0.1", max_spans_per_request=2)
    sink(forward_calls())
    sink.shutdown()

    assert (sink.exported, sink.failed) == (3, 0)
    spans = otlp_grpc_receiver.wait_for_spans(3, timeout=5)
    assert len(otlp_grpc_receiver.requests) == 2  # 2 + 1 spans: requests are bounded
    check_received(spans, otlp_grpc_receiver.resource_attributes())
    assert all(h["x-api-key"] == "secret" for h in otlp_grpc_receiver.headers)
    scope = otlp_grpc_receiver.requests[0].resource_spans[0].scope_spans[0].scope
    assert (scope.name, scope.version) == ("torchtrace", "0.1")


def test_requests_are_cut_between_forwards_where_a_whole_forward_fits(monkeypatch, otlp_grpc_receiver):
    """A batch of forwards goes out in requests of at most max_spans_per_request spans, each holding whole forwards
    (encoded as blocks; a forward cut in two would be encoded span by span); a forward larger than a request is
    cut. Every span arrives once, in order."""
    import torch
    from torch import nn

    import torchtrace
    from torchtrace._core.calls import Calls

    configure(monkeypatch, "grpc", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_grpc_receiver.endpoint)
    batches = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))  # 5 calls a forward
    with torchtrace.instrument(model, exporter="none", sinks=[batches.append]) as handle:
        for _ in range(5):
            model(torch.randn(2, 4))
        handle.flush()
    forwards = Calls([segment for batch in batches for segment in batch.segments])
    sent_ids = [span_id for segment in forwards.segments for span_id in segment.span_id]
    for step, sizes in ((12, [10, 10, 5]), (3, [3, 2] * 5)):
        otlp_grpc_receiver.clear()
        sink = OtlpSink(create_otlp_sender(), default_resource(), "torchtrace", "0.1", max_spans_per_request=step)
        sink(forwards)
        sink.shutdown()
        assert (sink.exported, sink.failed) == (25, 0)
        spans = otlp_grpc_receiver.wait_for_spans(25, timeout=5)
        assert [sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans)
                for r in otlp_grpc_receiver.requests] == sizes  # fmt: skip
        assert [int.from_bytes(span.span_id, "big") for span in spans] == sent_ids


@pytest.mark.parametrize(
    "setting, through",
    [({}, "urllib3"), ({"HTTP_PROXY": "http://proxy.invalid:3128"}, "requests"),
     ({"HTTP_PROXY": "http://proxy.invalid:3128", "NO_PROXY": "127.0.0.1"}, "urllib3"),
     ({"netrc": True}, "requests"), ({"https": True}, "requests")],
    ids=["plain-http", "proxy", "proxy-bypassed", "netrc-entry", "https"],
)  # fmt: skip
def test_a_plain_http_endpoint_with_no_proxy_is_sent_to_through_urllib3(
    monkeypatch, tmp_path, otlp_http_receiver, setting, through
):
    """To a plain http:// endpoint that no proxy variable or .netrc entry applies to, requests go through the SDK's
    urllib3 transport (half requests' Python per request); anything requests would treat differently (a proxy, a
    .netrc login, TLS with its CA bundle) keeps requests. Either way inside the total deadline."""
    from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
    from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport

    configure(monkeypatch, "http/protobuf", "none")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "no_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password secret\n" if setting.get("netrc") else "")
    monkeypatch.setenv("NETRC", str(netrc))
    for name, value in setting.items():
        if name.isupper():
            monkeypatch.setenv(name, value)
    endpoint = otlp_http_receiver.endpoint.replace("http://", "https://") if setting.get("https") else None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint or otlp_http_receiver.endpoint)
    sender = create_otlp_sender()
    inner = sender._client._transport._inner
    assert type(inner) is {"urllib3": Urllib3HTTPTransport, "requests": RequestsHTTPTransport}[through]
    if through == "urllib3":
        sink = OtlpSink(sender, default_resource())
        sink(forward_calls())
        sink.shutdown()
        assert (sink.exported, sink.failed) == (3, 0)
        check_received(otlp_http_receiver.wait_for_spans(3, timeout=5), otlp_http_receiver.resource_attributes())
        assert otlp_http_receiver.headers[0]["x-api-key"] == "secret"
    else:
        sender.shutdown()


def test_requests_run_on_one_kept_thread_and_a_stalled_one_keeps_its_own(monkeypatch, otlp_http_receiver):
    """An OTLP/HTTP request runs off the caller's thread (so that the caller can stop waiting at the deadline), on a
    thread kept for the next request rather than one started per request (100-300 us each). A request that outlives
    its deadline keeps its thread; a request to a working endpoint meanwhile gets another thread, at once. Once the
    exporters are shut down, their threads end (the stalled one when its request does)."""
    configure(monkeypatch, "http/protobuf", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    threads: dict[str, list[threading.Thread]] = {"working": [], "dripping": []}

    def sender_to(endpoint: str, name: str) -> OtlpSink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        sender = create_otlp_sender()
        inner = sender._client._transport._inner
        request = inner.request

        def noting_the_thread(*args, **kwargs):
            threads[name].append(threading.current_thread())  # not its ident: a new thread may reuse an old one's
            return request(*args, **kwargs)

        monkeypatch.setattr(inner, "request", noting_the_thread)
        return OtlpSink(sender, default_resource())

    working = sender_to(otlp_http_receiver.endpoint, "working")
    for _ in range(5):
        working(forward_calls())
    assert (working.exported, working.failed) == (15, 0)
    assert len(set(threads["working"])) == 1 and threads["working"][0] is not threading.current_thread()

    dripping_server = DrippingHttpServer(drip_s=0.2)
    try:
        dripping = sender_to(dripping_server.endpoint, "dripping")
        dripping(forward_calls())  # cut at its 1 s deadline; its thread still reads the drip
        assert (dripping.exported, dripping.failed) == (0, 3)
        started = time.monotonic()
        working(forward_calls())
        assert time.monotonic() - started < 0.9  # not queued behind the dripping request
        assert (working.exported, working.failed) == (18, 0)
        assert threads["working"][-1] is not threads["dripping"][0]
    finally:
        dripping_server.stop()
    working.shutdown()
    dripping.shutdown()
    served = [*threads["working"], *threads["dripping"]]
    deadline = time.monotonic() + 5  # the dripping request ends once its peer has stopped
    while any(thread.is_alive() for thread in served) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(thread.is_alive() for thread in served)  # closed exporters leave no thread of theirs behind


class CountingRelay:
    """A TCP relay in front of a receiver that counts the bytes the client sends: what went over the wire."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.sent = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(65536):
                if counted:
                    self.sent += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()


def test_grpc_gzip_compresses_what_goes_over_the_wire(monkeypatch, otlp_grpc_receiver):
    sent = {}
    for compression in ("none", "gzip"):
        relay = CountingRelay(otlp_grpc_receiver.endpoint)
        configure(monkeypatch, "grpc", compression)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", relay.endpoint)
        sink = OtlpSink(create_otlp_sender(), default_resource())
        sink(forward_calls() * 100)  # 300 similar spans: compressible
        sink.shutdown()
        relay.close()
        assert (sink.exported, sink.failed) == (300, 0)
        sent[compression] = relay.sent
    assert len(otlp_grpc_receiver.wait_for_spans(600, timeout=5)) == 600
    assert sent["gzip"] < 0.5 * sent["none"], sent


def test_requests_are_split_until_they_fit_the_receivers_message_size(monkeypatch, otlp_grpc_receiver):
    configure(monkeypatch, "grpc", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_grpc_receiver.endpoint)
    sink = OtlpSink(create_otlp_sender(), default_resource(), max_request_bytes=2_000)
    calls = forward_calls() * 10  # 30 spans of ~300 bytes: one request by count, several by size
    sink(calls)
    sink.shutdown()
    assert (sink.exported, sink.failed) == (30, 0)
    assert len(otlp_grpc_receiver.wait_for_spans(30, timeout=5)) == 30
    sizes = [request.ByteSize() for request in otlp_grpc_receiver.requests]
    assert len(sizes) > 1 and max(sizes) <= 2_000


def test_a_batch_that_cannot_be_encoded_is_counted_without_holding_back_the_next(monkeypatch, otlp_http_receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_http_receiver.traces_endpoint)
    sink = OtlpSink(create_otlp_sender(), default_resource())
    encode = sink._encode
    sink._encode = lambda chunk, *rest: encode(chunk, *rest) if len(chunk) != 2 else 1 / 0  # an encoder bug
    sink(forward_calls()[:2])
    sink(forward_calls())  # no backoff after an encoding failure: the endpoint is fine
    sink.shutdown()
    assert (sink.exported, sink.failed) == (3, 2)
    assert len(otlp_http_receiver.wait_for_spans(3, timeout=5)) == 3


def test_the_file_exporter_follows_a_rotated_file(tmp_path):
    path = tmp_path / "traces.jsonl"
    sink = OtlpSink(JsonFileSender(path), default_resource())
    sink(forward_calls()[:1])
    path.rename(tmp_path / "traces.jsonl.1")  # what logrotate does
    sink(forward_calls()[1:])
    sink.shutdown()
    assert len((tmp_path / "traces.jsonl.1").read_text().splitlines()) == 1
    assert len(path.read_text().splitlines()) == 1  # the later spans went to a new file, not the moved one
    assert (sink.exported, sink.failed) == (3, 0)


def test_the_demos_endpoint_flag_beats_a_traces_endpoint_in_the_environment(monkeypatch, otlp_http_receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")  # nothing listens
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"):  # the demo sets them: undone after
        monkeypatch.setenv(name, "")
    out = io.StringIO()
    status = run_demo(batches=1, otlp_endpoint=otlp_http_receiver.endpoint, protocol="http/protobuf",
                      stats=False, out=out, progress=io.StringIO())  # fmt: skip
    assert status == 0, out.getvalue()
    assert otlp_http_receiver.wait_for_spans(1, timeout=5)


def test_sdk_span_exporter_accepts_compression_none_over_grpc(monkeypatch, otlp_grpc_receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_grpc_receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "none")  # allowed by the spec; the SDK's exporter refuses
    exporter = create_sdk_span_exporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("app").start_span("request").end()
    provider.shutdown()
    assert [span.name for span in otlp_grpc_receiver.wait_for_spans(1, timeout=5)] == ["request"]


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_http_export_to_a_real_receiver(monkeypatch, otlp_http_receiver, compression):
    configure(monkeypatch, "http/protobuf", compression)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_http_receiver.endpoint)  # base URL: /v1/traces appended
    sender = create_otlp_sender()
    assert isinstance(sender, HttpSender)
    sink = OtlpSink(sender, default_resource())
    sink(forward_calls())
    sink.shutdown()

    assert (sink.exported, sink.failed) == (3, 0)
    check_received(otlp_http_receiver.wait_for_spans(3, timeout=5), otlp_http_receiver.resource_attributes())
    assert otlp_http_receiver.content_encodings == ["gzip" if compression == "gzip" else ""]
    assert otlp_http_receiver.headers[0]["x-api-key"] == "secret"


def test_http_is_the_default_protocol_and_traces_endpoint_is_used_as_is(monkeypatch, otlp_http_receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_http_receiver.traces_endpoint)
    sender = create_otlp_sender()
    assert isinstance(sender, HttpSender)
    payload = encode_export_request(forward_calls(), default_resource(), "torchtrace", "")
    assert sender.send(EncodedSpans(payload, 3))
    assert len(otlp_http_receiver.wait_for_spans(3, timeout=5)) == 3
    assert otlp_http_receiver.resource_attributes()["service.name"] == "torchtrace"  # nothing configured one


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_unreachable_collector_is_counted_and_warned_about_once(monkeypatch, caplog, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")  # retries stop at the deadline
    sink = OtlpSink(create_otlp_sender(), default_resource())
    with caplog.at_level(logging.WARNING, logger="torchtrace._otlp.exporters"):
        sink(forward_calls())
        sink(forward_calls())
    sink.shutdown()
    assert (sink.exported, sink.failed) == (0, 6)
    ours = [r for r in caplog.records if r.name == "torchtrace._otlp.exporters"]
    assert len(ours) == 1 and "OTLP export failed" in ours[0].getMessage()


def test_a_sender_that_raises_does_not_break_the_caller():
    class Broken:
        def send(self, spans: EncodedSpans) -> bool:
            raise RuntimeError("boom")

        def shutdown(self) -> None:
            pass

    sink = OtlpSink(Broken(), default_resource())
    sink(forward_calls())
    assert (sink.exported, sink.failed) == (0, 3)


def test_protocol_comes_from_the_traces_variable_first(monkeypatch):
    assert resolve_protocol() == "http/protobuf"  # the OTel spec's default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert resolve_protocol() == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert resolve_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'.*grpc, http/protobuf"):
        resolve_protocol()


def test_endpoint_configured(monkeypatch):
    assert not otlp_endpoint_configured()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert otlp_endpoint_configured()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert otlp_endpoint_configured()


def test_default_resource_names_the_service(monkeypatch):
    assert default_resource().attributes["service.name"] == "torchtrace"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,team=ml")
    assert default_resource().attributes["service.name"] == "from-attrs"
    assert default_resource().attributes["team"] == "ml"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-service-name")
    assert default_resource().attributes["service.name"] == "from-service-name"


def test_json_file_lines_are_otlp_json(tmp_path):
    path = tmp_path / "sub" / "dir" / "traces.jsonl"  # parent directories are created
    sink = OtlpSink(JsonFileSender(path), default_resource(), "torchtrace", "0.1")
    calls = forward_calls()
    sink(calls)
    sink(calls[:1])
    sink.shutdown()

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    span = first["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    assert span["traceId"] == f"{TRACE_ID:032x}" and span["spanId"] == "0000000000000002"
    assert span["parentSpanId"] == "0000000000000001"
    assert span["kind"] == 1  # enums as ints
    assert span["startTimeUnixNano"] == str(T0 + 10)  # 64-bit ints are strings in the protobuf JSON mapping

    # The line maps back to the exact request: hex ids -> base64 (protobuf JSON), then json_format.
    def hex_to_base64(node):
        if isinstance(node, dict):
            return {
                k: base64.b64encode(bytes.fromhex(v)).decode()
                if k in ("traceId", "spanId", "parentSpanId")
                else hex_to_base64(v)
                for k, v in node.items()
            }
        return [hex_to_base64(x) for x in node] if isinstance(node, list) else node

    parsed = json_format.ParseDict(hex_to_base64(first), ExportTraceServiceRequest())
    original = ExportTraceServiceRequest.FromString(
        encode_export_request(calls, default_resource(), "torchtrace", "0.1")
    )
    assert parsed.SerializeToString(deterministic=True) == original.SerializeToString(deterministic=True)


def test_json_file_sender_is_thread_safe(tmp_path):
    sender = JsonFileSender(tmp_path / "t.jsonl")
    payload = EncodedSpans(encode_export_request(forward_calls(), default_resource(), "torchtrace", ""), 3)
    threads = [threading.Thread(target=lambda: [sender.send(payload) for _ in range(20)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender.shutdown()
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 80 and all(
        len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) == 3 for line in lines
    )
    assert not sender.send(payload)  # after shutdown
