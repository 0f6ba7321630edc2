"""Smoke test of benchmarks/longrun.py (the 1M-call run is manual): it runs and its last line is the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_longrun_smoke_reports_rss_and_loses_nothing() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHTRACE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "longrun.py"), "--calls", "2000", "--sample-every", "20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["calls"] == 2000
    assert report["exported_spans"] == 2000 and report["dropped_calls"] == 0 and report["failed_spans"] == 0
    assert report["rss_samples"] == 11
    assert isinstance(report["rss_growth_mib_after_warmup"], float)
    assert report["trace_file_mib"] > 0
