"""MetricsSink, serve_metrics and the committed dashboards / deploy files, without a Prometheus server.

(tests/test_metrics_prometheus.py runs the same metrics through a real Prometheus.)
"""

from __future__ import annotations

import importlib.util
import math
import socket
import threading
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml
from metric_names import STATS_TO_METRICS
from prometheus_client import REGISTRY, CollectorRegistry
from torch import nn

import torchtrace
from torchtrace._sinks.metrics import OVERFLOW_MODULE, MetricsSink
from torchtrace._sinks.metrics_server import metrics_from_env, serve_metrics
from torchtrace.attributes import RANK_DETAIL

ROOT = Path(__file__).resolve().parent.parent


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(linear_1=nn.Linear(4, 8), relu=nn.ReLU(), linear_2=nn.Linear(8, 2))).eval()


def labels(module: str, module_type: str, model: str = "Tiny") -> dict[str, str]:
    return {"model": model, "rank": "0", "module": module, "module_type": module_type}


def tiny_baseline() -> torchtrace.Baseline:
    """A baseline of ``tiny_model()``: with it, a handle's metrics sink exposes the drift gauges too."""
    model = tiny_model()
    with torchtrace.instrument(model, exporter="none", records=torchtrace.Records(max_records=1_000)) as handle:
        for _ in range(25):
            model(torch.randn(3, 4))
        return handle.baseline()


def run(model: nn.Module, sink: MetricsSink, batches: int = 3, **options) -> list[torchtrace.ModuleCall]:
    with torchtrace.instrument(model, exporter="none", sinks=[sink], **options) as handle:
        for _ in range(batches):
            model(torch.randn(3, 4))
        handle.flush()
        return handle.records


def test_a_fresh_registry_sees_the_metrics_and_the_global_one_does_not():
    registry = CollectorRegistry()
    sink = MetricsSink(registry, model="Tiny")
    run(tiny_model(), sink, batches=2)
    assert registry.get_sample_value("torchtrace_module_calls_total", labels("linear_1", "Linear")) == 2
    assert registry.get_sample_value("torchtrace_spans_recorded_total", {"model": "Tiny", "rank": "0"}) == 8
    assert REGISTRY.get_sample_value("torchtrace_module_calls_total", labels("linear_1", "Linear")) is None
    assert all(not name.startswith("torchtrace_") for name in REGISTRY._names_to_collectors)


def test_output_gauges_equal_the_span_statistics_of_the_latest_call():
    registry = CollectorRegistry()
    sink = MetricsSink(registry, model="Tiny")
    model = tiny_model()
    with torchtrace.instrument(model, exporter="none", sinks=[sink]) as handle:
        for _ in range(3):
            x = torch.randn(3, 4)
            model(x)
        handle.flush()
        records = handle.records
    for path, module_type in [("linear_1", "Linear"), ("relu", "ReLU"), ("linear_2", "Linear")]:
        latest = [r for r in records if r.path == path][-1].attributes
        for stat, metric in STATS_TO_METRICS.items():
            assert registry.get_sample_value(metric, labels(path, module_type)) == latest[f"torchtrace.output.{stat}"]
    relu_output = model[:2](x)  # and what torch says of the last ReLU output
    gauge = registry.get_sample_value("torchtrace_output_zero_ratio", labels("relu", "ReLU"))
    assert gauge == pytest.approx((relu_output == 0).double().mean().item())
    assert registry.get_sample_value("torchtrace_output_abs_max", labels("relu", "ReLU")) == pytest.approx(
        relu_output.abs().max().item()
    )


def test_the_model_itself_is_labelled_with_its_class_name():
    registry = CollectorRegistry()
    run(tiny_model(), MetricsSink(registry), batches=1)
    assert registry.get_sample_value("torchtrace_module_calls_total", labels("Sequential", "Sequential", "Sequential"))


