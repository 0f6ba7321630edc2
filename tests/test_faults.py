"""Faults the traced job must not notice, each against a real socket on 127.0.0.1.

For every fault: no exception reaches the caller, forwards are not held up by export, memory stays bounded, lost
spans are counted (``failed_spans``, ``dropped_calls``, the ``torchtrace_spans_dropped_total`` metric) and logged
once per burst, and export resumes when the endpoint comes back. ``OTEL_EXPORTER_OTLP_TIMEOUT`` is 1 s here, so one
request takes at most ~1 s, retries included.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from checkout import checkout_env
from fault_receivers import Blackhole, FaultyGrpcReceiver, FaultyHttpReceiver, free_port, wait_until
from otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, attributes_dict
from otlp_receiver import otlp_http_receiver as otlp_http_receiver  # noqa: F401 - fixture
from prometheus_client import CollectorRegistry
from torch import nn

import torchtrace
from torchtrace import _handle
from torchtrace._otlp import exporters as _exporters

# The fork tests fork a process that runs torchtrace's worker thread on purpose; Python 3.12+ warns about that.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1.0
CALLS = 4  # Sequential + 3 children


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()


def torchtrace_warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("torchtrace") and text in r.getMessage()]


def sdk_exporter_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]


@pytest.fixture
def otlp_to(monkeypatch: pytest.MonkeyPatch):
    """otlp_to(endpoint, protocol): OTLP settings for the next instrument(exporter="otlp")."""

    def configure(endpoint: str, protocol: str) -> None:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", str(TIMEOUT_S))

    return configure


def run_forwards(model: nn.Module, count: int) -> list[float]:
    """Runs ``count`` forwards; returns each one's wall time in seconds."""
    x = torch.randn(8, 16)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return times


# --- slow / stalled endpoint ------------------------------------------------------------------------------------


def test_a_slow_collector_gets_requests_it_can_take(otlp_to) -> None:
    """A collector that takes at most 100 spans within the request timeout: requests that run out of time halve the
    spans they hold until they fit, and from then on every span is delivered (each lost one counted)."""
    receiver = FaultyHttpReceiver("slow", max_spans=100, stall_s=30).start()
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(31)]).eval()  # 32 spans a forward
    x = torch.randn(2, 4)
    try:
        otlp_to(receiver.endpoint, "http/protobuf")
        with torchtrace.instrument(
            model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=600_000)
        ) as handle:
            for _ in range(3):  # 320 spans a round: one request of 320 (too many), then of 160, then 80
                for _ in range(10):
                    model(x)
                handle.flush()
                time.sleep(_exporters.DEFAULT_RETRY_INTERVAL_S + 0.05)  # past the pause after a failed request
            before = len(receiver.spans())
            for _ in range(10):
                model(x)
            assert handle.flush()  # this round: every span delivered
            assert len(receiver.spans()) - before == 320
            assert handle.exported_spans + handle.failed_spans == 4 * 320  # every span accounted for
        assert receiver.request_sizes[0] == 320 and max(receiver.request_sizes[-4:]) <= 100
    finally:
        receiver.stop()


def test_what_waits_for_a_stalled_endpoint_stays_within_max_pending_calls(otlp_to) -> None:
    """max_pending_calls bounds every call held for export: the buffer, what waits for the next request, and the
    request in flight together (they could reach twice the bound while a request stalled). Past it, whole
    forwards are dropped, and every call is still accounted for."""
    receiver = FaultyHttpReceiver("stall", stall_s=30).start()
    try:
        otlp_to(receiver.endpoint, "http/protobuf")
        model = make_model()
        held = []
        forwards = 0
        with torchtrace.instrument(
            model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=20, max_pending_calls=40)
        ) as handle:
            deadline = time.monotonic() + 1.5 * TIMEOUT_S  # a request stalls, times out, and the next probe stalls
            while time.monotonic() < deadline:
                run_forwards(model, 1)
                forwards += 1
                held.append(handle.buffer.pending_calls + handle.buffer.held_elsewhere)
                time.sleep(0.002)
        assert max(held) <= 40 and handle.dropped_calls > 0
        assert handle.exported_spans + handle.failed_spans + handle.dropped_calls == forwards * CALLS
    finally:
        receiver.stop()


