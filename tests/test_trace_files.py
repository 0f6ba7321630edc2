"""Reading trace files back: `torchtrace summary` and `torchtrace perfetto` on files of a real traced run."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import torchtrace
from torchtrace import cli
from torchtrace._offline.reader import TraceReader, summary_from_spans, trace_parts


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.linear(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A trace file of 12 forwards of a nested model, and the handle's summary rows of the same run."""
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    model = _model()
    with torchtrace.instrument(model, exporter="file", trace_file=str(path)) as handle:
        for _ in range(12):
            model(torch.randn(4, 8))
        handle.flush()
        rows = handle.summary_rows()
    return path, rows


def _by_path(rows):
    return {row.path: row for row in rows}


def test_summary_of_the_file_equals_the_handles(traced):
    path, handle_rows = traced
    file_rows = _by_path(summary_from_spans(TraceReader([path], progress=False)).rows())
    assert file_rows.keys() == _by_path(handle_rows).keys()
    for name, row in _by_path(handle_rows).items():
        read = file_rows[name]
        assert (read.type_name, read.calls) == (row.type_name, row.calls)
        for field in ("total_ms", "mean_ms", "p95_ms", "share"):
            assert math.isclose(getattr(read, field), getattr(row, field), rel_tol=1e-9), (name, field)


def test_a_training_runs_summary_and_step_tree_read_back(tmp_path):
    """Steps, the backward phase, module backward spans and optimizer steps: the same summary, the same nesting."""
    path = tmp_path / "traces.jsonl"
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchtrace.instrument(
        model, exporter="file", trace_file=str(path), backward=True, optimizer=optimizer
    ) as handle:
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.flush()
        handle_rows = _by_path(handle.summary_rows())
    file_rows = _by_path(summary_from_spans(TraceReader([path], progress=False)).rows())
    assert {"train_step", "backward", "optimizer.step", "0.linear backward"} <= file_rows.keys()
    assert file_rows.keys() == handle_rows.keys()
    for name, row in handle_rows.items():
        assert file_rows[name].calls == row.calls
        assert math.isclose(file_rows[name].total_ms, row.total_ms, rel_tol=1e-9)
        assert math.isclose(file_rows[name].share, row.share, rel_tol=1e-9)
    threads = _assert_slices_nest_as_spans(path, tmp_path, forwards=4, spans_per_forward=len(file_rows))
    for thread in threads.values():  # the first thread of a step holds its forward, backward and optimizer step
        names = {event["name"] for event in thread}
        if "train_step" in names:
            assert {"Sequential", "0.linear", "backward", "Sequential backward", "optimizer.step"} <= names


