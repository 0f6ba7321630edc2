"""Smoke test of benchmarks/overhead.py: it runs, and its last line is the JSON report. Numbers are not asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "overhead.py"
BASE_VARIANTS = {
    "none",
    "empty_hooks",
    "naive_otel",
    "naive_otel_stats",
    "torch_profiler",
    "torchtrace_spans",
    "torchtrace_stats",
}
OTLP_VARIANTS = {"torchtrace_spans_otlp", "torchtrace_stats_otlp"}


def test_overhead_quick_prints_a_json_report_last() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHTRACE_"))}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--models", "cheap"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert set(report) == {"cheap"}
    variants = report["cheap"]["variants"]
    expected = BASE_VARIANTS | OTLP_VARIANTS
    assert set(variants) == expected, result.stdout
    for name, values in variants.items():
        assert set(values) == {"us_per_call", "x_floor", "x_none"}, name
        for key in ("us_per_call", "x_none"):
            assert isinstance(values[key], (int, float)) and math.isfinite(values[key]), (name, key, values)
        # x_floor is null only when noise made empty hooks measure no slower than no hooks (the script says so)
        assert values["x_floor"] is None or math.isfinite(values["x_floor"]), (name, values)
    assert variants["none"]["x_none"] == 1.0
    assert report["cheap"]["calls_per_forward"] == 129
    assert "cheap: 129 module calls per forward" in result.stdout
    assert "torch.get_num_threads()" in result.stdout


def test_gpu_benchmark_reports_json_last_and_skips_cleanly_without_cuda() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHTRACE_"))}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])["gpu"]
    if not torch.cuda.is_available():
        assert report == {"skipped": "no CUDA device"}
        return
    assert [(config["batch"], config["seq"]) for config in report["configs"]] == [(16, 512), (1, 128)]
    for config in report["configs"]:
        assert set(config["x_none"]) == {"none", "none_fastpath", "torchtrace", "torchtrace_torch_ops"}
    assert set(report["timing"]["modules"]) == {
        "layers.0.linear1",
        "layers.0.self_attn",
        "layers.0.norm1",
        "layers.5",
        "layers.11.linear2",
    }
    assert report["host_syncs"]["added"] == 0
