"""torchtrace's metrics, dashboards and deploy files against a real Prometheus (Debian's 2.42 and its promtool).

One instrumented run (a one-rank job under rank_detail="auto") is scraped by a real Prometheus (1 s interval,
exemplar storage on); the tests then ask that Prometheus. Missing binaries: fail on CI (CI=true), skip elsewhere
(tests/prometheus_server.py).
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from jobs import one_rank_job
from metric_names import STATS_TO_METRICS
from prometheus_client import CollectorRegistry
from prometheus_server import PrometheusServer, promtool, require_binary
from torch import nn

import torchtrace
from torchtrace._sinks.metrics import MetricsSink
from torchtrace._sinks.metrics_server import serve_metrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana/dashboards/torchtrace-layers.json"
MODEL = "TinyNet"
DRIFTED = "linear_1"  # the layer scaled during the scraped run: the first drifted layer
# dashboard variables: "All" for the regex ones, a concrete model; Grafana's own intervals as fixed windows
VARIABLES = {"$model": MODEL, "$rank": ".*", "$module_type": ".*", "$module": ".*",
             "$__rate_interval": "1m", "$__range": "5m"}  # fmt: skip


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory: pytest.TempPathFactory):
    """An instrumented model run while a real Prometheus scrapes its metrics, against a baseline, a NaN starting in
    one step, DRIFTED made to drift at its end; the handle is removed (and the job ended) on return."""
    directory = tmp_path_factory.mktemp("prometheus")
    require_binary("prometheus")
    registry = CollectorRegistry()
    sink = MetricsSink(registry, model=MODEL)
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(linear_1=nn.Linear(4, 8), relu=nn.ReLU(), linear_2=nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x: torch.Tensor) -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()  # closes the traced step: forward, backward and optimizer spans reach the sinks
        optimizer.zero_grad()

    # a baseline of the untrained model, for the drift gauges; a short window and a low threshold let 100 baseline
    # forwards and a few drifted ones cross it (the default's highest score with a window of 8 is under 1)
    made = torchtrace.instrument(model, exporter="none", records=torchtrace.Records(max_records=50_000))
    with torch.no_grad():
        for _ in range(100):
            model(torch.randn(3, 4))
    drift = torchtrace.Drift(baseline=made.baseline(), window=8, threshold=3.0)
    made.remove()
    started = time.time()
    server = serve_metrics(0, registry=registry)
    with server, PrometheusServer([f"127.0.0.1:{server.port}"], directory) as prom:
        trace_file = directory / "traces.jsonl"
        with one_rank_job("test-metrics-prometheus"), torchtrace.instrument(
            model, exporter="file", trace_file=str(trace_file), metrics=sink, backward=True, optimizer=optimizer,
            baseline=drift, training=torchtrace.Training(rank_detail="auto"),
        ) as handle:  # fmt: skip
            deadline = time.monotonic() + 30
            # keep the model busy until Prometheus holds a few samples, so rates and increases are not empty
            while not prom.query("count_over_time(torchtrace_spans_recorded_total[1m]) >= 3"):
                assert time.monotonic() < deadline, "prometheus never scraped 3 samples"
                train_step(torch.randn(3, 4))
                handle.flush()
                time.sleep(0.05)
            # a step where a NaN starts, once Prometheus holds its zeros: for the NaN panels and the rank detail one
            # (reason "nonfinite"); its update skipped, as torch.amp's GradScaler skips one, so the weights stay finite
            model(torch.full((3, 4), float("nan"))).pow(2).mean().backward()
            optimizer.zero_grad()
            handle.step()
            with torch.no_grad():  # DRIFTED's outputs, exactly 3x: its std and abs-max leave the baseline's range
                getattr(model, DRIFTED).weight.mul_(3)
                getattr(model, DRIFTED).bias.mul_(3)
            for _ in range(40):
                train_step(torch.randn(3, 4))
                handle.flush()
                first = handle.drift().first
                if first is not None and first.module == DRIFTED:
                    break
            assert first is not None and first.module == DRIFTED, handle.drift()
            records = handle.records
        # the final state reaches Prometheus in the next scrape
        prom.wait_for("torchtrace_spans_recorded_total", lambda r: r and float(r[0]["value"][1]) == len(records))
        yield prom, records, started, first


def _values(result: list[dict]) -> dict[str, float]:
    return {sample["metric"].get("module", ""): float(sample["value"][1]) for sample in result}


def _panel_query(prom: PrometheusServer, title: str, ref: str = "A") -> list[dict]:
    """The result of a dashboard panel's query, its variables filled as in VARIABLES."""
    panels = {panel["title"]: panel for panel in json.loads(DASHBOARD.read_text())["panels"]}
    (expr,) = [target["expr"] for target in panels[title]["targets"] if target["refId"] == ref]
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return prom.query(expr)