def test_call_counters_histogram_and_nan_counts_add_up_to_the_records():
    registry = CollectorRegistry()
    sink = MetricsSink(registry, model="Tiny")
    model = tiny_model()
    with torchtrace.instrument(model, exporter="none", sinks=[sink]) as handle:
        model(torch.full((2, 4), float("nan")))
        model(torch.tensor([[1.0, float("inf"), 0.0, 0.0]]))
        model(torch.randn(5, 4))
        records = handle.records
    linear_1 = [r for r in records if r.path == "linear_1"]
    key = labels("linear_1", "Linear")
    assert (
        registry.get_sample_value("torchtrace_output_nan_values_total", key)
        == sum(r.attributes["torchtrace.output.nan_count"] for r in linear_1)
        == 2 * 8
    )  # every output of the NaN batch
    assert (
        registry.get_sample_value("torchtrace_output_inf_values_total", key)
        == sum(r.attributes["torchtrace.output.inf_count"] for r in linear_1)
        == 8
    )  # an inf input element reaches every output
    assert registry.get_sample_value("torchtrace_module_call_seconds_total", key) == pytest.approx(
        sum(r.duration_ns for r in linear_1) / 1e9
    )
    type_labels = {"model": "Tiny", "rank": "0", "module_type": "Linear"}
    linears = [r for r in records if r.type_name == "Linear"]
    assert registry.get_sample_value("torchtrace_module_call_duration_seconds_count", type_labels) == len(linears)
    assert registry.get_sample_value("torchtrace_module_call_duration_seconds_sum", type_labels) == pytest.approx(
        sum(r.duration_ns for r in linears) / 1e9
    )
    for bound in sink.bucket_bounds:
        expected = sum(1 for r in linears if r.duration_ns / 1e9 <= bound)
        le = {**type_labels, "le": _go_float(bound)}
        assert registry.get_sample_value("torchtrace_module_call_duration_seconds_bucket", le) == expected


def _go_float(value: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(value)


def test_nan_counters_cover_every_output_tensor_and_gauges_follow_the_first():
    class TwoOutputs(nn.Module):
        def forward(self, x):
            return x * 2, torch.full_like(x, float("nan"))

    model = nn.Sequential(OrderedDict(pair=TwoOutputs()))
    registry = CollectorRegistry()
    with torchtrace.instrument(model, exporter="none", sinks=[MetricsSink(registry, model="Tiny")]) as handle:
        model(torch.ones(2, 3))
        attributes = handle["pair"][-1].attributes
    key = labels("pair", "TwoOutputs")
    assert registry.get_sample_value("torchtrace_output_mean", key) == attributes["torchtrace.output.0.mean"] == 2.0
    assert registry.get_sample_value("torchtrace_output_nan_values_total", key) == 6


def test_modules_past_the_limit_collapse_into_the_overflow_label():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)], nn.ReLU()).eval()
    registry = CollectorRegistry()
    sink = MetricsSink(registry, model="Deep", max_module_labels=3)
    records = run(model, sink, batches=2)
    samples = [s for family in registry.collect() for s in family.samples if s.name == "torchtrace_module_calls_total"]
    modules = {s.labels["module"] for s in samples}
    # call order is parents first: the model, then "0", "1"; everything later is __other__
    assert modules == {"Sequential", "0", "1", OVERFLOW_MODULE}
    overflow_linear = {"model": "Deep", "rank": "0", "module": OVERFLOW_MODULE, "module_type": "Linear"}
    assert registry.get_sample_value("torchtrace_module_calls_total", overflow_linear) == 2 * 4
    overflow_relu = {**overflow_linear, "module_type": "ReLU"}
    assert registry.get_sample_value("torchtrace_module_calls_total", overflow_relu) == 2
    assert registry.get_sample_value("torchtrace_metrics_overflowed_modules", {"model": "Deep", "rank": "0"}) == 5
    assert registry.get_sample_value("torchtrace_output_mean", overflow_linear) is None  # no mixed "latest" value
    assert sum(s.value for s in samples) == len(records)


