"""Dashboards as code: writes torchtrace's Grafana dashboard and provisioning files as plain JSON / YAML.

    python grafana/build_dashboards.py          # (re)write the files next to this script
    python grafana/build_dashboards.py --check  # exit 1 if a committed file differs from what this script makes

The generated files are committed; a test checks they equal this script's output, and a test against a real
Prometheus runs every panel's PromQL (``panel_queries()``). Only metrics that torchtrace exports appear; the step
time, gradient norm, all-reduce wait and NaN/Inf provenance panels fill once steps are traced (``backward=True``), the
ranks detailed panel in a job under ``Training(rank_detail="auto")``, the drift row once a model is traced against a
baseline (``baseline=``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
# Grafana's Explore URL (10+: "panes", one pane per key; the old "left=" form is gone), on the Jaeger datasource
_JAEGER_PANE = {"datasource": "jaeger", "queries": [{"refId": "A", "datasource": {"type": "jaeger", "uid": "jaeger"}}]}
JAEGER_EXPLORE_URL = "/explore?schemaVersion=1&panes=" + quote(
    json.dumps({"traces": {**_JAEGER_PANE, "range": {"from": "now-1h", "to": "now"}}}, separators=(",", ":"))
)
PROMETHEUS_UID = "prometheus"
JAEGER_UID = "jaeger"
DASHBOARD_UID = "torchtrace-layers"

# every query filters on the dashboard variables; regex matchers so "All" (.*) works
SELECTOR = 'model=~"$model", rank=~"$rank"'
MODULE_SELECTOR = f'{SELECTOR}, module=~"$module"'
TYPE_SELECTOR = f'{SELECTOR}, module_type=~"$module_type"'
RATE = "$__rate_interval"


def _target(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False, exemplar: bool = False,
            fmt: str = "time_series") -> dict[str, Any]:  # fmt: skip
    return {
        "datasource": {"type": "prometheus", "uid": PROMETHEUS_UID},
        "editorMode": "code",
        "exemplar": exemplar,
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "refId": ref,
    }


def _panel(kind: str, title: str, description: str, targets: list[dict[str, Any]], grid: tuple[int, int, int, int],
           unit: str = "short", **options: Any) -> dict[str, Any]:  # fmt: skip
    x, y, w, h = grid
    panel: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": PROMETHEUS_UID},
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": targets,
    }
    panel.update(options)
    return panel


def _row(title: str, y: int) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "panels": []}  # fmt: skip


def _variable(name: str, label: str, query: str, *, multi: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": PROMETHEUS_UID},
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time range change: new modules appear without a reload
        "includeAll": True,
        "allValue": ".*",
        "multi": multi,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def layers_dashboard() -> dict[str, Any]:
    duration = "torchtrace_module_call_duration_seconds_bucket"
    panels = [
        _row("Latency", 0),
        _panel(
            "heatmap",
            "Module call duration (heatmap, by module type)",
            "Distribution of module call durations for the selected module types. Exemplars link a bucket to "
            "the trace of a call that fell in it.",
            [
                _target(
                    f"sum by (le) (rate({duration}{{{TYPE_SELECTOR}}}[{RATE}]))", "{{le}}", exemplar=True, fmt="heatmap"
                )
            ],
            (0, 1, 12, 9),
            unit="s",
            options={
                "calculate": False,
                "yAxis": {"unit": "s"},
                "cellGap": 1,
                "color": {"scheme": "Oranges"},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "tooltip": {"show": True, "yHistogram": True},
            },
        ),
        _panel(
            "timeseries",
            "p50 / p99 call duration by module type (exemplars → Jaeger)",
            "Quantiles from the duration histogram. Each exemplar dot is one traced call: click it and open its "
            "trace in Jaeger.",
            [
                _target(
                    f"histogram_quantile(0.99, sum by (le, module_type) (rate({duration}{{{TYPE_SELECTOR}}}[{RATE}])))",
                    "p99 {{module_type}}",
                    exemplar=True,
                ),
                _target(
                    f"histogram_quantile(0.5, sum by (le, module_type) (rate({duration}{{{TYPE_SELECTOR}}}[{RATE}])))",
                    "p50 {{module_type}}",
                    ref="B",
                ),
            ],
            (12, 1, 12, 9),
            unit="s",
        ),
        _panel(
            "bargauge",
            "Top 10 modules by mean time per call",
            "Time in a module's calls (children included) divided by its calls, over the selected range.",
            [
                _target(
                    f"topk(10, sum by (module) (increase(torchtrace_module_call_seconds_total{{{MODULE_SELECTOR}}}"
                    f"[$__range])) / sum by (module) (increase(torchtrace_module_calls_total{{{MODULE_SELECTOR}}}"
                    "[$__range])))",
                    "{{module}}",
                    instant=True,
                )
            ],
            (0, 10, 12, 9),
            unit="s",
            options={
                "displayMode": "gradient",
                "orientation": "horizontal",
                "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            },
        ),
        _panel(
            "timeseries",
            "Top 10 modules by share of wall time",
            "Seconds spent in each module per second of wall time; nested modules overlap their children.",
            [
                _target(
                    f"topk(10, sum by (module) (rate(torchtrace_module_call_seconds_total{{{MODULE_SELECTOR}}}"
                    f"[{RATE}])))",
                    "{{module}}",
                )
            ],
            (12, 10, 12, 9),
            unit="percentunit",
        ),
        _panel(
            "timeseries",
            "Calls per second by module",
            'Module calls per second (module="__other__": modules past the metrics\' max_module_labels).',
            [
                _target(
                    f"sum by (module) (rate(torchtrace_module_calls_total{{{MODULE_SELECTOR}}}[{RATE}]))", "{{module}}"
                )
            ],
            (0, 19, 12, 8),
            unit="reqps",
        ),
        _panel(
            "timeseries",
            "Module calls that raised",
            "Calls that ended with an exception, per module.",
            [
                _target(
                    f"sum by (module) (increase(torchtrace_module_call_errors_total{{{MODULE_SELECTOR}}}[{RATE}]))",
                    "{{module}}",
                )
            ],
            (12, 19, 12, 8),
        ),
        _row("Activations (latest value per module)", 27),
    ]
    for index, (metric, title, unit) in enumerate([
        ("torchtrace_output_mean", "Output mean", "short"),
        ("torchtrace_output_std", "Output std", "short"),
        ("torchtrace_output_abs_max", "Output abs max", "short"),
        ("torchtrace_output_zero_ratio", "Output zero fraction", "percentunit"),
    ]):  # fmt: skip
        panels.append(_panel(
            "timeseries", f"{title} by module",
            f"{title} of each module's main output tensor at its latest call before each scrape.",
            [_target(f"{metric}{{{MODULE_SELECTOR}}}", "{{module}}")],
            ((index % 2) * 12, 28 + (index // 2) * 8, 12, 8), unit=unit,
        ))  # fmt: skip
    panels += [
        _row("Numerical health", 44),
        _panel(
            "stat", "NaN / Inf values in outputs (selected range)",
            "Non-finite elements in module outputs. Anything but 0 is a numerical problem.",
            [
                _target(f"sum(increase(torchtrace_output_nan_values_total{{{MODULE_SELECTOR}}}[$__range]))", "NaN",
                        instant=True),
                _target(f"sum(increase(torchtrace_output_inf_values_total{{{MODULE_SELECTOR}}}[$__range]))", "Inf",
                        ref="B", instant=True),
            ],
            (0, 45, 6, 8),
            fieldConfig={"defaults": {"unit": "short", "thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "red", "value": 1}]}}, "overrides": []},
            options={"colorMode": "background", "reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
        _panel(
            "timeseries", "NaN / Inf values by module",
            "Non-finite output elements per module: the first module to show them is where they appear.",
            [
                _target(f"sum by (module) (increase(torchtrace_output_nan_values_total{{{MODULE_SELECTOR}}}[{RATE}]))",
                        "NaN {{module}}"),
                _target(f"sum by (module) (increase(torchtrace_output_inf_values_total{{{MODULE_SELECTOR}}}[{RATE}]))",
                        "Inf {{module}}", ref="B"),
            ],
            (6, 45, 18, 8),
        ),
        _panel(
            "bargauge", "First producer of NaN/Inf (selected range)",
            "How often each module was the first to produce NaN/Inf in a forward or backward (its span is ERROR).",
            [_target(f"sum by (module) (increase(torchtrace_nonfinite_first_total{{{MODULE_SELECTOR}}}[$__range]))",
                     "{{module}}", instant=True)],
            (0, 53, 24, 6),
            options={"displayMode": "gradient", "orientation": "horizontal",
                     "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        ),
        _row("Drift by layer", 59),
        # status-history, not a heatmap: Grafana's heatmap puts numeric buckets on its y axis, status-history one
        # row per series (here per layer) over time, each cell coloured by the thresholds
        _panel(
            "status-history", "Drift by layer (highest statistic)",
            "Each layer's drift score against the baseline (instrument(baseline=)), the highest of its output "
            "statistics (mean, std, abs max, zero fraction) over its last window of calls. 1 is the alert threshold "
            "(TorchtraceLayerDrift). Empty without a baseline.",
            [_target(f"max by (module) (torchtrace_layer_drift{{{MODULE_SELECTOR}}})", "{{module}}")],
            (0, 60, 14, 10),
            fieldConfig={"defaults": {"unit": "short", "min": 0, "decimals": 2, "color": {"mode": "thresholds"},
                                      "thresholds": {"mode": "absolute", "steps": [
                                          {"color": "green", "value": None}, {"color": "yellow", "value": 0.5},
                                          {"color": "red", "value": 1}]}},
                         "overrides": []},
            options={"showValue": "never", "rowHeight": 0.9, "colWidth": 0.9, "legend": {"showLegend": False},
                     "tooltip": {"mode": "single"}},
        ),
        _panel(
            "table", "First drifted layer",
            "Of the layers over the threshold, the earliest in execution order, the statistic that put it over and "
            "since when: where a change starts (the layers after it often follow). Not filtered by the module "
            "variable. Empty while no layer is over.",
            [
                _target(f"torchtrace_layer_drift_first_timestamp_seconds{{{SELECTOR}}} * 1000", instant=True,
                        fmt="table"),
                _target(f"torchtrace_layer_drift{{{SELECTOR}}} and on (model, rank, module, statistic) "
                        f"torchtrace_layer_drift_first_timestamp_seconds{{{SELECTOR}}}", ref="B", instant=True,
                        fmt="table"),
            ],
            (14, 60, 10, 6),
            fieldConfig={"defaults": {"unit": "short"}, "overrides": [
                {"matcher": {"id": "byName", "options": "Value #A"}, "properties": [
                    {"id": "displayName", "value": "over since"}, {"id": "unit", "value": "dateTimeAsIso"}]},
                {"matcher": {"id": "byName", "options": "Value #B"}, "properties": [
                    {"id": "displayName", "value": "score"}, {"id": "decimals", "value": 2}]},
            ]},
            transformations=[
                {"id": "merge", "options": {}},  # one row per series: A's time and B's score side by side
                {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True}, "indexByName": {
                    "model": 0, "rank": 1, "module": 2, "statistic": 3, "Value #A": 4, "Value #B": 5}}},
            ],
        ),
        _panel(
            "stat", "Layers over the threshold",
            "Layers with a drift score of 1 or more (any statistic): what TorchtraceLayerDrift fires on.",
            [_target(f"count(max by (model, rank, module) (torchtrace_layer_drift{{{MODULE_SELECTOR}}}) >= 1) "
                     "or vector(0)", "layers", instant=True)],  # 0, not "No data", while none is over
            (14, 66, 10, 4),
            fieldConfig={"defaults": {"unit": "short", "thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "red", "value": 1}]}}, "overrides": []},
            options={"colorMode": "background", "reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
        _row("Training", 70),
        _panel(
            "timeseries", "Step time p50 / p99 (exemplars → step trace)",
            "Duration of traced training steps. Each exemplar opens the step's trace: forward, backward, optimizer.",
            [
                _target("histogram_quantile(0.99, sum by (le, rank) (rate(torchtrace_step_duration_seconds_bucket"
                        f"{{{SELECTOR}}}[{RATE}])))", "p99 rank {{rank}}", exemplar=True),
                _target("histogram_quantile(0.5, sum by (le, rank) (rate(torchtrace_step_duration_seconds_bucket"
                        f"{{{SELECTOR}}}[{RATE}])))", "p50 rank {{rank}}", ref="B"),
            ],
            (0, 71, 12, 8), unit="s",
        ),
        _panel(
            "timeseries", "Gradient norm by module",
            "L2 norm of the gradient reaching each module's output, latest traced backward: vanishing or "
            "exploding gradients show here first.",
            [_target(f"torchtrace_gradient_norm{{{MODULE_SELECTOR}}}", "{{module}}")],
            (12, 71, 12, 8),
        ),
        _panel(
            "timeseries", "Step time by rank (p50)",
            "Median traced step time of each rank: a rank above the others is slow in its own compute.",
            [_target("histogram_quantile(0.5, sum by (le, rank) (rate(torchtrace_step_duration_seconds_bucket"
                     f"{{{SELECTOR}}}[{RATE}])))", "rank {{rank}}")],
            (0, 79, 12, 8), unit="s",
        ),
        _panel(
            "stat", "Straggler: rank waiting least in all-reduce",
            "All-reduce completes when the last rank arrives, so the rank that waits least is the one the others "
            "wait for. Shows the rank label of the lowest all-reduce wait rate.",
            [_target(f"bottomk(1, sum by (rank) (rate(torchtrace_comm_wait_seconds_total{{{SELECTOR}}}[{RATE}])))",
                     "rank {{rank}}", instant=True)],
            (12, 79, 6, 8),
            options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "textMode": "name"},
        ),
        _panel(
            "timeseries", "All-reduce wait by rank",
            "Seconds per second each rank spends waiting in DDP gradient all-reduce during traced steps.",
            [_target(f"sum by (rank) (rate(torchtrace_comm_wait_seconds_total{{{SELECTOR}}}[{RATE}]))",
                     "rank {{rank}}")],
            (18, 79, 6, 8), unit="percentunit",
        ),
        _panel(
            "bargauge", "Ranks detailed, by reason (selected range)",
            'Under Training(rank_detail="auto"): the ranks that sent their module spans in the most traced steps of '
            "the selected range, by reason: straggler (the others waited for it at the all-reduce), nonfinite (a "
            "NaN/Inf started on it), raised (its forward raised); not rank (a detail rank, every step). In "
            "Explore, the counter's exemplar of each reason links to the latest such step's trace, where the "
            "rank's module spans are. Empty while no rank was singled out, and under rank_detail=\"all\".",
            [_target("topk(10, sum by (rank, reason) (increase(torchtrace_rank_detail_steps_total"
                     f'{{{SELECTOR}, reason!="rank"}}[$__range])) > 0)', "rank {{rank}}: {{reason}}", instant=True)],
            (0, 87, 12, 8),
            # whole steps: increase() extrapolates to the range's edges
            fieldConfig={"defaults": {"unit": "short", "decimals": 0}, "overrides": []},
            options={"displayMode": "gradient", "orientation": "horizontal",
                     "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        ),
        _panel(
            "timeseries", "Data wait by rank",
            "Share of each rank's time in traced steps before their first forward (from the previous step's end): "
            "the data loader's next batch, above all. A rank above the others waits on its input; its step spans "
            "show a long data wait phase.",
            [_target(f"sum by (rank) (rate(torchtrace_data_wait_seconds_total{{{SELECTOR}}}[{RATE}]))",
                     "rank {{rank}}")],
            (12, 87, 12, 8), unit="percentunit",
        ),
        _row("Exporter health", 95),
        _panel(
            "timeseries", "Spans recorded / exported / dropped per second",
            "Recorded: module calls seen. Exported: delivered by the OTLP/file exporter. Dropped: lost because the "
            "buffer was full (export slower than the model) or the backend failed. Drops are never silent.",
            [
                _target(f"sum(rate(torchtrace_spans_recorded_total{{{SELECTOR}}}[{RATE}]))", "recorded"),
                _target(f"sum by (exporter) (rate(torchtrace_spans_exported_total{{{SELECTOR}}}[{RATE}]))",
                        "exported ({{exporter}})", ref="B"),
                _target(f"sum by (reason) (rate(torchtrace_spans_dropped_total{{{SELECTOR}}}[{RATE}]))",
                        "dropped ({{reason}})", ref="C"),
            ],
            (0, 96, 16, 8), unit="ops",
        ),
        _panel(
            "stat", "Spans dropped (selected range)",
            "Any drop means missing traces: raise max_pending_calls, sample, or fix the backend.",
            [_target(f"sum(increase(torchtrace_spans_dropped_total{{{SELECTOR}}}[$__range]))", "dropped",
                     instant=True)],
            (16, 96, 4, 8),
            fieldConfig={"defaults": {"unit": "short", "thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "red", "value": 1}]}}, "overrides": []},
            options={"colorMode": "background", "reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
        _panel(
            "stat", "Modules past the label limit",
            "Module paths counted under module=\"__other__\" because max_module_labels was reached.",
            [_target(f"max(torchtrace_metrics_overflowed_modules{{{SELECTOR}}})", "overflowed", instant=True)],
            (20, 96, 4, 8),
            options={"reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
    ]  # fmt: skip
    for panel_id, panel in enumerate(panels, start=1):
        panel["id"] = panel_id
    return {
        "uid": DASHBOARD_UID,
        "title": "torchtrace: layers",
        "description": "Per-layer latency, activation statistics, drift from a baseline, numerical and exporter "
        "health from torchtrace.",
        "tags": ["torchtrace", "pytorch"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "links": [
            {
                "title": "Traces in Jaeger",
                "type": "link",
                "url": JAEGER_EXPLORE_URL,
                "targetBlank": True,
            }
        ],  # fmt: skip
        "templating": {
            "list": [
                _variable("model", "Model", "label_values(torchtrace_spans_recorded_total, model)"),
                _variable("rank", "Rank", 'label_values(torchtrace_spans_recorded_total{model=~"$model"}, rank)'),
                _variable(
                    "module_type",
                    "Module type",
                    'label_values(torchtrace_module_calls_total{model=~"$model"}, module_type)',
                ),
                _variable(
                    "module",
                    "Module",
                    'label_values(torchtrace_module_calls_total{model=~"$model", module_type=~"$module_type"}, module)',
                ),
            ]
        },  # fmt: skip
        "annotations": {"list": []},
        "panels": panels,
    }


DATASOURCES = f"""\
# Generated by grafana/build_dashboards.py: edit the script, not this file.
apiVersion: 1
datasources:
  - name: Prometheus
    uid: {PROMETHEUS_UID}
    type: prometheus
    access: proxy
    url: http://prometheus:9090
    isDefault: true
    jsonData:
      # an exemplar's trace_id label opens that trace in Jaeger
      exemplarTraceIdDestinations:
        - name: trace_id
          datasourceUid: {JAEGER_UID}
  - name: Jaeger
    uid: {JAEGER_UID}
    type: jaeger
    access: proxy
    url: http://jaeger:16686
"""

DASHBOARD_PROVIDER = """\
# Generated by grafana/build_dashboards.py: edit the script, not this file.
apiVersion: 1
providers:
  - name: torchtrace
    folder: torchtrace
    type: file
    disableDeletion: false
    allowUiUpdates: false
    options:
      path: /var/lib/grafana/dashboards
"""


def generated_files() -> dict[str, str]:
    """Relative path under grafana/ -> file content, exactly as committed."""
    return {
        "dashboards/torchtrace-layers.json": json.dumps(layers_dashboard(), indent=2, ensure_ascii=False) + "\n",
        "provisioning/datasources/datasources.yaml": DATASOURCES,
        "provisioning/dashboards/dashboards.yaml": DASHBOARD_PROVIDER,
    }


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) of every query in every panel."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files are not up to date")
    args = parser.parse_args(argv)
    stale = []
    for relative, content in generated_files().items():
        path = HERE / relative
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != content:
                stale.append(relative)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    if stale:
        print(f"out of date (run python grafana/build_dashboards.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