@pytest.mark.parametrize("fault", ["http-stall", "grpc-stall", "tcp-blackhole"])
def test_forwards_are_not_held_up_while_the_endpoint_stalls(otlp_to, caplog, fault: str) -> None:
    if fault == "http-stall":
        endpoint = FaultyHttpReceiver("stall", stall_s=30).start()
        protocol = "http/protobuf"
    elif fault == "grpc-stall":
        endpoint = FaultyGrpcReceiver("stall", stall_s=30).start()
        protocol = "grpc"
    else:
        endpoint, protocol = Blackhole(), "http/protobuf"
    try:
        otlp_to(endpoint.endpoint, protocol)
        model = make_model()
        baseline = statistics.median(run_forwards(model, 200))
        handle = torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=20))
        # A full garbage collection of this (large) test process pauses a forward for 0.3-0.7 s on a loaded
        # machine, export or not: collections wait until the window ends, so a pause here is the export's.
        gc.disable()
        try:
            times: list[float] = []
            deadline = time.monotonic() + 2.5 * TIMEOUT_S  # covers a stalled request, its failure and a probe
            while time.monotonic() < deadline:
                times += run_forwards(model, 20)
                time.sleep(0.001)
            assert handle.failed_spans > 0  # the stalled requests timed out...
            assert handle.exported_spans == 0
        finally:
            gc.enable()
            started = time.monotonic()
            handle.remove()
            remove_s = time.monotonic() - started
        times.sort()
        p99, worst = times[int(len(times) * 0.99)], times[-1]
        print(
            f"{fault}: {len(times)} forwards, median {statistics.median(times) * 1e3:.3f} ms "
            f"(untraced {baseline * 1e3:.3f} ms), p99 {p99 * 1e3:.3f} ms, max {worst * 1e3:.3f} ms, "
            f"remove() {remove_s:.2f} s"
        )
        # ...while forwards never waited for them: the hook only appends to a buffer
        assert worst < 0.5 * TIMEOUT_S, f"a forward took {worst:.3f}s while export stalled"
        assert remove_s < 2 * TIMEOUT_S + 1.0  # documented: remove()/flush() wait at most ~2 x the timeout
        assert len(torchtrace_warnings(caplog, "OTLP export failed")) == 1
        assert sdk_exporter_records(caplog) == []
    finally:
        endpoint.__exit__(None, None, None)


# --- down, refusing, erroring, closing: counted, logged once, then resumed -------------------------------------


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_export_resumes_when_a_down_endpoint_comes_back(otlp_to, caplog, protocol: str) -> None:
    port = free_port()  # nothing listens: connections are refused
    otlp_to(f"http://127.0.0.1:{port}", protocol)
    model = make_model()
    with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=50)) as handle:
        run_forwards(model, 5)
        handle.flush()
        assert (handle.exported_spans, handle.failed_spans) == (0, 5 * CALLS)

        receiver_class = FaultyHttpReceiver if protocol == "http/protobuf" else FaultyGrpcReceiver
        receiver = receiver_class("ok", port=port).start()
        try:

            def delivered() -> bool:
                run_forwards(model, 1)
                handle.flush()
                return receiver.spans() != []

            assert wait_until(delivered, timeout=8 * TIMEOUT_S, interval=0.1)
            assert handle.exported_spans > 0
        finally:
            receiver.stop()
    assert len(torchtrace_warnings(caplog, "OTLP export failed")) == 1
    recovered = torchtrace_warnings(caplog, "recovered")
    assert len(recovered) == 1 and "spans were lost" in recovered[0].getMessage()
    assert sdk_exporter_records(caplog) == []