def test_series_stay_bounded_however_many_module_classes_a_model_has():
    """Paths are bounded by max_module_labels, and so are types: 300 distinct classes with a limit of 10 make at
    most 2 * 10 + 1 series of each per-module family and 10 + 1 duration histograms, every call still counted."""
    classes = [type(f"Generated{index}", (nn.Module,), {"forward": lambda self, x: x + 1}) for index in range(300)]
    model = nn.Sequential(*[cls() for cls in classes])
    registry = CollectorRegistry()
    records = run(model, MetricsSink(registry, model="Many", max_module_labels=10), batches=1)
    families = {family.name: family for family in registry.collect()}
    calls = [s for s in families["torchtrace_module_calls"].samples if s.name == "torchtrace_module_calls_total"]
    assert len(calls) == 2 * 10 + 1
    assert sum(s.value for s in calls) == len(records) == 301
    assert {s.labels["module_type"] for s in calls if s.labels["module"] == OVERFLOW_MODULE} >= {OVERFLOW_MODULE}
    histogram_types = {s.labels["module_type"] for s in families["torchtrace_module_call_duration_seconds"].samples}
    assert len(histogram_types) == 10 + 1 and OVERFLOW_MODULE in histogram_types


def test_the_duration_histogram_is_labelled_by_type_never_by_path():
    registry = CollectorRegistry()
    run(tiny_model(), MetricsSink(registry, model="Tiny"))
    family = next(f for f in registry.collect() if f.name == "torchtrace_module_call_duration_seconds")
    assert {frozenset(s.labels) - {"le"} for s in family.samples} == {frozenset({"model", "rank", "module_type"})}


def test_exemplars_carry_the_trace_and_span_of_a_recorded_call():
    registry = CollectorRegistry()
    records = run(tiny_model(), MetricsSink(registry, model="Tiny"))
    by_span = {f"{r.span_id:016x}": r for r in records}
    family = next(f for f in registry.collect() if f.name == "torchtrace_module_call_duration_seconds")
    exemplars = [s.exemplar for s in family.samples if s.exemplar is not None]
    assert exemplars
    for exemplar in exemplars:
        record = by_span[exemplar.labels["span_id"]]
        assert exemplar.labels["trace_id"] == f"{record.trace_id:032x}"
        assert exemplar.value == record.duration_ns / 1e9


def test_spans_the_providers_sampler_drops_get_no_exemplar():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    model = tiny_model()
    with torchtrace.instrument(model, tracer_provider=provider, metrics=MetricsSink(registry, model="Tiny")) as handle:
        model(torch.randn(3, 4))
        handle.flush()
    family = next(f for f in registry.collect() if f.name == "torchtrace_module_call_duration_seconds")
    assert sum(s.value for s in family.samples if s.name.endswith("_count")) == 4  # observed all the same
    assert exporter.get_finished_spans() == ()  # sampled out: no trace to link to
    assert [s.exemplar for s in family.samples if s.exemplar is not None] == []


def test_watch_reports_buffer_drops_and_exported_spans(tmp_path: Path):
    registry = CollectorRegistry()
    sink = MetricsSink(registry)
    model = tiny_model()
    options = {
        "limits": torchtrace.Limits(max_pending_calls=4, export_interval_ms=3_600_000),
        "trace_file": str(tmp_path / "t.jsonl"),
    }
    with torchtrace.instrument(model, exporter="file", sinks=[sink], **options) as handle:
        sink.watch(handle)
        model(torch.randn(1, 4))
        model(torch.randn(1, 4))  # the buffer holds one forward (4 calls): this one is dropped, whole
        handle.flush()
        dropped = handle.dropped_calls
        recorded = len(handle.records)
    base = {"model": "Sequential", "rank": "0"}  # named by watch() after the handle's model
    assert dropped == 4
    assert registry.get_sample_value("torchtrace_spans_dropped_total", {**base, "reason": "buffer_full"}) == 4
    assert registry.get_sample_value("torchtrace_spans_dropped_total", {**base, "reason": "export_failed"}) == 0
    assert registry.get_sample_value("torchtrace_spans_exported_total", {**base, "exporter": "file"}) == recorded == 4
    assert registry.get_sample_value("torchtrace_spans_recorded_total", base) == 4


