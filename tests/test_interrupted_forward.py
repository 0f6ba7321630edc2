"""A forward interrupted by Ctrl-C is closed as interrupted: each module call inside the model ends where the
interrupt reached it (its traced forward sees the KeyboardInterrupt); the model's root, whose always_call hook torch
does not run for it, is closed at the next flush / remove / exit at the latest, ending when its last call did. It is
delivered with its finished children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import torchtrace
from torchtrace._pipeline.dispatcher import CallInterrupted


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here, also when the suite runs as a background job (a shell starts those
    with SIGINT ignored, and Python then leaves it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class CtrlC(nn.Module):
    """Sends this process a real SIGINT mid-forward; Python raises KeyboardInterrupt where the forward then is."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True
        self.interrupted_ns = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            self.interrupted_ns = time.time_ns()
            signal.raise_signal(signal.SIGINT)
            time.sleep(5)  # never reached whole: the interrupt lands here
        return x


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), CtrlC(), nn.Linear(4, 4))


def _interrupt(model: nn.Sequential) -> None:
    with pytest.raises(KeyboardInterrupt):
        model(torch.ones(1, 4))


def _assert_closed_at_the_interrupt(records, interrupted_ns: int) -> None:
    by_path = {record.path: record for record in records}
    assert set(by_path) == {"", "0", "1"}  # the finished child too; "2" never started
    assert by_path["0"].error is None
    for path in ("", "1"):
        record = by_path[path]
        assert isinstance(record.error, CallInterrupted)
        # where the interrupt landed: after it was raised, and not the next call or flush (0.3 s later)
        assert interrupted_ns <= record.end_ns < interrupted_ns + 50_000_000
    assert by_path[""].end_ns == by_path["1"].end_ns


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT via raise_signal")
def test_an_interrupted_forward_is_delivered_at_the_next_flush_ending_when_it_stopped():
    model = _model()
    with torchtrace.instrument(model, exporter="none") as handle:
        _interrupt(model)
        time.sleep(0.3)  # the user takes a while before flushing: not part of the forward
        assert handle.flush() is True
        _assert_closed_at_the_interrupt(handle.records, model[1].interrupted_ns)
        model(torch.ones(1, 4))  # the next forward is traced whole
        assert [record.path for record in handle.records[3:]] == ["", "0", "1", "2"]
        assert all(record.error is None for record in handle.records[3:])


def test_an_interrupted_forward_called_again_ends_when_it_stopped_not_at_the_next_call():
    model = _model()
    with torchtrace.instrument(model, exporter="none") as handle:
        _interrupt(model)
        time.sleep(0.3)
        model(torch.ones(1, 4))
        _assert_closed_at_the_interrupt(handle.records[:3], model[1].interrupted_ns)


def test_an_interrupted_forward_is_delivered_at_remove(tmp_path):
    model = _model()
    trace_file = tmp_path / "t.jsonl"
    handle = torchtrace.instrument(model, exporter="file", trace_file=str(trace_file))
    _interrupt(model)
    handle.remove()
    spans = [
        span
        for line in trace_file.read_text().splitlines()
        for span in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    ]
    assert sorted(span["name"] for span in spans) == ["0", "1", "Sequential"]
    assert sum(span.get("status", {}).get("code") == 2 for span in spans) == 2
    assert handle.failed_spans == 0 and handle.dropped_calls == 0


def test_an_interrupted_forward_is_delivered_at_exit(tmp_path):
    """The script catches Ctrl-C and ends without calling the model again or removing the handle."""
    trace_file = tmp_path / "t.jsonl"
    script = textwrap.dedent(
        f"""
        import signal, time, torch
        from torch import nn
        import torchtrace

        class CtrlC(nn.Module):
            def forward(self, x):
                signal.raise_signal(signal.SIGINT)
                time.sleep(5)
                return x

        signal.signal(signal.SIGINT, signal.default_int_handler)  # inherited as ignored in a background job
        model = nn.Sequential(nn.Linear(4, 4), CtrlC())
        torchtrace.instrument(model, exporter="file", trace_file={str(trace_file)!r})
        try:
            model(torch.ones(1, 4))
        except KeyboardInterrupt:
            print("interrupted", time.time_ns(), flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    interrupted_ns = int(result.stdout.split()[1])
    spans = [
        span
        for line in trace_file.read_text().splitlines()
        for span in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    ]
    assert sorted(span["name"] for span in spans) == ["0", "1", "Sequential"]
    root = next(span for span in spans if span["name"] == "Sequential")
    assert root["status"]["code"] == 2
    assert int(root["endTimeUnixNano"]) <= interrupted_ns
    assert os.path.getsize(trace_file) > 0


def test_a_root_reentered_inside_a_call_and_interrupted_there_is_closed_with_that_call():
    """The root's hooks see no KeyboardInterrupt; the call around the re-entered root (a traced forward) does, and
    ends the root's open inner call with itself."""

    class Inner(nn.Module):
        def __init__(self, outer: list) -> None:
            super().__init__()
            self.outer = outer  # a plain list: the root is not registered as its own sub-module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer[0](x, again=True)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner([self])

        def forward(self, x: torch.Tensor, again: bool = False) -> torch.Tensor:
            if again:
                raise KeyboardInterrupt
            return self.inner(x)

    model = Outer()
    with torchtrace.instrument(model, exporter="none") as handle:
        with pytest.raises(KeyboardInterrupt):
            model(torch.ones(2))
        assert handle.flush() is True
        records = handle.records
        assert [(record.path, record.depth) for record in records] == [("", 0), ("inner", 1), ("", 2)]
        assert all(isinstance(record.error, CallInterrupted) for record in records)
        assert records[2].end_ns == records[1].end_ns  # ended with the call around it, where the interrupt passed
        assert records[0].end_ns == records[1].end_ns
