"""`torchtrace report`: the HTML page of a real traced run, loaded in a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkout import checkout_env
from nan_models import nan_model

import torchtrace
from torchtrace import cli

ROOT = Path(__file__).resolve().parent.parent

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

_ERRORS_HOOK = "<script>window.__errors=[];addEventListener('error',e=>__errors.push(String(e.message)));</script>"
_PROBE = """<script>{
const ink = c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let any = 0, red = 0;
  const orange = {};  // the drift outline's pixels (#f70) per 12-pixel heatmap row
  for (let i = 0; i < d.length; i += 4) {  // one readback per canvas
    if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) any++;
    if (d[i] > 200 && d[i + 1] < 40 && d[i + 2] < 40) red++;
    if (d[i] > 230 && d[i + 1] > 90 && d[i + 1] < 150 && d[i + 2] < 40) {
      const row = Math.floor(i / 4 / c.width / 12); orange[row] = (orange[row] || 0) + 1;
    }
  } return [any, red, orange]; };
const [heatInk, heatRed, heatOrange] = ink(document.getElementById('heat'));
const shown = e => !!e && e.getClientRects().length > 0 && getComputedStyle(e).visibility !== 'hidden';
const probe = document.createElement('pre'); probe.id = 'probe';
probe.textContent = JSON.stringify({
  errors: window.__errors,
  rows: [...document.querySelectorAll('#summary tbody tr')].map(tr => [...tr.children].map(td => td.textContent)),
  timeline_rects: document.querySelectorAll('#timeline rect').length,
  heat_ink: heatInk, heat_red: heatRed, heat_drift_rows: heatOrange,
  drifted: [...document.querySelectorAll('#summary tbody tr.drifted')].map(tr => ({
    cells: [...tr.children].map(td => td.textContent), visible: shown(tr), badge: shown(tr.querySelector('.badge')),
    background: getComputedStyle(tr.firstChild).backgroundColor})),
  summary_head: [...document.querySelectorAll('#summary th')].map(th => th.textContent),
  drift_legend: shown(document.getElementById('drift-legend')),
  line_ink: [...document.querySelectorAll('#lines canvas')].map(c => ink(c)[0]).reduce((a, b) => a + b, 0),
  producers: [...document.querySelectorAll('#provenance-table a')].map(a => [a.textContent, a.getAttribute('href')]),
  span_ids: [...document.querySelectorAll('#timeline rect')].map(r => r.id),
  overview: [...document.querySelectorAll('#overview dt')].map(t => [t.textContent, t.nextElementSibling.textContent]),
  lanes: [...document.querySelectorAll('#timeline svg.lanes')].map(svg => ({
    heads: [...svg.querySelectorAll('text.rank-head')].map(t => [t.dataset.rank, t.textContent]),
    bars: [...svg.querySelectorAll('rect.lane')].map(r =>
      [r.dataset.rank, r.dataset.lane, Number(r.dataset.ms), r.getBoundingClientRect().width]),
  })),
});
document.body.append(probe);
}</script>"""


def _load(page: Path, tmp_path: Path, only: str = "") -> tuple[dict, str]:
    """The page's probe results and Chromium's log, the page loaded from disk with the network off; its screenshot
    in ``tmp_path / "report.png"`` (of the title and the element ``only`` when given)."""
    if _CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/dev test installs it with apt-get when run as root)")
    probed = tmp_path / "probed.html"
    text = page.read_text(encoding="utf-8")
    hook = _ERRORS_HOOK + (f"<style>body > :not(h1, {only}) {{ display: none }}</style>" if only else "")
    probed.write_text(text.replace("<head>", "<head>" + hook, 1).replace("</body>", _PROBE + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    flags += ["--proxy-server=127.0.0.1:9", "--virtual-time-budget=3000"]  # no network; let the scripts finish
    screenshot = [f"--screenshot={tmp_path / 'report.png'}", probed.as_uri()]
    shot = subprocess.run(
        [_CHROMIUM, *flags, "--window-size=1200,1900", *screenshot],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (tmp_path / "report.png").stat().st_size > 10_000, shot.stderr[-2000:]  # the artifact
    dom = subprocess.run(
        [_CHROMIUM, *flags, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120
    )
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert match, dom.stderr[-2000:]
    probe = json.loads(match.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    return probe, shot.stderr + dom.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real traced run: 12 forwards of a model whose layer "1" injects a NaN in forward 5 only."""
    directory = tmp_path_factory.mktemp("run")
    model = nan_model()
    with torchtrace.instrument(model, exporter="file", trace_file=str(directory / "traces.jsonl")) as handle:
        for index in range(12):
            model[1].armed = index == 5
            model(torch.randn(3, 4))
        page = handle.report(directory / "report.html")
        rows = handle.summary_rows()
    return directory, page, rows