def test_summary_command_prints_the_table(traced, capsys):
    path, rows = traced
    assert cli.main(["summary", str(path.parent)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["layer", "type", "calls", "total", "ms", "mean", "ms", "p95", "ms", "share"]
    assert {line.split()[0] for line in out.splitlines()[2:]} == {row.path or row.type_name for row in rows}


def _perfetto(tmp_path, *traces) -> dict:
    output = tmp_path / "trace.json"
    assert cli.main(["perfetto", *map(str, traces), "-o", str(output)]) == 0
    return json.loads(output.read_text())


def test_perfetto_slices_nest_as_the_spans_do_with_the_spans_durations(traced, tmp_path):
    path, _ = traced
    threads = _assert_slices_nest_as_spans(path, tmp_path, forwards=12, spans_per_forward=8)
    assert len(threads) == 12  # forwards nest properly: one thread each


def _ns(microseconds: float) -> int:
    return round(microseconds * 1000)


def _assert_slices_nest_as_spans(path, tmp_path, forwards: int, spans_per_forward: int) -> dict:
    spans = {span.span_id: span for span in TraceReader([path], progress=False)}
    events = _perfetto(tmp_path, path)["traceEvents"]
    slices = [event for event in events if event["ph"] == "X"]
    assert len(slices) == len(spans) == forwards * spans_per_forward
    threads: dict[tuple[int, int], list[dict]] = {}
    for event in slices:
        span = spans[event["args"]["span_id"]]
        assert event["name"] == span.name
        assert event["dur"] * 1000 == pytest.approx(span.end_ns - span.start_ns, abs=1e-3)
        threads.setdefault((event["pid"], event["tid"]), []).append(event)
    thread_of = {event["args"]["span_id"]: (event["pid"], event["tid"]) for event in slices}
    assert len({event["args"]["trace_id"] for event in slices}) == forwards
    for thread in threads.values():
        assert len({event["args"]["trace_id"] for event in thread}) == 1  # a trace's threads are its own
        # the viewer's nesting: each slice's parent is the innermost earlier slice that encloses it; times read back
        # as the viewer does, in whole nanoseconds (a backward span can end at the very nanosecond the next starts)
        open_slices: list[dict] = []
        for event in sorted(thread, key=lambda event: (event["ts"], -event["dur"])):
            while open_slices and _ns(event["ts"]) >= _ns(open_slices[-1]["ts"]) + _ns(open_slices[-1]["dur"]):
                open_slices.pop()
            parent = spans[event["args"]["span_id"]].parent_span_id
            if open_slices:
                assert open_slices[-1]["args"]["span_id"] == parent
            else:  # the root, or a span overlapping a sibling: on another thread than its parent's
                assert parent == "" or thread_of[parent] != thread_of[event["args"]["span_id"]]
            open_slices.append(event)
    return threads


def test_perfetto_keeps_statistics_and_ids_as_args(traced, tmp_path):
    path, _ = traced
    span = next(span for span in TraceReader([path], progress=False) if span.name == "0.linear")
    events = _perfetto(tmp_path, path)["traceEvents"]
    event = next(event for event in events if event.get("args", {}).get("span_id") == span.span_id)
    assert event["args"]["trace_id"] == span.trace_id
    assert event["args"]["torchtrace.output.abs_max"] == span.attributes["torchtrace.output.abs_max"]
    assert event["args"]["torchtrace.output.shape"] == [4, 8]


def _as_rank(source, target, rank: int) -> None:
    """The file as another rank would write it: the resource attributes a distributed job adds."""
    with open(source) as lines, open(target, "w") as out:
        for line in lines:
            request = json.loads(line)
            for resource_spans in request["resourceSpans"]:
                attributes = resource_spans["resource"]["attributes"]
                attributes.append({"key": "torchtrace.rank", "value": {"intValue": str(rank)}})
            out.write(json.dumps(request) + "\n")


def test_perfetto_ranks_are_processes(traced, tmp_path):
    path, _ = traced
    _as_rank(path, tmp_path / "rank0.jsonl", 0)
    _as_rank(path, tmp_path / "rank1.jsonl", 1)
    events = _perfetto(tmp_path, tmp_path / "rank*.jsonl")["traceEvents"]
    names = {event["pid"]: event["args"]["name"] for event in events if event["name"] == "process_name"}
    assert sorted(names.values()) == ["torchtrace rank 0", "torchtrace rank 1"]
    per_process = {pid: sum(1 for e in events if e["ph"] == "X" and e["pid"] == pid) for pid in names}
    assert list(per_process.values()) == [12 * 8, 12 * 8]


def test_rotated_parts_are_read_oldest_first(traced, tmp_path):
    path, _ = traced
    lines = path.read_text().splitlines(keepends=True)
    current = tmp_path / "traces.jsonl"
    parts = [tmp_path / "traces.jsonl.2", tmp_path / "traces.jsonl.1", current]
    for number, part in enumerate(parts):
        part.write_text("".join(lines[number::3]))
        os.utime(part, (1_000_000 + number, 1_000_000 + number))
    (tmp_path / "other.log").write_text("not a trace\n")
    assert trace_parts([current]) == parts
    assert trace_parts([tmp_path]) == parts
    for part in parts:
        os.utime(part, (1_000_000, 1_000_000))
    assert trace_parts([current]) == parts  # equal times: by rotation number, the current file last
    assert sum(1 for _ in TraceReader([current], progress=False)) == 12 * 8


def test_the_sinks_own_rotation_is_read_whole(tmp_path):
    """Size rotation by the file sink (traces.jsonl.1 newest): naming the current file reads every part."""
    path = tmp_path / "traces.jsonl"
    model = _model()
    with torchtrace.instrument(
        model,
        exporter="file",
        trace_file=torchtrace.TraceFile(path=str(path), max_mb=0.004, backups=20),
    ) as handle:
        for _ in range(12):
            model(torch.randn(4, 8))
            handle.flush()
        rows = _by_path(handle.summary_rows())
    parts = trace_parts([path])
    assert len(parts) > 2 and parts[-1] == path
    file_rows = _by_path(summary_from_spans(TraceReader([path], progress=False)).rows())
    assert {name: row.calls for name, row in file_rows.items()} == {name: row.calls for name, row in rows.items()}
    starts = [span.start_ns for span in TraceReader([path], progress=False) if span.name == "Sequential"]
    assert starts == sorted(starts) and len(starts) == 12  # oldest part first


def test_a_truncated_last_line_is_skipped_counted_and_reported(traced, tmp_path, capsys):
    path, _ = traced
    text = path.read_text()
    truncated = tmp_path / "traces.jsonl"
    truncated.write_text(text + text.splitlines()[0][:100])  # a killed process's half-written line
    reader = TraceReader([truncated], progress=False)
    assert sum(1 for _ in reader) == 12 * 8
    assert reader.bad_lines == 1 and reader.where_bad == [f"{truncated}:{len(text.splitlines()) + 1}"]
    assert cli.main(["perfetto", str(truncated), "-o", str(tmp_path / "t.json")]) == 0
    assert "1 unreadable line(s) skipped" in capsys.readouterr().err


_OTHER_PRODUCER = {
    "resourceSpans": [
        {
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "shop"}}]},
            "scopeSpans": [
                {
                    "scope": {"name": "opentelemetry.instrumentation.flask"},
                    "spans": [
                        {
                            "traceId": "5b8efff798038103d269b633813fc60c",
                            "spanId": "eee19b7ec3c1b174",
                            "name": "GET /cart",
                            "kind": 2,
                            "startTimeUnixNano": "1544712660000000000",
                            "endTimeUnixNano": "1544712661000000000",
                            "attributes": [{"key": "http.status_code", "value": {"intValue": "500"}}],
                            "status": {"code": 2, "message": "boom"},
                        }
                    ],
                }
            ],
        }
    ]
}


