"""A stop by SIGTERM (docker, Kubernetes, systemd, torchrun's agent) delivers what was recorded, then ends the
process as the signal would have. Real signals sent to real child processes; spans counted where they landed.

Each script prints (or writes) its number of finished forwards after every forward and exports only every 60 s, so
without the handler nothing would be delivered. A signal that lands between a forward's end and the count being
written leaves one forward more than reported: the sinks must hold N or N + 1 whole forwards.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkout import checkout_env
from fault_receivers import Blackhole, wait_until
from otlp_receiver import otlp_http_receiver as otlp_http_receiver  # noqa: F401 - fixture

import torchtrace
from torchtrace._core import signals as _signals
from torchtrace._otlp.file_writer import TraceFile

ROOT = Path(__file__).resolve().parent.parent
SPANS_PER_FORWARD = 4  # Sequential + 3 children

LOOP = """
import os, signal, sys, time, torch, torchtrace
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
x = torch.randn(2, 8)
{setup}
count_file = os.environ["COUNT_FILE"]
n = 0
while True:
    model(x)
    n += 1
    with open(count_file + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(count_file + ".tmp", count_file)
"""

INSTRUMENT = 'handle = torchtrace.instrument(model, exporter="file", trace_file=os.environ["TRACE_FILE"])'


def _env(**updates: str) -> dict[str, str]:
    return checkout_env(**{"TORCHTRACE_EXPORT_INTERVAL_MS": "60000", "TORCHTRACE_PRINT_SUMMARY": "false", **updates})


def _count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _file_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return _line_spans(path.read_text().splitlines())


def _line_spans(lines: list) -> list[dict]:
    """The spans of OTLP JSON lines, each of which must parse."""
    return [
        span
        for line in lines
        for resource in json.loads(line)["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]


def _forwards(spans: list, name_of=lambda span: span["name"]) -> int:
    """Whole forwards among the spans: one Sequential root and its three children each."""
    roots = sum(1 for span in spans if name_of(span) == "Sequential")
    assert len(spans) == SPANS_PER_FORWARD * roots, "a forward was delivered in part"
    return roots


def _start_and_terminate(argv: list[str], env: dict[str, str], count_file: Path, after: int = 50) -> tuple:
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: _count(count_file) >= after or process.poll() is not None, timeout=120)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    return process.returncode, _count(count_file), err


def _run_loop(tmp_path: Path, setup: str, **env: str) -> tuple[int, int, list[dict], str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(setup=setup))
    trace_file, count_file = tmp_path / "traces.jsonl", tmp_path / "count"
    code, count, err = _start_and_terminate(
        [sys.executable, str(script)], _env(TRACE_FILE=str(trace_file), COUNT_FILE=str(count_file), **env), count_file
    )
    return code, count, _file_spans(trace_file), err


def test_sigterm_delivers_every_finished_forward_and_ends_with_the_signal(tmp_path: Path) -> None:
    code, count, spans, err = _run_loop(tmp_path, INSTRUMENT)
    assert code == -signal.SIGTERM, err  # killed by the signal, as without torchtrace
    assert _forwards(spans) in (count, count + 1)


def test_opting_out_leaves_sigterm_alone(tmp_path: Path) -> None:
    code, count, spans, err = _run_loop(tmp_path, INSTRUMENT, TORCHTRACE_HANDLE_SIGTERM="false")
    assert code == -signal.SIGTERM, err
    assert count >= 50 and spans == []  # nothing delivered: the 60 s export interval never came


def test_the_applications_handler_runs_after_the_flush(tmp_path: Path) -> None:
    setup = textwrap.dedent(
        """
        def stop(signum, frame):
            print("app handler", file=sys.stderr, flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, stop)
        """
        + INSTRUMENT
    )
    code, count, spans, err = _run_loop(tmp_path, setup)
    assert code == 3 and "app handler" in err
    # sys.exit() in the handler stops the forward it lands in: that one is delivered too, marked interrupted
    interrupted = {span["traceId"] for span in spans if span.get("status", {}).get("code") == 2}
    assert len(interrupted) <= 1
    assert _forwards([span for span in spans if span["traceId"] not in interrupted]) in (count, count + 1)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_stop_with_the_applications_handler_and_a_hung_endpoint_fits_a_grace_period(
    tmp_path: Path, protocol: str
) -> None:
    """SIGTERM, the application's own handler (sys.exit), an endpoint that never answers: torchtrace's flush and
    the delivery at exit share one deadline (5 s), inside the 10 s docker and Kubernetes give before SIGKILL."""
    setup = textwrap.dedent(
        """
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
        handle = torchtrace.instrument(model, exporter="otlp")
        """
    )
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(setup=setup))
    count_file = tmp_path / "count"
    with Blackhole() as hung:
        env = _env(COUNT_FILE=str(count_file), OTEL_EXPORTER_OTLP_ENDPOINT=hung.endpoint)
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
        process = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
        assert wait_until(lambda: _count(count_file) >= 50 or process.poll() is not None, timeout=120)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
        stopped_s = time.monotonic() - started
    assert process.returncode == 3, err
    assert stopped_s < _signals.SIGTERM_FLUSH_TIMEOUT_S + 2.0, err  # the flush's 5 s, then no more than teardown


def test_an_ignored_sigterm_stays_ignored(tmp_path: Path) -> None:
    script = tmp_path / "ignore.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, time, torch, torchtrace
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
            {INSTRUMENT}
            model(torch.randn(2, 8))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            print("alive", signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
            """
        )
    )
    trace_file = tmp_path / "traces.jsonl"
    result = subprocess.run(
        [sys.executable, str(script)], env=_env(TRACE_FILE=str(trace_file)), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "alive True"
    assert _forwards(_file_spans(trace_file)) == 1  # delivered at exit, as always


def test_torchtrace_run_delivers_at_sigterm_to_a_real_receiver(tmp_path: Path, otlp_http_receiver) -> None:  # noqa: F811
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(setup=""))
    count_file = tmp_path / "count"
    env = _env(
        COUNT_FILE=str(count_file),
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http_receiver.endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
    )
    argv = [sys.executable, "-m", "torchtrace", "run", "--no-summary", str(script)]
    code, count, err = _start_and_terminate(argv, env, count_file)
    assert code == -signal.SIGTERM, err
    spans = otlp_http_receiver.spans()
    assert _forwards(spans, lambda span: span.name) in (count, count + 1)