def test_every_dashboard_query_returns_data(scraped_run):
    prom, *_ = scraped_run
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [
        (p["title"], t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p.get("targets", [])
    ]
    # the variables' own queries: label_values(selector, label) -> count by (label) (selector)
    for variable in dashboard["templating"]["list"]:
        selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
        expressions.append((f"variable {variable['name']}", f"count by ({label}) ({selector})", ""))
    empty, unlabelled = [], []
    for title, expr, legend in expressions:
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, expr
        result = prom.query(expr)
        if not result:
            empty.append(f"{title}: {expr}")
        # Grafana fills {{label}} from each series' labels: every one named must be on the series
        wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        if "{{{" in legend or any(not wanted <= set(series["metric"]) for series in result):
            unlabelled.append(f"{title}: {legend!r}")
    assert not empty, "queries with no data:\n" + "\n".join(empty)
    assert not unlabelled, "legends naming labels the series do not have:\n" + "\n".join(unlabelled)


def test_the_dashboard_names_the_first_drifted_layer(scraped_run):
    prom, _, _, first = scraped_run
    (since,) = _panel_query(prom, "First drifted layer")
    assert {k: since["metric"][k] for k in ("model", "module", "statistic")} == {
        "model": MODEL, "module": DRIFTED, "statistic": first.statistic}  # fmt: skip
    assert float(since["value"][1]) == pytest.approx(first.since * 1000, abs=1)  # ms: Grafana's dateTimeAsIso unit
    (score,) = _panel_query(prom, "First drifted layer", "B")
    assert score["metric"]["module"] == DRIFTED and float(score["value"][1]) >= 1
    rows = _values(_panel_query(prom, "Drift by layer (highest statistic)"))
    assert set(rows) == {DRIFTED, "relu", "linear_2", MODEL}  # one row per layer, the model itself included
    assert rows[DRIFTED] >= 1
    assert float(_panel_query(prom, "Layers over the threshold")[0]["value"][1]) >= 1


def test_the_dashboard_names_the_rank_a_nan_started_on(scraped_run):
    prom, *_ = scraped_run
    (row,) = _panel_query(prom, "Ranks detailed, by reason (selected range)")  # not reason="rank": every step
    assert {k: row["metric"][k] for k in ("rank", "reason")} == {"rank": "0", "reason": "nonfinite"}
    assert float(row["value"][1]) >= 1


def test_prometheus_values_equal_the_span_statistics(scraped_run):
    prom, records, *_ = scraped_run
    for path in ("linear_1", "relu", "linear_2"):
        latest = [r for r in records if r.path == path and r.kind == "forward"][-1].attributes
        for stat, metric in STATS_TO_METRICS.items():
            assert _values(prom.query(f'{metric}{{module="{path}"}}'))[path] == latest[f"torchtrace.output.{stat}"]
        calls = [r for r in records if r.path == path and r.kind == "forward"]
        assert _values(prom.query(f'torchtrace_module_calls_total{{module="{path}"}}'))[path] == len(calls)
        nan = sum(r.attributes["torchtrace.output.nan_count"] for r in calls)
        assert nan > 0
        assert _values(prom.query(f'torchtrace_output_nan_values_total{{module="{path}"}}'))[path] == nan
    linear_calls = [r for r in records if r.type_name == "Linear" and r.kind == "forward"]
    count = prom.query('torchtrace_module_call_duration_seconds_count{module_type="Linear"}')
    assert float(count[0]["value"][1]) == len(linear_calls)
    exported = prom.query('torchtrace_spans_exported_total{exporter="file"}')
    assert float(exported[0]["value"][1]) == len(records)
    dropped = prom.query("sum(torchtrace_spans_dropped_total)")
    assert float(dropped[0]["value"][1]) == 0


def test_exemplars_reach_prometheus_and_point_at_recorded_spans(scraped_run):
    prom, records, started, _ = scraped_run
    by_span = {f"{r.span_id:016x}": r for r in records}
    series = prom.query_exemplars(f'torchtrace_module_call_duration_seconds_bucket{{model="{MODEL}"}}',
                                  started - 60, time.time() + 60)  # fmt: skip
    exemplars = [e for s in series for e in s["exemplars"]]
    assert exemplars
    for exemplar in exemplars:
        record = by_span[exemplar["labels"]["span_id"]]
        assert exemplar["labels"]["trace_id"] == f"{record.trace_id:032x}"
        assert float(exemplar["value"]) == pytest.approx(record.duration_ns / 1e9)


def test_promtool_accepts_the_deploy_config_and_rules():
    directory = ROOT / "deploy/prometheus"
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"),
                 ("test", "rules", "alerts_test.yml")):  # fmt: skip
        result = promtool(*args, cwd=directory)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