def test_another_producers_file(tmp_path, capsys):
    path = tmp_path / "shop.jsonl"
    path.write_text(json.dumps(_OTHER_PRODUCER) + "\n")
    assert cli.main(["summary", str(path)]) == 1
    assert f"no torchtrace spans in {path} (1 spans of other producers)" in capsys.readouterr().err
    (event,) = [event for event in _perfetto(tmp_path, path)["traceEvents"] if event["ph"] == "X"]
    assert (event["name"], event["dur"], event["args"]["error"]) == ("GET /cart", 1e6, "boom")
    assert event["args"]["http.status_code"] == 500


def _file(directory, name: str, content: bytes):
    (directory / name).write_bytes(content)
    return directory / name


@pytest.mark.parametrize("command", ["summary", "perfetto"])
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda directory: directory / "missing.jsonl", "missing.jsonl: no such file or directory"),
        (lambda directory: directory, ": no *.jsonl trace files in this directory"),
        (lambda directory: _file(directory, "empty.jsonl", b""), "empty.jsonl"),
        (lambda directory: _file(directory, "bin.jsonl", b"\x00\xff{"), "(1 unreadable line(s)"),
        (lambda directory: str(directory / "nothing-*.jsonl"), "nothing-*.jsonl: no file matches"),
    ],
    ids=["missing", "empty directory", "empty file", "garbage", "glob without match"],
)
def test_bad_input_is_a_clear_message_and_exit_status_1(tmp_path, capsys, command, make, message):
    target = make(tmp_path)
    output = tmp_path / "out.json"
    arguments = [command, str(target)] + (["-o", str(output)] if command == "perfetto" else [])
    assert cli.main(arguments) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"torchtrace {command}: error: ") and message in err
    assert "Traceback" not in err
    assert not output.exists() and not (tmp_path / "out.json.partial").exists()


def test_a_reader_of_some_traces_yields_only_their_spans(traced):
    path, _ = traced
    spans = list(TraceReader([path], progress=False))
    every = {span.trace_id for span in spans}
    chosen = set(sorted(every)[:2])
    read = TraceReader([path], progress=False, traces=chosen)
    kept = list(read)
    assert {span.trace_id for span in kept} == chosen
    assert sorted(span.span_id for span in kept) == sorted(span.span_id for span in spans if span.trace_id in chosen)
    naming = [line for line in path.read_text().splitlines() if any(trace in line for trace in chosen)]
    assert read.lines == len(naming) and read.bad_lines == 0  # the other lines were skipped, not parsed