TORCHRUN_SCRIPT = """
import os, torch, torch.distributed as dist, torchtrace
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
handle = torchtrace.instrument(model, exporter="file", trace_file=os.path.join(os.environ["OUT"], f"rank{rank}.jsonl"))
x = torch.randn(2, 8)
count_file = os.path.join(os.environ["OUT"], f"count{rank}")
n = 0
while True:
    model(x)
    n += 1
    with open(count_file + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(count_file + ".tmp", count_file)
"""


def test_a_torchrun_job_stopped_by_sigterm_delivers_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=0",
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(script),
    ]  # fmt: skip
    env = _env(OUT=str(tmp_path), OMP_NUM_THREADS="1")
    agent = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    counts = [tmp_path / "count0", tmp_path / "count1"]
    assert wait_until(lambda: min(map(_count, counts)) >= 50 or agent.poll() is not None, timeout=180)
    assert agent.poll() is None, agent.communicate()
    agent.send_signal(signal.SIGTERM)  # the agent stops its ranks with SIGTERM
    _, err = agent.communicate(timeout=90)
    assert agent.returncode != 0
    for rank, count_file in enumerate(counts):
        spans = _file_spans(tmp_path / f"rank{rank}.jsonl")
        count = _count(count_file)
        assert count >= 50
        assert _forwards(spans) in (count, count + 1), (rank, err[-2000:])


