"""`torchtrace report`: the HTML page of a real traced run, loaded in a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from nan_models import nan_model

import torchtrace
from torchtrace import cli

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

_ERRORS_HOOK = "<script>window.__errors=[];addEventListener('error',e=>__errors.push(String(e.message)));</script>"
_PROBE = """<script>{
const ink = c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let any = 0, red = 0;
  for (let i = 0; i < d.length; i += 4) {  // one readback per canvas
    if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) any++;
    if (d[i] > 200 && d[i + 1] < 40 && d[i + 2] < 40) red++;
  } return [any, red]; };
const [heatInk, heatRed] = ink(document.getElementById('heat'));
const probe = document.createElement('pre'); probe.id = 'probe';
probe.textContent = JSON.stringify({
  errors: window.__errors,
  rows: [...document.querySelectorAll('#summary tbody tr')].map(tr => [...tr.children].map(td => td.textContent)),
  timeline_rects: document.querySelectorAll('#timeline rect').length,
  heat_ink: heatInk, heat_red: heatRed,
  line_ink: [...document.querySelectorAll('#lines canvas')].map(c => ink(c)[0]).reduce((a, b) => a + b, 0),
  producers: [...document.querySelectorAll('#provenance-table a')].map(a => [a.textContent, a.getAttribute('href')]),
  span_ids: [...document.querySelectorAll('#timeline rect')].map(r => r.id),
});
document.body.append(probe);
}</script>"""


def _load(page: Path, tmp_path: Path) -> tuple[dict, str]:
    """The page's probe results and Chromium's log, the page loaded from disk with the network off."""
    if _CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/dev test installs it with apt-get when run as root)")
    probed = tmp_path / "probed.html"
    text = page.read_text(encoding="utf-8")
    probed.write_text(text.replace("<head>", "<head>" + _ERRORS_HOOK, 1).replace("</body>", _PROBE + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    flags += ["--proxy-server=127.0.0.1:9", "--virtual-time-budget=3000"]  # no network; let the scripts finish
    shot = subprocess.run(
        [_CHROMIUM, *flags, "--window-size=1200,1900", f"--screenshot={tmp_path / 'report.png'}", probed.as_uri()],
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
    with torchtrace.instrument(
        model, exporter="file", trace_file=str(directory / "traces.jsonl"), print_summary=False
    ) as handle:
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
    from torchtrace import _report

    directory, _, _ = run
    monkeypatch.setattr(_report, "MAX_COLUMNS", 4)
    _report.write_report([directory / "traces.jsonl"], tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S).group(1))
    assert (data["stride"], data["traces_read"]) == (4, 12)
    assert [column["label"] for column in data["columns"]] == ["#0", "#4", "#8"]
    assert "Down-sampled: every " in text
