"""`torchtrace report --baseline`: the layers of a real model that drifted from its baseline, marked in the per-layer
table and the heatmap, and the first of them named; the page loaded in a real headless Chromium."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import pytest
import torch
from test_report import _data, _load

import torchtrace
from torchtrace import cli
from torchtrace._core.baseline import DRIFT_STATS, Baseline

CHANGED = 60  # the forward from which layer "2"'s weights are tripled
FORWARDS = 120


def _model(kind: type[torch.nn.Sequential] = torch.nn.Sequential) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return kind(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.LayerNorm(32),
                torch.nn.Linear(32, 8))  # fmt: skip


class Tower(torch.nn.Sequential):
    """Another model (another class) with the same layer paths."""


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory):
    """A baseline of 200 forwards of a small model (handle.baseline(), and its trace file), then a traced run of
    the same model whose layer "2" has its weights tripled from forward ``CHANGED`` on, reported with the baseline
    by the CLI and by ``handle.report``."""
    directory = tmp_path_factory.mktemp("drift")
    model, inputs = _model(), torch.Generator().manual_seed(1)
    with torchtrace.instrument(model, exporter="file", trace_file=str(directory / "good.jsonl"),
                               records=torchtrace.Records(max_records=50_000)) as handle, torch.no_grad():  # fmt: skip
        for _ in range(200):
            model(torch.randn(8, 16, generator=inputs))
        handle.baseline().save(directory / "baseline.json")
    model, inputs = _model(), torch.Generator().manual_seed(2)
    with torchtrace.instrument(model, exporter="file", trace_file=str(directory / "later.jsonl")) as handle:
        with torch.no_grad():
            for index in range(FORWARDS):
                if index == CHANGED:
                    changed_ns = time.time_ns()
                    model[2].weight.mul_(3)
                model(torch.randn(8, 16, generator=inputs))
        handle.report(directory / "live.html", baseline=directory / "baseline.json")
    page = directory / "report.html"
    command = ["report", "--baseline", str(directory / "baseline.json"), str(directory / "later.jsonl")]
    assert cli.main([*command, "-o", str(page)]) == 0
    return directory, page, changed_ns


def test_the_drifted_layer_is_marked_and_named_first(drift_run):
    directory, page, changed_ns = drift_run
    data = _data(page)
    drift = data["drift"]
    assert drift["baseline"]["model"] == "Sequential" and drift["forwards"] == FORWARDS
    layers = drift["layers"]
    assert set(layers) == {"", "0", "1", "2", "3", "4"}
    changed = layers["2"]
    assert changed["over"] is not None and changed["max"] >= 1.0 and changed["latest"] >= 1.0
    assert changed["over"]["statistic"] in DRIFT_STATS
    assert changed["over"]["since_ns"] > changed_ns  # it went over after the change, not before
    assert layers["0"]["over"] is None and layers["1"]["over"] is None  # the layers before it: unchanged
    assert drift["first"]["module"] == "2" and drift["first_now"]["module"] == "2"
    # the heatmap: layer "2"'s cells after the change only; the layers before it never
    row = data["layers"].index("2")
    marked = {index: column["drift"] for index, column in enumerate(data["columns"]) if "drift" in column}
    assert len([index for index, rows in marked.items() if str(row) in rows]) >= 30
    assert min(index for index, rows in marked.items() if str(row) in rows) > CHANGED
    early = {str(data["layers"].index(layer)) for layer in ("0", "1")}
    assert not any(early & rows.keys() for rows in marked.values())
    # handle.report(path, baseline=) marks the same
    assert _data(directory / "live.html")["drift"]["first"]["module"] == "2"


def test_the_marks_in_a_browser(drift_run, tmp_path):
    directory, page, _ = drift_run
    probe, log = _load(page, tmp_path, "#overview, #summary, #heat, #drift-legend")
    assert probe["errors"] == [] and [line for line in log.splitlines() if ":CONSOLE" in line] == []
    assert probe["summary_head"][-1] == "drift"
    (row,) = probe["drifted"]  # layer "2" only
    assert row["cells"][0] == "2drifted" and row["visible"] and row["badge"]
    assert row["background"] != "rgba(0, 0, 0, 0)"  # the row is tinted
    changed = _data(page)["drift"]["layers"]["2"]
    clock = time.strftime("%H:%M:%S", time.gmtime(changed["over"]["since_ns"] // 10**9))
    scores = f"{changed['latest']:.2f} ({changed['max']:.2f})"
    assert row["cells"][-1].startswith(f"{scores}{changed['over']['statistic']} over at {clock}.")
    root = _data(page)["drift"]["layers"][""]  # the model itself, named by its class in the table
    (model_row,) = [cells for cells in probe["rows"] if cells[0] == "Sequential"]
    assert model_row[-1] == f"{root['latest']:.2f} ({root['max']:.2f})"
    overview = dict(probe["overview"])
    assert overview["first drifted layer"].startswith("2 (")
    assert overview["drift"] == f"{FORWARDS} forwards of Sequential scored; 1 layer(s) reached 1.0"
    assert probe["drift_legend"]
    heat_row = str(_data(page)["layers"].index("2"))
    assert probe["heat_drift_rows"].keys() == {heat_row}  # outlined cells: layer "2"'s row only
    shutil.copy(tmp_path / "report.png", directory / "drift.png")


def test_without_a_baseline_nothing_is_marked(drift_run, tmp_path):
    directory, _, _ = drift_run
    assert cli.main(["report", str(directory / "later.jsonl"), "-o", str(tmp_path / "plain.html")]) == 0
    data = _data(tmp_path / "plain.html")
    assert data["drift"] is None and not any("drift" in column for column in data["columns"])


def test_only_the_baseline_models_spans_are_scored(drift_run, tmp_path):
    directory, _, _ = drift_run
    other = Tower(*_model())  # same layer paths, another class; its layer "2" tripled all along
    other[2].weight.data.mul_(3)
    inputs = torch.Generator().manual_seed(3)
    with torchtrace.instrument(other, exporter="file", trace_file=str(tmp_path / "other.jsonl")), torch.no_grad():
        for _ in range(60):
            other(torch.randn(8, 16, generator=inputs))
    good = directory / "good.jsonl"  # the baseline's own run: in distribution
    page = tmp_path / "mixed.html"
    command = ["report", "--baseline", str(directory / "baseline.json"), str(tmp_path / "other.jsonl"), str(good)]
    assert cli.main([*command, "-o", str(page)]) == 0
    drift = _data(page)["drift"]
    assert drift["models_found"] == ["Sequential", "Tower"] and drift["forwards"] == 200
    assert drift["first"] is None and not any(layer["over"] for layer in drift["layers"].values())

    # a baseline of another model: nothing scored, and the page says so
    baseline = Baseline.load(directory / "baseline.json")
    dataclasses.replace(baseline, model="Encoder").save(tmp_path / "encoder.json")
    page = tmp_path / "none.html"
    command = ["report", "--baseline", str(tmp_path / "encoder.json"), str(good), "-o", str(page)]
    assert cli.main(command) == 0
    drift = _data(page)["drift"]
    assert (drift["forwards"], drift["layers"], drift["models_found"]) == (0, {}, ["Sequential"])
    probe, _ = _load(page, tmp_path, "#overview")
    assert dict(probe["overview"])["drift"].startswith("no forward of a Encoder (the baseline's model)")


def test_a_bad_baseline_is_an_error(drift_run, tmp_path, capsys):
    directory, _, _ = drift_run
    traces = str(directory / "later.jsonl")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for baseline, message in [(bad, "is not JSON"), (tmp_path / "missing.json", "cannot read the baseline")]:
        assert cli.main(["report", "--baseline", str(baseline), traces, "-o", str(tmp_path / "r.html")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("torchtrace report: error: ") and message in err and "Traceback" not in err
        assert not (tmp_path / "r.html").exists()
    bad.write_text(json.dumps({"format": "something else"}))
    assert cli.main(["report", "--baseline", str(bad), traces, "-o", str(tmp_path / "r.html")]) == 1
    assert "is not a torchtrace baseline" in capsys.readouterr().err


def test_the_baseline_command_keeps_each_models_forwards_apart(drift_run):
    """The shared ForwardSpans helper: a baseline from the trace file equals the handle's, from its records."""
    directory, _, _ = drift_run
    assert cli.main(["baseline", str(directory / "good.jsonl"), "-o", str(directory / "from-files.json")]) == 0
    from_files, from_records = (Baseline.load(directory / name) for name in ("from-files.json", "baseline.json"))
    assert (from_files.model, from_files.forwards) == (from_records.model, from_records.forwards) == ("Sequential", 200)
    assert from_files.references == from_records.references