@pytest.mark.parametrize(
    ("protocol", "failure"),
    [
        ("http/protobuf", 503),  # retryable: retried until the timeout
        ("http/protobuf", 400),  # permanent
        ("http/protobuf", "close"),  # connection closed without a reply
        ("grpc", grpc.StatusCode.UNAVAILABLE),
        ("grpc", grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=str,
)
def test_failing_requests_are_counted_logged_once_and_recover(otlp_to, caplog, protocol, failure) -> None:
    if protocol == "grpc":
        receiver = FaultyGrpcReceiver("error", error_code=failure).start()
    elif failure == "close":
        receiver = FaultyHttpReceiver("close").start()
    else:
        receiver = FaultyHttpReceiver("error", error_status=failure).start()
    try:
        otlp_to(receiver.endpoint, protocol)
        model = make_model()
        with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=50)) as handle:
            for _ in range(10):
                run_forwards(model, 1)
                handle.flush()
            assert (handle.exported_spans, handle.failed_spans) == (0, 10 * CALLS)
            assert receiver.attempts >= 1
            receiver.mode = "ok"

            def delivered() -> bool:
                run_forwards(model, 1)
                handle.flush()
                return handle.exported_spans > 0

            assert wait_until(delivered, timeout=6 * TIMEOUT_S, interval=0.1)
        assert len(torchtrace_warnings(caplog, "OTLP export failed")) == 1
        assert len(torchtrace_warnings(caplog, "recovered")) == 1
        assert sdk_exporter_records(caplog) == []  # the exporters' per-batch lines stay quiet
    finally:
        receiver.stop()


def test_an_exporter_that_raises_is_counted_and_the_model_is_unaffected(monkeypatch, caplog) -> None:
    class Broken:
        def send(self, spans):
            raise RuntimeError("exporter bug")

        def shutdown(self) -> None:
            raise RuntimeError("shutdown bug")

    monkeypatch.setattr(_exporters, "create_otlp_sender", lambda protocol=None: Broken())
    model = make_model()
    x = torch.randn(8, 16)
    expected = model(x)
    with torchtrace.instrument(model, exporter="otlp") as handle:
        for _ in range(3):
            assert torch.equal(model(x), expected)
        handle.flush()
        assert (handle.exported_spans, handle.failed_spans) == (0, 3 * CALLS)
        assert len(handle.records) == 3 * CALLS  # the other sinks still get every call
    failed = torchtrace_warnings(caplog, "OTLP export failed")
    assert len(failed) == 1 and "RuntimeError: exporter bug" in failed[0].getMessage()


# --- queue overflow -----------------------------------------------------------------------------------------------


def test_a_full_buffer_drops_whole_forwards_counts_them_and_says_so_once(caplog) -> None:
    release = threading.Event()

    def stuck_exporter(calls) -> None:  # export far slower than the model
        release.wait(10)

    registry = CollectorRegistry()
    metrics = torchtrace.MetricsSink(registry)
    model = make_model()
    forwards = 300
    with torchtrace.instrument(
        model,
        exporter="none",
        sinks=[stuck_exporter],
        limits=torchtrace.Limits(max_pending_calls=10 * CALLS, export_interval_ms=10),
    ) as handle:
        metrics.watch(handle)
        assert wait_until(lambda: run_forwards(model, 1) and handle.dropped_calls > 0, timeout=5)
        run_forwards(model, forwards)
        assert handle.buffer.pending_calls <= 10 * CALLS  # bounded memory
        dropped = handle.dropped_calls
        assert dropped > 0 and dropped % CALLS == 0  # whole forwards, never half a tree
        samples = {
            sample.labels["reason"]: sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == "torchtrace_spans_dropped_total"
        }
        assert samples["buffer_full"] == dropped
        release.set()
        handle.flush()
        kept = len(handle.records)
    assert kept + dropped >= forwards * CALLS  # every call is either delivered or counted
    assert len(torchtrace_warnings(caplog, "record buffer full")) == 1


# --- fork -----------------------------------------------------------------------------------------------------------


