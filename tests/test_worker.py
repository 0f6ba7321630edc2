"""One dispatch worker thread per process, shared by every handle: started on first use, ended at the last
``remove()``; each handle keeps its own interval, batches, sinks and failures."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref

import pytest
import torch
from fault_receivers import wait_until
from torch import nn

import torchtrace
from torchtrace._capture.buffer import RecordBuffer
from torchtrace._pipeline import worker as _worker
from torchtrace.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")


def dispatch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "torchtrace-dispatch" and thread.is_alive()]


class Batches:
    """A sink remembering when each batch arrived and how many calls it held."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def __call__(self, calls) -> None:
        if calls:
            self.times.append(time.monotonic())
            self.calls += len(calls)


def test_forty_handles_share_one_worker_that_delivers_every_handles_calls() -> None:
    models = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(40)]
    sinks = [Batches() for _ in models]
    handles = [
        torchtrace.instrument(model, exporter="none", sinks=[sink], limits=torchtrace.Limits(export_interval_ms=20))
        for model, sink in zip(models, sinks)
    ]
    try:
        assert len(dispatch_threads()) == 1
        for model in models:
            model(torch.randn(2, 4))
        # no flush: the shared worker delivers each handle's calls in the background
        assert wait_until(lambda: all(sink.calls == 3 for sink in sinks), timeout=10)
        assert len(dispatch_threads()) == 1
        expected = [[(call.path, call.type_name) for call in handle.records] for handle in handles]
        assert expected == [[("", "Sequential"), ("0", "Linear"), ("1", "ReLU")]] * 40
    finally:
        for handle in handles[:-1]:
            handle.remove()
        assert len(dispatch_threads()) == 1  # one handle still live
        handles[-1].remove()
    assert dispatch_threads() == []  # ended by the last remove(), before it returned


def test_the_worker_starts_again_on_a_new_instrument() -> None:
    model = nn.Linear(4, 4)
    with torchtrace.instrument(model, exporter="none"):
        first = dispatch_threads()
    assert dispatch_threads() == []
    sink = Batches()
    with torchtrace.instrument(model, exporter="none", sinks=[sink], limits=torchtrace.Limits(export_interval_ms=10)):
        second = dispatch_threads()
        model(torch.randn(2, 4))
        assert wait_until(lambda: sink.calls == 1, timeout=10)  # served by the new worker
    assert len(first) == len(second) == 1 and first[0] is not second[0]
    assert dispatch_threads() == []


class TimedExports:
    """Wraps a handle's exporter: when each batch went out (the file exporter still writes it)."""

    def __init__(self, handle) -> None:
        dispatcher = handle._dispatcher
        (self.exporter,) = dispatcher.exporters
        dispatcher.exporters[0] = self
        self.times: list[float] = []

    def __call__(self, calls) -> None:
        if calls:
            self.times.append(time.monotonic())
        self.exporter(calls)


def test_each_handle_exports_at_its_own_interval(tmp_path) -> None:
    fast_model, slow_model = nn.Linear(4, 4), nn.Linear(4, 4)
    started = time.monotonic()
    with (
        torchtrace.instrument(
            fast_model, exporter="file", trace_file=str(tmp_path / "f"), limits=torchtrace.Limits(export_interval_ms=20)
        ) as a,
        torchtrace.instrument(
            slow_model,
            exporter="file",
            trace_file=str(tmp_path / "s"),
            limits=torchtrace.Limits(export_interval_ms=300),
        ) as b,
    ):
        fast, slow = TimedExports(a), TimedExports(b)
        while len(slow.times) < 3 and time.monotonic() - started < 30:
            fast_model(torch.randn(2, 4))
            slow_model(torch.randn(2, 4))
            time.sleep(0.002)
        stopped = time.monotonic()
    slow_times = [t for t in slow.times if t < stopped]  # remove() delivers the rest at once
    fast_times = [t for t in fast.times if t < stopped]
    assert len(slow_times) >= 3
    # a background export comes no sooner than an interval after the previous one ended (or the handle started)
    assert slow_times[0] - started >= 0.3
    assert all(later - earlier >= 0.3 for earlier, later in zip(slow_times, slow_times[1:]))
    assert all(later - earlier >= 0.02 for earlier, later in zip(fast_times, fast_times[1:]))
    assert len(fast_times) > 2 * len(slow_times)  # the slow handle does not hold the fast one back
    lines = [len((tmp_path / name).read_text().splitlines()) for name in ("f", "s")]
    assert lines == [len(fast.times), len(slow.times)]  # one line per batch: nothing sent between them