def test_sigkill_leaves_whole_lines_and_the_next_writer_keeps_a_cut_line_apart(tmp_path: Path) -> None:
    """A write of more than a page can be cut short by SIGKILL (the kernel stops between pages), so the line being
    written may end the file as a fragment; every line before it is whole, and the next writer starts on a new line,
    so no good line is ever glued to the fragment."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(setup=INSTRUMENT))
    trace_file, count_file = tmp_path / "traces.jsonl", tmp_path / "count"
    # exports every millisecond, so that the kill lands while lines are being written
    env = _env(TRACE_FILE=str(trace_file), COUNT_FILE=str(count_file), TORCHTRACE_EXPORT_INTERVAL_MS="1")
    process = subprocess.Popen([sys.executable, str(script)], env=env)
    assert wait_until(lambda: _count(count_file) >= 300, timeout=120)
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    *whole, fragment = trace_file.read_bytes().split(b"\n")
    assert 0 < _forwards(_line_spans(whole)) <= _count(count_file) + 1  # every whole line parses
    TraceFile(trace_file).append(b'{"resourceSpans": []}\n')  # the next process's first line
    kept = [*whole, fragment] if fragment else whole  # a fragment stays a line of its own
    assert trace_file.read_bytes().split(b"\n") == [*kept, b'{"resourceSpans": []}', b""]


# --- in this process: installed at the first instrument(), restored at the last remove() ------------------------


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4))


def test_the_handler_is_installed_once_and_the_previous_one_restored(tmp_path: Path) -> None:
    def application_handler(signum, frame) -> None:
        pass

    before = signal.signal(signal.SIGTERM, application_handler)
    try:
        models = [_model(), _model()]  # kept: a model dropped removes its handle
        first = torchtrace.instrument(models[0], exporter="none")
        second = torchtrace.instrument(models[1], exporter="none")
        assert _signals.installed()
        first.remove()
        assert _signals.installed()  # one handle still wants it
        second.remove()
        assert signal.getsignal(signal.SIGTERM) is application_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_nothing_is_installed_when_opted_out_or_off_the_main_thread() -> None:
    model = _model()
    torchtrace.configure(handle_sigterm=False)
    with torchtrace.instrument(model, exporter="none"):
        assert not _signals.installed()
    torchtrace.configure(handle_sigterm=True)
    handles = []
    thread = threading.Thread(target=lambda: handles.append(torchtrace.instrument(model, exporter="none")))
    thread.start()
    thread.join()
    assert not _signals.installed()
    handles[0].remove()


def test_handle_sigterm_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHTRACE_HANDLE_SIGTERM", "off")
    model = _model()
    with torchtrace.instrument(model, exporter="none"):
        assert torchtrace.configure().handle_sigterm is False and not _signals.installed()
    monkeypatch.setenv("TORCHTRACE_HANDLE_SIGTERM", "maybe")
    with pytest.raises(ValueError, match="TORCHTRACE_HANDLE_SIGTERM"):
        torchtrace.instrument(model, exporter="none")


def test_a_stop_is_bounded_when_the_flush_cannot_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = threading.Event()
    monkeypatch.setattr(_signals, "_holders", {1: lambda seconds: stuck.wait(30)})
    started = time.monotonic()
    _signals._flush_all(0.3)
    assert time.monotonic() - started < 2
    stuck.set()


@contextlib.contextmanager
def _application_handler(trace_file: Path) -> Iterator[list[int]]:
    """The application's own SIGTERM handler for the test: it notes how many lines the trace file had when it ran
    (torchtrace hands the signal on to it after its flush)."""
    lines_when_handled: list[int] = []

    def application_handler(signum, frame) -> None:
        lines_when_handled.append(len(trace_file.read_text().splitlines()) if trace_file.exists() else 0)

    before = signal.signal(signal.SIGTERM, application_handler)
    try:
        yield lines_when_handled
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_landing_while_the_records_take_a_forward_is_handled_once_they_have_it(tmp_path: Path) -> None:
    # The flush at SIGTERM runs on a thread of its own and needs the lock that the records and the summary take a
    # forward under, on the model's thread, at its end: a signal landing there is handled as soon as they have it,
    # not after the flush waited out its deadline (5 s) with every span lost.
    trace_file = tmp_path / "t.jsonl"
    model = _model()
    options = {"trace_file": str(trace_file), "limits": torchtrace.Limits(export_interval_ms=600_000)}
    with (
        _application_handler(trace_file) as lines_when_handled,
        torchtrace.instrument(model, exporter="file", **options) as handle,
    ):
        dispatcher = handle._dispatcher
        records = dispatcher._in_process[0]

        def records_interrupted(calls) -> None:
            records(calls)
            os.kill(os.getpid(), signal.SIGTERM)  # Python handles it at its next step: still inside

        dispatcher._in_process[0] = records_interrupted
        started = time.monotonic()
        model(torch.ones(1, 4))
        assert time.monotonic() - started < 2
        assert lines_when_handled == [1]  # the flush had written the forward when the application heard of it
        assert sorted(span["name"] for span in _file_spans(trace_file)) == ["0", "Sequential"]
        assert len(handle.records) == 2


class _SignalledDeque(collections.deque):
    """The record buffer's queue, sending SIGTERM as a forward is appended: while the buffer's lock is held."""

    def append(self, item) -> None:  # noqa: ANN001
        super().append(item)
        os.kill(os.getpid(), signal.SIGTERM)  # Python handles it at its next call: still under the lock


def test_a_sigterm_landing_while_the_buffer_queues_a_forward_is_handled_once_it_is_queued(tmp_path: Path) -> None:
    # With a sink of the user's, forwards go through the record buffer to the worker. The model's thread holds the
    # buffer's lock while it queues one; the flush at SIGTERM takes everything queued under that same lock.
    trace_file = tmp_path / "t.jsonl"
    sunk: list = []
    model = _model()
    options = {
        "trace_file": str(trace_file),
        "limits": torchtrace.Limits(export_interval_ms=600_000),
        "sinks": [sunk.extend],
    }
    with (
        _application_handler(trace_file) as lines_when_handled,
        torchtrace.instrument(model, exporter="file", **options) as handle,
    ):
        handle.buffer._forwards = _SignalledDeque()
        started = time.monotonic()
        model(torch.ones(1, 4))
        assert time.monotonic() - started < 2  # not the flush's 5 s deadline
        assert lines_when_handled == [1]  # the flush had written the forward when the application heard of it
        assert sorted(span["name"] for span in _file_spans(trace_file)) == ["0", "Sequential"]
        assert sorted(call.name for call in sunk) == ["0", "Sequential"]


class _SignallingClock:
    """``time`` for the record buffer: its ``monotonic``, read while a dropped forward is counted, sends SIGTERM."""

    def monotonic(self) -> float:
        os.kill(os.getpid(), signal.SIGTERM)  # Python handles it at its next call: still inside the drop
        return time.monotonic()


def test_a_sigterm_landing_in_a_drop_inside_the_records_delivery_waits_for_the_outer_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The export backlog is full: the second forward, delivered to the records at its end under the dispatcher's lock,
    # is dropped for export there. A SIGTERM landing in that drop (guarded itself) must wait until the delivery has
    # released the lock the flush needs, not be handled as the drop returns.
    trace_file = tmp_path / "t.jsonl"
    model = _model()
    options = {
        "trace_file": str(trace_file),
        "limits": torchtrace.Limits(export_interval_ms=600_000, max_pending_calls=2),
    }
    with (
        _application_handler(trace_file) as lines_when_handled,
        torchtrace.instrument(model, exporter="file", **options) as handle,
    ):
        model(torch.ones(1, 4))  # waits for the exporters: the backlog is full
        monkeypatch.setattr("torchtrace._capture.buffer.time", _SignallingClock())
        started = time.monotonic()
        model(torch.ones(1, 4))
        monkeypatch.undo()
        assert time.monotonic() - started < 2  # not the flush's 5 s deadline
        assert lines_when_handled == [1]  # the flush had written the first forward
        assert sorted(span["name"] for span in _file_spans(trace_file)) == ["0", "Sequential"]
        assert handle.buffer.dropped_calls == 2 and len(handle.records) == 4


TRAIN_IN_A_JOB = """
import os, torch, torch.distributed as dist, torchtrace
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
handle = torchtrace.instrument(model, exporter="file", trace_file=os.environ["TRACE_FILE"], backward=True,
                               optimizer=optimizer, training=torchtrace.Training(rank_detail="auto"))
count_file = os.environ["COUNT_FILE"]
n = 0
while True:
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    n += 1
    with open(count_file + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(count_file + ".tmp", count_file)
"""


def test_sigterm_delivers_the_steps_waiting_for_their_ranks_under_rank_detail_auto(tmp_path: Path) -> None:
    """Under rank_detail="auto" the last traced steps wait for their run of steps to be gathered from the ranks; a
    SIGTERM (which every rank of a job gets) gathers it at once, and every finished step is delivered."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_IN_A_JOB)
    trace_file, count_file = tmp_path / "traces.jsonl", tmp_path / "count"
    env = _env(TRACE_FILE=str(trace_file), COUNT_FILE=str(count_file), TORCHTRACE_RUN_ID="sigterm")
    code, count, err = _start_and_terminate([sys.executable, str(script)], env, count_file, after=40)
    assert code == -signal.SIGTERM, err
    steps = [span for span in _file_spans(trace_file) if span["name"] == "rank 0"]
    assert count >= 40 and len(steps) in (count, count + 1), (count, len(steps))