def _wait_for_child(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child still running after {timeout}s (deadlock?)")


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_forked_child_traces_with_its_own_worker_and_resource(otlp_to, protocol: str) -> None:
    receiver = (OtlpHttpReceiver if protocol == "http/protobuf" else OtlpGrpcReceiver)().start()
    try:
        otlp_to(receiver.endpoint, protocol)
        model = make_model()
        with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=20)) as handle:
            run_forwards(model, 1)
            handle.flush()
            pid = os.fork()
            if pid == 0:  # the child: forwards, then its own flush; os._exit skips pytest's teardown
                code = 1
                try:
                    run_forwards(model, 3)
                    code = 0 if handle.flush(timeout_millis=5000) and handle.exported_spans >= 3 * CALLS else 3
                finally:
                    os._exit(code)
            assert _wait_for_child(pid, timeout=20) == 0
            run_forwards(model, 1)
        spans = receiver.wait_for_spans(5 * CALLS, timeout=5)
        assert len(spans) == 5 * CALLS
        instance_ids = {
            attributes_dict(rs.resource.attributes)["service.instance.id"]
            for request in receiver.requests
            for rs in request.resource_spans
        }
        assert len(instance_ids) == 2  # the child's spans say they come from another process
    finally:
        receiver.stop()


def test_a_child_forked_mid_step_keeps_its_rank_and_does_not_send_the_parents_step(
    otlp_to, otlp_http_receiver, monkeypatch
) -> None:
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "TORCHTRACE_RUN_ID": "run7"}.items():
        monkeypatch.setenv(name, value)  # a rank of a distributed job (no process group needed for the ids)
    otlp_to(otlp_http_receiver.endpoint, "http/protobuf")
    model = make_model()
    with torchtrace.instrument(model, exporter="otlp", backward=True) as handle:
        model(torch.randn(8, 16, requires_grad=True)).sum().backward()  # step 0 is open
        pid = os.fork()
        if pid == 0:  # the child: one forward of its own, then remove() delivers what it recorded
            code = 1
            try:
                model(torch.randn(8, 16))
                handle.remove()
                code = 0 if handle.exported_spans > 0 else 3
            finally:
                os._exit(code)
        assert _wait_for_child(pid, timeout=20) == 0
        handle.step()
        handle.flush()
    requests = otlp_http_receiver.requests
    resources = [attributes_dict(rs.resource.attributes) for request in requests for rs in request.resource_spans]
    assert len(resources) == 2 and all(r["torchtrace.rank"] == 1 for r in resources)
    assert {r["service.instance.id"] for r in resources} == {"run7/" + socket.gethostname() + "/rank-1"}
    spans = otlp_http_receiver.spans()
    assert [span.name for span in spans].count("rank 1") == 2  # the parent's step 0, the child's
    assert len({span.span_id for span in spans}) == len(spans)  # nothing of the parent's step sent twice


def test_fork_while_the_worker_is_stuck_in_an_export_does_not_deadlock_the_child(otlp_to) -> None:
    receiver = FaultyHttpReceiver("stall", stall_s=30).start()
    try:
        otlp_to(receiver.endpoint, "http/protobuf")
        model = make_model()
        with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=10)) as handle:
            run_forwards(model, 1)
            assert wait_until(lambda: receiver.attempts >= 1, timeout=5)  # worker inside a send, holding its lock
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    run_forwards(model, 3)
                    code = 0 if len(handle.records) >= 3 * CALLS else 3  # reading records takes the lock
                    handle.remove()  # flush + shutdown: bounded by the timeout, never stuck
                finally:
                    os._exit(code)
            assert _wait_for_child(pid, timeout=15) == 0
    finally:
        receiver.stop()


def _child_forwards(model: nn.Module, queue) -> None:
    x = torch.ones(2, 16)
    out = model(x)
    handle = _handle._instrumented[model]
    handle.flush(timeout_millis=5000)
    queue.put((out.tolist(), handle.exported_spans))