def test_in_process_sinks_get_calls_long_before_the_export_interval(tmp_path) -> None:
    model, sink = nn.Linear(4, 4), Batches()
    trace_file = tmp_path / "t"
    with torchtrace.instrument(
        model,
        exporter="file",
        trace_file=str(trace_file),
        sinks=[sink],
        limits=torchtrace.Limits(export_interval_ms=600_000),
    ) as handle:
        exports = TimedExports(handle)
        model(torch.randn(2, 4))
        assert wait_until(lambda: sink.calls == 1, timeout=10)  # resolved young (see _worker), no flush
        assert exports.times == [] and not trace_file.exists()
        handle.flush()
        assert len(exports.times) == 1 and len(trace_file.read_text().splitlines()) == 1


def test_a_backlog_of_calls_is_resolved_at_once_without_waiting_for_the_tick(monkeypatch) -> None:
    # The periodic tick made an hour long: only the backlog bound (64 calls in 8 forwards) can wake the worker.
    monkeypatch.setattr(_worker, "RESOLVE_INTERVAL_S", 3600.0)
    monkeypatch.setattr(_worker, "_IDLE_RESOLVE_INTERVAL_S", 3600.0)
    model, sink = nn.Sequential(*[nn.Linear(4, 4) for _ in range(7)]), Batches()  # 8 calls per forward
    with torchtrace.instrument(
        model, exporter="none", sinks=[sink], limits=torchtrace.Limits(export_interval_ms=600_000)
    ) as handle:
        assert wait_until(lambda: handle.buffer.backlog_calls == 64 and dispatch_threads(), timeout=10)
        time.sleep(0.2)  # the new worker's first tick (at start) has passed
        for _ in range(7):
            model(torch.randn(2, 4))
        time.sleep(0.3)
        assert sink.calls == 0 and handle.buffer.pending_calls == 56  # under the backlog: waits for the tick
        model(torch.randn(2, 4))  # 64 calls in 8 forwards waiting
        assert wait_until(lambda: sink.calls == 64, timeout=10)
        assert handle.buffer.pending_calls == 0


def test_the_buffer_signals_its_backlog_once_until_it_is_taken() -> None:
    buffer, signals = RecordBuffer(max_calls=1000, backlog_calls=10, backlog_forwards=2), []
    buffer.on_backlog = lambda: signals.append(buffer.pending_calls)
    for _ in range(5):
        buffer.put(object(), 4)
    assert signals == [12]  # once, when 12 >= 10 calls waited; not again at 16 or 20
    buffer.take_all()
    buffer.put(object(), 10)
    assert signals == [12]  # enough calls, but one forward: the worker's tick takes it
    buffer.put(object(), 1)
    assert signals == [12, 11]
    assert not buffer.put(object(), 990) and signals == [12, 11]  # a dropped forward signals nothing


def test_a_failing_sink_or_drain_of_one_handle_does_not_stop_the_others(monkeypatch) -> None:
    def failing_sink(calls) -> None:
        raise RuntimeError("sink down")

    models = [nn.Linear(4, 4) for _ in range(3)]
    good = Batches()
    with (
        torchtrace.instrument(
            models[0], exporter="none", sinks=[failing_sink], limits=torchtrace.Limits(export_interval_ms=10)
        ) as failing,
        torchtrace.instrument(models[1], exporter="none", limits=torchtrace.Limits(export_interval_ms=10)) as broken,
        torchtrace.instrument(
            models[2], exporter="none", sinks=[good], limits=torchtrace.Limits(export_interval_ms=10)
        ),
    ):

        def broken_drain(wait: bool = True) -> int:
            raise RuntimeError("drain broke")

        monkeypatch.setattr(broken._dispatcher, "drain", broken_drain)
        for round_ in range(1, 4):
            for model in models:
                model(torch.randn(2, 4))
            assert wait_until(lambda n=round_: good.calls == n and failing.sink_errors == n, timeout=10)
        assert len(dispatch_threads()) == 1
        monkeypatch.undo()  # remove() delivers the broken handle's calls