def test_a_raising_sink_is_counted_on_the_handle_and_as_a_metric(caplog):
    registry = CollectorRegistry()
    sink = MetricsSink(registry)
    model = tiny_model()

    def broken_sink(calls):
        raise RuntimeError("my sink is broken")

    with torchtrace.instrument(model, exporter="none", metrics=sink, sinks=[broken_sink]) as handle:
        model(torch.randn(1, 4))
        handle.flush()
        model(torch.randn(1, 4))
        handle.flush()
        assert handle.sink_errors == 2
        assert len(handle.records) == 8  # the other sinks still got every call
    base = {"model": "Sequential", "rank": "0"}
    assert registry.get_sample_value("torchtrace_sink_errors_total", base) == 2
    assert registry.get_sample_value("torchtrace_spans_recorded_total", base) == 8
    assert "my sink is broken" in caplog.text


def test_a_second_sink_on_the_same_registry_is_refused():
    registry = CollectorRegistry()
    MetricsSink(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        MetricsSink(registry)


def test_invalid_options_raise():
    with pytest.raises(ValueError):
        MetricsSink(None, max_module_labels=-1)
    with pytest.raises(ValueError):
        MetricsSink(None, buckets=[0.0, 1.0])


def _get(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


def test_serve_metrics_negotiates_openmetrics_with_exemplars_and_binds_loopback():
    registry = CollectorRegistry()
    records = run(tiny_model(), MetricsSink(registry, model="Tiny"))
    with serve_metrics(0, registry=registry) as server:
        assert server.server.server_address[0] == "127.0.0.1"
        content_type, body = _get(server.url, "application/openmetrics-text; version=1.0.0")
        assert content_type.startswith("application/openmetrics-text")
        exemplar_lines = [line for line in body.splitlines() if " # {" in line]
        assert exemplar_lines and all("_bucket{" in line for line in exemplar_lines)
        assert any(f'trace_id="{records[-1].trace_id:032x}"' in line for line in exemplar_lines)
        assert body.rstrip().endswith("# EOF")
        content_type, plain = _get(server.url)
        assert content_type.startswith("text/plain")
        assert " # {" not in plain and "torchtrace_module_calls_total{" in plain
    with pytest.raises(OSError):
        _get(server.url)  # shut down


def test_metrics_true_serves_every_instrumented_model_from_the_global_registry():
    first, second = tiny_model(), nn.Sequential(nn.Linear(4, 4))
    with serve_metrics(port=0) as server:
        with torchtrace.instrument(first, exporter="none", metrics=True) as handle:
            first(torch.randn(2, 4))
            handle.flush()
            with torchtrace.instrument(second, exporter="none", metrics=True) as other:  # a second model
                second(torch.randn(2, 4))
                other.flush()
                body = _get(server.url)[1]
                assert 'torchtrace_module_calls_total{model="Sequential",module="linear_1"' in body
                assert 'torchtrace_module_calls_total{model="Sequential#2",module="0"' in body  # same class
        with torchtrace.instrument(first, exporter="none", metrics=True) as handle:  # the same model again
            first(torch.randn(2, 4))
            first(torch.randn(2, 4))
            handle.flush()
            body = _get(server.url)[1]
    calls = [line for line in body.splitlines() if line.startswith('torchtrace_module_calls_total{model="Sequential",')]
    assert calls and all(line.endswith(" 2.0") for line in calls)  # counted anew, not added to the removed handle's
    assert 'model="Sequential#3"' not in body  # the removed handle's sink made way, its name is free again
    assert 'torchtrace_module_calls_total{model="Sequential#2",module="0"' in body  # a removed model's last values


@pytest.mark.parametrize("endpoint_first", [True, False], ids=["serve-then-instrument", "instrument-then-serve"])
def test_serving_metrics_beside_a_model_traced_without_them_says_so_once(endpoint_first, monkeypatch, caplog):
    from torchtrace._sinks import metrics_server as _serve

    monkeypatch.setattr(_serve, "_pairing_warned", False)

    class Unmetered(nn.Sequential):
        pass

    model, other = Unmetered(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4))
    advice = "pass metrics=True"
    server = serve_metrics(port=0) if endpoint_first else None
    assert advice not in caplog.text  # an endpoint alone is the application's own business
    with torchtrace.instrument(model, exporter="none") as handle:
        if server is None:
            assert advice not in caplog.text
            server = serve_metrics(port=0)
        with server:
            model(torch.randn(2, 4))
            handle.flush()
            body = _get(server.url)[1]
            assert 'model="Unmetered"' not in body  # what the warning is about: nothing of the model
            assert caplog.text.count(advice) == 1
            with torchtrace.instrument(other, exporter="none"):  # once per process, not per model
                pass
            assert caplog.text.count(advice) == 1


def test_the_natural_pairing_with_metrics_true_warns_nothing(monkeypatch, caplog):
    from torchtrace._sinks import metrics_server as _serve

    monkeypatch.setattr(_serve, "_pairing_warned", False)
    model, other = tiny_model(), nn.Sequential(nn.Linear(4, 4))
    with serve_metrics(port=0) as server:
        with torchtrace.instrument(model, exporter="none", metrics=True) as handle:
            model(torch.randn(2, 4))
            handle.flush()
            assert 'torchtrace_module_calls_total{model="Sequential",module="linear_1"' in _get(server.url)[1]
        with torchtrace.instrument(other, exporter="none", metrics=False):  # told: no metrics for this one
            pass
    removed = torchtrace.instrument(other, exporter="none")
    removed.remove()
    with serve_metrics(port=0):  # a removed handle traces nothing: nothing to say
        pass
    assert "metrics=True" not in caplog.text


def test_a_taken_metrics_port_is_a_warning_not_a_failed_job(monkeypatch, caplog):
    import socket

    from torchtrace import _handle

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("TORCHTRACE_METRICS_PORT", str(taken.getsockname()[1]))  # another job holds it
        monkeypatch.setattr(_handle, "_metrics_server", None)
        model = tiny_model()
        with torchtrace.instrument(model, exporter="none") as handle:  # metrics on, because of the port variable
            model(torch.randn(3, 4))
            assert len(handle.records) == 4
    assert "cannot serve metrics" in caplog.text


def test_idle_connections_take_no_thread_and_do_not_hold_up_a_scrape(monkeypatch: pytest.MonkeyPatch):
    """200 connections that send nothing: no thread each (a bounded pool answers requests), a scrape is answered
    at once, idle connections are closed after the idle timeout, and past the waiting limit the longest waiting."""
    from torchtrace._sinks import metrics_server as _serve

    monkeypatch.setattr(_serve, "IDLE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(_serve, "MAX_WAITING", 150)
    registry = CollectorRegistry()
    MetricsSink(registry, model="Idle")
    with serve_metrics(0, registry=registry) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
        try:
            started = time.monotonic()
            body = urllib.request.urlopen(server.url, timeout=5).read().decode()
            assert "torchtrace_comm_wait_seconds_total" in body and time.monotonic() - started < 1.0
            assert sum(thread.name.startswith("torchtrace-metrics") for thread in threading.enumerate()) <= 2 + 4
            for connection in idle:
                connection.settimeout(5)
            closed = sum(connection.recv(1) == b"" for connection in idle)  # each is closed: by the limit or timeout
            assert closed == 200
        finally:
            for connection in idle:
                connection.close()


def test_metrics_from_env(monkeypatch: pytest.MonkeyPatch):
    assert metrics_from_env() is None
    monkeypatch.setenv("TORCHTRACE_METRICS_PORT", "0")
    registry = CollectorRegistry()
    with metrics_from_env(registry) as server:
        assert server.addr == "127.0.0.1" and server.port > 0
        assert _get(server.url)[0].startswith("text/plain")
        assert metrics_from_env(registry) is server  # the app's call and instrument()'s share one endpoint
    monkeypatch.setenv("TORCHTRACE_METRICS_PORT", "http")
    with pytest.raises(ValueError, match="TORCHTRACE_METRICS_PORT"):
        metrics_from_env(registry)
    with pytest.raises(ValueError):
        serve_metrics(70000, registry=registry)


# --- dashboards and deploy files --------------------------------------------------------------------------------


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboards", ROOT / "grafana" / "build_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_grafana_files_equal_the_generator_output():
    builder = _load_builder()
    for relative, content in builder.generated_files().items():
        committed = (ROOT / "grafana" / relative).read_text(encoding="utf-8")
        assert committed == content, f"grafana/{relative} is stale: run python grafana/build_dashboards.py"


def test_dashboard_queries_use_only_exported_metrics_and_known_variables():
    builder = _load_builder()
    registry = CollectorRegistry()
    model = tiny_model()
    sink = MetricsSink(registry, model="Tiny")
    with torchtrace.instrument(model, exporter="none", metrics=sink, backward=True, baseline=tiny_baseline()) as handle:
        model(torch.randn(3, 4)).sum().backward()  # a traced training step: step and gradient metrics too
        handle.step()
        handle.flush()
    exported = {sample.name for family in registry.collect() for sample in family.samples}
    exported |= {"torchtrace_spans_exported_total"}  # present with an OTLP/file exporter (see watch())
    exported |= {"torchtrace_rank_detail_steps_total"}  # in a job under rank_detail="auto" (test_metrics_prometheus)
    # gauges with no sample yet: the first drifted layer's (while no layer is over the threshold)
    exported |= {family.name for family in sink.describe() if family.type == "gauge"}
    dashboard = builder.layers_dashboard()
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables >= {"model", "module", "rank"}
    queries = list(builder.panel_queries(dashboard))
    assert len(queries) >= 15
    for title, expr in queries:
        metrics = {word for word in _words(expr) if word.startswith("torchtrace_")}
        assert metrics and metrics <= exported, (title, metrics - exported)
        used = {word.split("$", 1)[1] for word in expr.replace('"', " ").split() if word.startswith("$")}
        assert {v for v in used if not v.startswith("__")} <= variables, title
    panel_types = {p["type"] for p in dashboard["panels"]}
    assert {"heatmap", "bargauge", "timeseries", "stat"} <= panel_types
    assert any(t.get("exemplar") for p in dashboard["panels"] for t in p.get("targets", []))


def _words(expr: str) -> list[str]:
    import re

    return re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)


def test_datasources_link_exemplar_trace_ids_to_jaeger():
    datasources = yaml.safe_load((ROOT / "grafana/provisioning/datasources/datasources.yaml").read_text())
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    assert by_uid["jaeger"]["type"] == "jaeger"
    link = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]
    assert link == {"name": "trace_id", "datasourceUid": "jaeger"}