def test_the_report_in_a_browser(run, tmp_path):
    directory, page, rows = run
    probe, log = _load(page, tmp_path)
    assert probe["errors"] == []
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert console == []
    shown = {row[0]: row for row in probe["rows"]}
    assert shown.keys() == {row.path or row.type_name for row in rows}
    for row in rows:
        name, type_name, calls, total, mean, p95, share = shown[row.path or row.type_name]
        assert (type_name, int(calls)) == (row.type_name, row.calls)
        assert (total, mean, p95) == (f"{row.total_ms:.3f}", f"{row.mean_ms:.4f}", f"{row.p95_ms:.4f}")
        assert share == f"{row.share * 100:.1f}%"
    assert probe["timeline_rects"] >= 2 * 5  # the slowest, typical and NaN traces, 5 spans each
    assert probe["heat_ink"] > 0 and probe["heat_red"] > 0  # drawn, with the NaN cell marked
    assert probe["line_ink"] > 0
    (producer,) = probe["producers"]  # one forward had a NaN: its first producer is layer "1", linked to its span
    assert producer[0] == "1"
    assert producer[1].removeprefix("#") in probe["span_ids"]
    shutil.copy(tmp_path / "report.png", directory / "report.png")


def test_the_page_is_self_contained(run):
    _, page, _ = run
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # no script, style or image fetched
    assert "uPlot" in text and len(text) < 200_000


def test_report_command_and_its_bad_input(run, tmp_path, capsys):
    directory, _, _ = run
    assert cli.main(["report", str(directory / "traces.jsonl"), "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").stat().st_size > 50_000
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["report", str(empty), "-o", str(tmp_path / "e.html")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("torchtrace report: error: no torchtrace spans in") and "Traceback" not in err
    assert not (tmp_path / "e.html").exists()


def test_handle_report_needs_the_file_exporter():
    model = torch.nn.Linear(2, 2)
    with torchtrace.instrument(model, exporter="none") as handle, pytest.raises(ValueError, match="file exporter"):
        handle.report("r.html")


def test_past_max_columns_every_other_forward_is_dropped_and_the_page_says_so(run, tmp_path, monkeypatch):
    from torchtrace._offline import report as _report

    directory, _, _ = run
    monkeypatch.setattr(_report, "MAX_COLUMNS", 4)
    _report.write_report([directory / "traces.jsonl"], tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S).group(1))
    assert (data["stride"], data["traces_read"]) == (4, 12)
    assert [column["label"] for column in data["columns"]] == ["#0", "#4", "#8"]
    assert "Down-sampled: every " in text


def _data(page: Path) -> dict:
    text = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S).group(1))