def test_a_handle_dropped_without_remove_keeps_neither_the_worker_nor_its_model_alive() -> None:
    model = nn.Linear(4, 4)
    handle = torchtrace.instrument(model, exporter="none", limits=torchtrace.Limits(export_interval_ms=600_000))
    model(torch.randn(2, 4))
    model_ref, handle_ref = weakref.ref(model), weakref.ref(handle)
    assert len(dispatch_threads()) == 1
    del model, handle
    gc.collect()
    assert model_ref() is None and handle_ref() is None
    assert wait_until(lambda: dispatch_threads() == [], timeout=10)  # long before its 10-minute interval


def test_a_forked_child_has_one_worker_for_all_its_handles() -> None:
    models = [nn.Linear(4, 4) for _ in range(5)]
    sinks = [Batches() for _ in models]
    handles = [
        torchtrace.instrument(model, exporter="none", sinks=[sink], limits=torchtrace.Limits(export_interval_ms=10))
        for model, sink in zip(models, sinks)
    ]
    try:
        pid = os.fork()
        if pid == 0:  # the child: its own single worker delivers every handle's calls without a flush
            code = 1
            try:
                for model in models:
                    model(torch.randn(2, 4))
                delivered = wait_until(lambda: all(sink.calls >= 1 for sink in sinks), timeout=10)
                code = 0 if delivered and len(dispatch_threads()) == 1 else 3
                for handle in handles:
                    handle.remove()
                code = code or (0 if dispatch_threads() == [] else 4)
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        if not done[0]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0
        assert len(dispatch_threads()) == 1 and all(sink.calls == 0 for sink in sinks)  # the parent's: untouched
    finally:
        for handle in handles:
            handle.remove()


def test_torchtrace_run_with_many_models_runs_one_worker(tmp_path, capsys) -> None:
    script = tmp_path / "many.py"
    script.write_text(
        "import threading, torch\n"
        "layers = [torch.nn.Linear(2, 2) for _ in range(400)]\n"
        "for layer in layers:\n"
        "    layer(torch.randn(1, 2))\n"
        "print('threads', sum(t.name == 'torchtrace-dispatch' for t in threading.enumerate()))\n"
    )
    assert main(["run", "--exporter", "none", "--no-summary", str(script)]) == 0
    assert "threads 1\n" in capsys.readouterr().out


def test_a_forked_child_does_not_export_what_the_parent_resolved(tmp_path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    model, sink = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), Batches()
    with torchtrace.instrument(
        model,
        exporter="file",
        trace_file=str(trace_file),
        sinks=[sink],
        limits=torchtrace.Limits(export_interval_ms=600_000),
    ) as handle:
        model(torch.randn(2, 4))
        assert wait_until(lambda: sink.calls == 3, timeout=10)  # resolved, not exported yet
        pid = os.fork()
        if pid == 0:  # the child: one forward of its own, exported by its flush
            code = 1
            try:
                model(torch.randn(2, 4))
                code = 0 if handle.flush() and handle.exported_spans == 3 else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0
    span_ids = [span["spanId"] for line in trace_file.read_text().splitlines() for span in otlp_json_spans(line)]
    assert len(span_ids) == len(set(span_ids)) == 6  # the parent's forward once, the child's once


def test_a_cpu_forward_is_resolved_at_its_end_and_one_that_fails_there_is_left_to_the_worker():
    from torchtrace._capture.recorder import RawForward
    from torchtrace._core.calls import CallBatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    expected = model(x)
    with torchtrace.instrument(model, exporter="none") as handle:
        handle._recorder.deliver = None  # buffered for the worker, not delivered at the forward's end
        with _worker.WORKER._condition:  # the worker holds still: what the hooks buffered stays there
            model(x)
            (resolved,) = handle.buffer.take_all()
            handle.buffer.put(resolved, len(resolved))
        assert isinstance(resolved, CallBatch) and [call.name for call in resolved] == ["Sequential", "0", "1"]

        def failing(forward, modules):
            raise RuntimeError("cannot resolve")

        handle._recorder._resolve = failing
        with _worker.WORKER._condition:
            assert torch.equal(model(x), expected)  # the user's forward never sees the failure
            waiting = handle.buffer.take_all()
            assert [type(item) for item in waiting] == [CallBatch, RawForward]
            for item in waiting:
                handle.buffer.put(item, len(item))
        handle.flush()
        assert [call.name for call in handle.records] == ["Sequential", "0", "1"] * 2
        assert handle.records[-1].attributes["torchtrace.output.shape"] == (2, 4)
        assert handle.sink_errors == 0