def test_deploy_files_parse_and_fit_together():
    for path in list((ROOT / "deploy").rglob("*.y*ml")) + list((ROOT / "grafana").rglob("*.yaml")):
        assert yaml.safe_load(path.read_text()) is not None, path
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    assert {"app", "otel-collector", "jaeger", "prometheus", "grafana"} <= set(compose["services"])
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]
    assert compose["services"]["app"]["environment"]["TORCHTRACE_METRICS_PORT"] == "9464"
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert "app:9464" in prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    for config in ("deploy/otel-collector/config.yaml", "deploy/k8s/otel-collector-config.yaml"):
        collector = yaml.safe_load((ROOT / config).read_text())
        pipeline = collector["service"]["pipelines"]["traces"]
        assert set(pipeline["receivers"]) <= set(collector["receivers"])
        assert set(pipeline["processors"]) <= set(collector["processors"]) and "batch" in pipeline["processors"]
        assert set(pipeline["exporters"]) <= set(collector["exporters"])
        assert set(collector["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    kustomization = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (ROOT / "deploy/k8s" / resource).exists()
    kinds = {yaml.safe_load((ROOT / "deploy/k8s" / r).read_text())["kind"] for r in kustomization["resources"]}
    assert {"DaemonSet", "PodMonitor", "PrometheusRule"} <= kinds
    rule = yaml.safe_load((ROOT / "deploy/k8s/prometheusrule.yaml").read_text())
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]  # the Operator's copy of the promtool-tested rules


# tail_sampling's policy types and the loadbalancing exporter's routing keys, as the collector-contrib READMEs
# document them (the collector cannot be installed here to run its own `validate`)
TAIL_SAMPLING_POLICIES = {
    "always_sample", "latency", "numeric_attribute", "probabilistic", "status_code", "string_attribute",
    "rate_limiting", "span_count", "boolean_attribute", "ottl_condition", "trace_state", "and", "composite",
}  # fmt: skip
ROUTING_KEYS = {"traceID", "service", "resource", "metric", "streamID", "attributes"}


def test_the_large_job_collector_routes_each_step_to_one_sampler_that_keeps_errors_and_slow_steps():
    """deploy/otel-collector/large-jobs.yaml: every pipeline's parts defined; the agent tier routes by trace id (a
    training step is one trace across all ranks, so one sampler sees it whole); the sampler keeps status ERROR
    (exceptions, the span where a NaN started), steps with a straggler, slow traces and a share of the rest; its
    decision waits longer than torchtrace's export interval."""
    collector = yaml.safe_load((ROOT / "deploy/otel-collector/large-jobs.yaml").read_text())
    pipelines = collector["service"]["pipelines"]
    assert set(pipelines) == {"traces/agent", "traces/sampler"}
    for pipeline in pipelines.values():
        assert set(pipeline["receivers"]) <= set(collector["receivers"])
        assert set(pipeline["processors"]) <= set(collector["processors"])
        assert set(pipeline["exporters"]) <= set(collector["exporters"])
        assert pipeline["processors"][0] == "memory_limiter" and pipeline["processors"][-1] == "batch"
    agent, sampler = pipelines["traces/agent"], pipelines["traces/sampler"]
    assert agent["exporters"] == ["loadbalancing"] and "tail_sampling" not in agent["processors"]
    balancing = collector["exporters"]["loadbalancing"]
    assert balancing["routing_key"] == "traceID" and balancing["routing_key"] in ROUTING_KEYS
    assert set(balancing["resolver"]) == {"dns"} and "otlp" in balancing["protocol"]
    assert "tail_sampling" in sampler["processors"] and "loadbalancing" not in sampler["exporters"]
    sampling = collector["processors"]["tail_sampling"]
    policies = {policy["type"]: policy for policy in sampling["policies"]}
    assert set(policies) <= TAIL_SAMPLING_POLICIES and all(p["type"] in p for p in sampling["policies"])
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert policies["latency"]["latency"]["threshold_ms"] > 0
    straggler = policies["string_attribute"]["string_attribute"]
    assert straggler["key"] == RANK_DETAIL and straggler["enabled_regex_matching"] is True
    assert straggler["values"] == ["straggler"]
    assert 0 < policies["probabilistic"]["probabilistic"]["sampling_percentage"] < 100
    wait_s = int(sampling["decision_wait"].removesuffix("s"))
    interval_ms = torchtrace.Limits().resolved().export_interval_ms
    assert wait_s * 1000 > 10 * interval_ms  # a step's spans from every rank are in by then


def test_gauges_are_nan_when_the_latest_output_is_nan():
    registry = CollectorRegistry()
    model = tiny_model()
    with torchtrace.instrument(model, exporter="none", sinks=[MetricsSink(registry, model="Tiny")]):
        model(torch.full((1, 4), float("nan")))
    assert math.isnan(registry.get_sample_value("torchtrace_output_mean", labels("linear_1", "Linear")))


@pytest.mark.parametrize("given_as", ["metrics", "sinks"])
def test_a_sink_serving_a_live_model_is_refused_for_a_second_one_and_free_again_after(given_as):
    registry = CollectorRegistry()
    sink = MetricsSink(registry, model="Tiny")
    first, second = tiny_model(), nn.Sequential(nn.Tanh())
    option = {"metrics": sink} if given_as == "metrics" else {"sinks": [sink]}
    with torchtrace.instrument(first, exporter="none", **option) as handle:
        first(torch.randn(2, 4))
        with pytest.raises(ValueError, match="already aggregates the calls of a live instrumented Sequential"):
            torchtrace.instrument(second, exporter="none", **option)
        second(torch.randn(2, 4))  # not traced: the refusal left no hook behind
        handle.flush()
    assert registry.get_sample_value("torchtrace_module_calls_total", labels("relu", "ReLU")) == 1
    assert registry.get_sample_value("torchtrace_module_calls_total", labels("0", "Tanh")) is None
    with torchtrace.instrument(second, exporter="none", **option) as other:  # the first handle is removed
        second(torch.randn(2, 4))
        other.flush()
    assert registry.get_sample_value("torchtrace_module_calls_total", labels("0", "Tanh")) == 1


def documented_metric_names() -> set[str]:
    """The metric names in docs/metrics.md's table (`_std` after `torchtrace_output_mean`: torchtrace_output_std)."""
    section = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8").split("\n## Metrics\n", 1)[1]
    table = section.split("| metric | type |", 1)[1].split("\n\n", 1)[0]
    names: set[str] = set()
    for row in table.splitlines()[2:]:
        full = ""
        for name in row.split("|")[1].replace("`", "").split(","):
            name = name.strip()
            full = full.rsplit("_", 1)[0] + name if name.startswith("_") else name
            names.add(full)
    return names


def test_the_docs_metrics_table_lists_exactly_what_the_collector_exposes():
    sink = MetricsSink(registry=None, model="Tiny")
    with torchtrace.instrument(tiny_model(), exporter="none", sinks=[sink], baseline=tiny_baseline()):
        families = sink.describe()  # with a baseline: the drift gauges too
    exposed = {f"{family.name}_total" if family.type == "counter" else family.name for family in families}
    assert {"torchtrace_layer_drift", "torchtrace_layer_drift_first_timestamp_seconds"} <= exposed
    assert documented_metric_names() == exposed


def test_a_rank_without_detail_keeps_model_level_series_whatever_steps_it_explained():
    """Under rank_detail="auto" instrument() sets a non-detail rank's sink to "model": the module calls of a step it
    explained (a straggler's) reach it, yet it keeps only its model-level series and its model root's row, and
    counts the step by reason, with the step's trace as exemplar (OpenMetrics). A detail rank keeps every module."""
    from prometheus_client.openmetrics.exposition import generate_latest

    from torchtrace._core.calls import ModuleCall
    from torchtrace.attributes import RANK, STEP

    def step_calls(detail: str) -> list[ModuleCall]:
        step = ModuleCall("", "rank 3", 0, 0xABC, 0x12, 0x1, 0, 2_000_000, {STEP: 1, RANK: 3, RANK_DETAIL: detail},
                          kind="step")  # fmt: skip
        root = ModuleCall("", "Net", 0, 0xABC, 0x13, 0x12, 0, 1_000_000)
        layer = ModuleCall("layer", "Linear", 1, 0xABC, 0x14, 0x13, 10, 900_000)
        backward = ModuleCall("layer", "Linear", 1, 0xABC, 0x15, 0x12, 1_000_000, 1_500_000, kind="backward")
        return [step, root, layer, backward]

    def scrape(role: str | None) -> str:
        registry = CollectorRegistry()
        sink = MetricsSink(registry=registry, model="Net", rank=3)
        sink.rank_detail = role
        sink(step_calls("straggler"))
        sink(step_calls("none"))
        return generate_latest(registry).decode()

    others = scrape("model")
    assert 'module="layer"' not in others and 'module_type="Linear"' not in others
    assert 'torchtrace_module_calls_total{model="Net",module="Net",module_type="Net",rank="3"} 2.0' in others
    assert "torchtrace_module_call_duration_seconds_bucket" not in others  # the step histogram is the rank's
    assert 'torchtrace_step_duration_seconds_count{model="Net",rank="3"} 2' in others
    straggler = next(line for line in others.splitlines() if 'reason="straggler"' in line)
    assert straggler.startswith('torchtrace_rank_detail_steps_total{model="Net",rank="3",reason="straggler"} 1.0 # ')
    assert f'trace_id="{0xABC:032x}"' in straggler
    assert 'torchtrace_rank_detail_steps_total{model="Net",rank="3",reason="nonfinite"} 0.0' in others
    detailed = scrape("detail")
    assert 'torchtrace_module_calls_total{model="Net",module="layer",module_type="Linear",rank="3"} 2.0' in detailed
    assert "torchtrace_rank_detail_steps_total" in detailed
    unchanged = scrape(None)  # rank_detail="all", or no job
    assert 'module="layer"' in unchanged and "torchtrace_rank_detail_steps" not in unchanged