def test_multiprocessing_fork_children_run_traced_forwards(otlp_to, otlp_http_receiver) -> None:
    otlp_to(otlp_http_receiver.endpoint, "http/protobuf")
    model = make_model()
    with torchtrace.instrument(model, exporter="otlp", limits=torchtrace.Limits(export_interval_ms=20)):
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        children = [context.Process(target=_child_forwards, args=(model, queue)) for _ in range(2)]
        for child in children:
            child.start()
        results = [queue.get(timeout=20) for _ in children]
        for child in children:
            child.join(timeout=10)
            assert child.exitcode == 0
        expected = model(torch.ones(2, 16)).tolist()
    assert all(output == expected for output, _ in results)  # outputs unchanged in the children
    assert all(exported >= CALLS for _, exported in results)
    otlp_http_receiver.wait_for_spans(3 * CALLS, timeout=5)


# --- interpreter exit with spans pending --------------------------------------------------------------------------

EXIT_SCRIPT = """
import torch, torchtrace
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
handle = torchtrace.instrument(model, exporter={exporter!r},
                              limits=torchtrace.Limits(export_interval_ms=600_000))  # never before exit
for _ in range({forwards}):
    model(torch.randn(8, 16))
print("forwards done", flush=True)
"""  # no remove(): torchtrace's atexit delivers


def _run_script(
    script: str, env_updates: dict[str, str], timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float]:
    env = checkout_env(**env_updates)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=timeout
    )
    return result, time.monotonic() - started


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_pending_at_exit_reach_the_endpoint(protocol: str) -> None:
    receiver = (OtlpHttpReceiver if protocol == "http/protobuf" else OtlpGrpcReceiver)().start()
    try:
        result, _ = _run_script(
            EXIT_SCRIPT.format(exporter="otlp", forwards=5),
            {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(receiver.wait_for_spans(5 * CALLS, timeout=5)) == 5 * CALLS
    finally:
        receiver.stop()


SERVING_AFTER_MAIN_SCRIPT = """
import json, threading, time, torch, torchtrace
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
torchtrace.instrument(model, exporter="otlp")
served = 0

def serve():  # a server's request thread, not a daemon: the interpreter waits for it
    global served
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        model(torch.randn(8, 16))
        served += 1
        time.sleep(0.005)
    print(json.dumps({"served": served}), flush=True)

threading.Thread(target=serve).start()
"""  # the main thread returns at once


def test_forwards_after_the_main_thread_returned_are_traced_until_the_last_thread_ends(otlp_http_receiver) -> None:
    """A server whose main thread returns while its (non-daemon) request threads go on serving: every forward they
    run is traced and delivered at exit, not run untraced from the moment the main thread returned."""
    result, _ = _run_script(
        SERVING_AFTER_MAIN_SCRIPT,
        {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_http_receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.strip().splitlines()[-1])["served"]
    assert served > 20
    assert len(otlp_http_receiver.wait_for_spans(served * CALLS, timeout=5)) == served * CALLS


@pytest.mark.parametrize("dead", ["refused", "blackhole"])
def test_exit_with_a_dead_endpoint_is_bounded_and_says_so_once(dead: str) -> None:
    with Blackhole() as blackhole:
        endpoint = blackhole.endpoint if dead == "blackhole" else f"http://127.0.0.1:{free_port()}"
        result, elapsed = _run_script(
            EXIT_SCRIPT.format(exporter="otlp", forwards=50),
            {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": str(TIMEOUT_S)},
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "forwards done" in result.stdout
    assert result.stderr.count("OTLP export failed") == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 15  # interpreter start + torch import + at most ~2 x the 1 s timeout at exit


SDK_EXIT_SCRIPT = """
import torch, torchtrace
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
provider = TracerProvider()  # created after torchtrace's import: its atexit shutdown runs before torchtrace's
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
handle = torchtrace.instrument(model, limits=torchtrace.Limits(export_interval_ms=600_000))  # auto -> sdk
for _ in range(5):
    model(torch.randn(8, 16))
"""


def test_sdk_exporter_spans_pending_at_exit_reach_the_endpoint(otlp_http_receiver) -> None:
    result, _ = _run_script(SDK_EXIT_SCRIPT, {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_http_receiver.endpoint})
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(otlp_http_receiver.wait_for_spans(5 * CALLS, timeout=5)) == 5 * CALLS