def test_a_cpu_forward_reaches_the_records_and_summary_at_its_end_and_the_file_at_the_next_flush(tmp_path) -> None:
    # Records and summary are the only in-process sinks: the model's thread hands them each forward as it ends,
    # with the worker held still; the exporter gets the forward at the next drain.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    trace_file = tmp_path / "t.jsonl"
    with torchtrace.instrument(
        model, exporter="file", trace_file=str(trace_file), limits=torchtrace.Limits(export_interval_ms=600_000)
    ) as handle:
        with _worker.WORKER._condition:
            model(torch.randn(2, 4))
            model(torch.randn(2, 4))
            assert len(handle.buffer) == 0  # nothing left for the worker
            kept = handle._records.all()
            assert [call.name for call in kept] == ["Sequential", "0", "1"] * 2
            assert {row.path: row.calls for row in handle._summary.rows()} == {"Sequential": 2, "0": 2, "1": 2}
            assert not trace_file.exists()
        assert handle.flush() and handle.exported_spans == 6
        spans = [span for line in trace_file.read_text().splitlines() for span in otlp_json_spans(line)]
        assert sorted(int(span["spanId"], 16) for span in spans) == sorted(call.span_id for call in kept)


def test_a_sink_of_your_own_keeps_every_forward_on_the_worker() -> None:
    model, sink = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), Batches()
    with torchtrace.instrument(
        model, exporter="none", sinks=[sink], limits=torchtrace.Limits(export_interval_ms=600_000)
    ) as handle:
        with _worker.WORKER._condition:  # your sink is never called on the model's thread
            model(torch.randn(2, 4))
            assert len(handle.buffer) == 1 and sink.calls == 0 and handle._records.all() == []
        assert wait_until(lambda: sink.calls == 3, timeout=10)
        assert [call.name for call in handle.records] == ["Sequential", "0", "1"]


def test_forwards_the_exporter_cannot_take_yet_are_dropped_counted_and_still_recorded(tmp_path) -> None:
    # The exporter's backlog is bounded by max_pending_calls like the buffer: past it a forward is dropped whole for
    # export (counted, warned), while the records and the summary still get it.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # 3 calls a forward
    trace_file = tmp_path / "t.jsonl"
    options = {
        "limits": torchtrace.Limits(max_pending_calls=10, export_interval_ms=600_000),
        "trace_file": str(trace_file),
    }
    with torchtrace.instrument(model, exporter="file", **options) as handle:
        with _worker.WORKER._condition:
            for _ in range(5):
                model(torch.randn(2, 4))
        assert handle.dropped_calls == 6  # forwards 4 and 5: 9 calls wait, 12 would not fit
        handle.flush()
        assert handle.exported_spans == 9 and len(handle.records) == 15
        assert {row.path: row.calls for row in handle.summary_rows()}["Sequential"] == 5
    assert sum(len(otlp_json_spans(line)) for line in trace_file.read_text().splitlines()) == 9


def test_forwards_ending_on_many_threads_at_once_are_each_recorded_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    threads, forwards = 4, 50
    with torchtrace.instrument(model, exporter="none", records=torchtrace.Records(max_records=10_000)) as handle:

        def serve() -> None:
            with torch.inference_mode():
                for _ in range(forwards):
                    model(torch.randn(2, 4))

        workers = [threading.Thread(target=serve) for _ in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        records = handle.records
        assert len(records) == 3 * threads * forwards
        assert len({call.span_id for call in records}) == len(records)
        assert {row.path: row.calls for row in handle.summary_rows()} == dict.fromkeys(
            ["Sequential", "0", "1"], threads * forwards
        )
        assert handle.dropped_calls == 0 and handle.sink_errors == 0


def otlp_json_spans(line: str) -> list[dict]:
    return [span for resource in json.loads(line)["resourceSpans"] for scope in resource["scopeSpans"]
            for span in scope["spans"]]  # fmt: skip