_PER_RANK_FILE = """import os, runpy, sys
os.environ["TORCHTRACE_TRACE_FILE"] = os.path.join(sys.argv.pop(1), "rank" + os.environ["RANK"] + ".jsonl")
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """A real 2-rank DDP job (torchrun, gloo, CPU): 3 steps, rank 1 made slow (80 ms before each backward), each
    rank writing its own trace file; and the report of both files."""
    from test_distributed import finish, free_port

    directory = tmp_path_factory.mktemp("training")
    wrapper = directory / "per_rank_file.py"
    wrapper.write_text(_PER_RANK_FILE)
    env = checkout_env(TORCHTRACE_RUN_ID="report-test", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
               str(wrapper), str(directory), str(ROOT / "examples" / "ddp_train.py"),
               "--steps=3", "--delay-rank=1", "--delay-ms=80"]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = finish(process)
    files = [directory / "rank0.jsonl", directory / "rank1.jsonl"]
    assert all(file.stat().st_size > 0 for file in files), output[-3000:]
    page = directory / "report.html"
    assert cli.main(["report", *map(str, files), "-o", str(page)]) == 0
    return files, page


def test_a_training_step_is_drawn_as_lanes_per_rank_on_one_time_axis(training, tmp_path):
    _, page = training
    probe, _ = _load(page, tmp_path, "#timeline")
    assert probe["errors"] == []
    data = _data(page)
    assert data["overview"]["ranks"] == [0, 1] and data["overview"]["steps"] == 3
    assert probe["lanes"] and len(probe["lanes"]) == len(data["timeline"])
    for drawn, trace in zip(probe["lanes"], data["timeline"]):
        assert [rank for rank, _ in drawn["heads"]] == ["0", "1"]  # a group of lanes per rank
        for rank in ("0", "1"):
            bars = [bar for bar in drawn["bars"] if bar[0] == rank]
            assert {lane for _, lane, _, _ in bars} == {"step", "data wait", "forward", "backward", "optimizer",
                                                        "all-reduce"}  # fmt: skip
            assert all(width >= 1 for *_, width in bars)  # drawn, not zero-width
        (step,) = [bar for bar in drawn["bars"] if bar[:2] == ["0", "step"]]
        assert step[3] > 500  # the step spans the time axis
        # the slow rank waits least in all-reduce, and the page names it; past the first step (the processes' and
        # DDP's warm-up) its step spends 80 ms more outside all-reduce
        fast, slow = trace["ranks"]
        assert (fast["rank"], slow["rank"]) == (0, 1)
        assert slow["comm_ms"] < fast["comm_ms"]
        assert trace["step"] == 0 or slow["busy_ms"] > fast["busy_ms"] + 40
        assert "waits least" in drawn["heads"][1][1] and "waits least" not in drawn["heads"][0][1]
    assert any(trace["step"] != 0 for trace in data["timeline"])
    inference = {trace["trace"] for trace in data["timeline"] if not trace["ranks"]}
    assert not inference  # every chosen trace of a training run is a step
    shutil.copy(tmp_path / "report.png", page.with_name("training-timeline.png"))
    shutil.copy(tmp_path / "report.png", tmp_path / "training-timeline.png")


def test_every_ranks_spans_of_a_chosen_step_are_read_from_every_file(training, tmp_path, monkeypatch):
    from torchtrace._offline import report as _report

    files, _ = training
    monkeypatch.setattr(_report, "_OPEN_TRACES", 1)  # rank 0's steps are long finished when rank 1's file is read
    _report.write_report(files, tmp_path / "r.html")
    timeline = _data(tmp_path / "r.html")["timeline"]
    assert timeline
    for trace in timeline:
        assert [rank["rank"] for rank in trace["ranks"]] == [0, 1]
        lanes = {(span["rank"], span["lane"]) for span in trace["spans"]}
        assert {(rank, "all-reduce") for rank in (0, 1)} <= lanes


def test_the_live_handles_dropped_and_failed_counts_are_in_the_overview(tmp_path):
    model = nan_model()  # layer "1" puts a NaN in its output while armed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace_file = tmp_path / "traces.jsonl"
    with torchtrace.instrument(
        model,
        exporter="file",
        trace_file=str(trace_file),
        backward=True,
        optimizer=optimizer,
        limits=torchtrace.Limits(max_pending_calls=12, export_interval_ms=60_000),
    ) as handle:
        for step in range(3):  # a forward is 5 calls, its backward 5: step 1's two forwards never fit in 12
            model[1].armed = step == 0
            sum(model(torch.randn(5, 4)).sum() for _ in range(2 if step == 1 else 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        page = handle.report(tmp_path / "live.html")
        dropped, failed = handle.dropped_calls, handle.failed_spans
    assert dropped > 0
    probe, _ = _load(page, tmp_path)
    overview = dict(probe["overview"])
    assert overview["calls dropped (buffer full), this handle"] == str(dropped)
    assert overview["spans that failed to export, this handle"] == str(failed)
    assert probe["lanes"]
    for drawn in probe["lanes"]:  # one process: one group of lanes, no all-reduce
        (head,) = [head for _, head in drawn["heads"]]
        assert head.startswith("this process: step ") and "all-reduce" not in head
        assert {lane for _, lane, _, _ in drawn["bars"]} == {"step", "data wait", "forward", "backward", "optimizer"}
    # step 0's NaN: its first producer, linked to its span in the step's nested view (the NaN gradients of step 0
    # leave NaN weights, so later steps' NaN come from layer "0")
    producer = probe["producers"][0]
    assert producer[0] == "1" and producer[1].removeprefix("#") in probe["span_ids"]

    assert cli.main(["report", str(trace_file), "-o", str(tmp_path / "files.html")]) == 0
    probe, _ = _load(tmp_path / "files.html", tmp_path)
    overview = dict(probe["overview"])
    assert overview["dropped / failed"].startswith("not recorded in trace files")
    assert not any("this handle" in key for key in overview)
