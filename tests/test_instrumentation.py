"""Zero-code tracing: ``TorchInstrumentor`` (opentelemetry-instrument), ``torchtrace run``, ``torchtrace config``,
and the example inference server, whose request spans parent the model spans."""

from __future__ import annotations

import gc
import io
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from checkout import checkout_env
from instrumented import traced_modules
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_receiver import OtlpHttpReceiver
from torch import nn

import torchtrace
from torchtrace import _handle
from torchtrace._run import _print_summaries
from torchtrace.cli import main
from torchtrace.instrumentation import TorchInstrumentor
from torchtrace.testing import capture_spans

ROOT = Path(__file__).resolve().parent.parent
TRACEPARENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT_SPAN_ID = "b7ad6b7169203331"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


CALLS = 5  # Net, encoder, encoder.0, encoder.1, head
TORCH_MODULE_CALL = torch.nn.Module.__call__


@pytest.fixture
def instrumentor():
    instrumentor = TorchInstrumentor()
    yield instrumentor
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()


def test_the_instrumentor_is_registered_for_opentelemetry_instrument() -> None:
    (entry_point,) = [ep for ep in entry_points(group="opentelemetry_instrumentor") if ep.name == "torch"]
    assert entry_point.load() is TorchInstrumentor
    assert TorchInstrumentor().instrumentation_dependencies() == ("torch >= 2.3",)


def test_every_model_is_traced_from_its_first_call_on(instrumentor) -> None:
    instrumentor.instrument(exporter="none")
    model = Net()
    model(torch.randn(3, 4))  # the first call: instrumented before torch runs it, and traced
    model(torch.randn(3, 4))
    (handle,) = instrumentor.handles
    assert handle.model is model
    records = handle.records
    assert len(records) == 2 * CALLS
    roots = [record for record in records if record.depth == 0]
    assert [record.path for record in roots] == ["", ""]
    assert {record.trace_id for record in records if record.depth > 0} == {root.trace_id for root in roots}


def test_a_traced_models_calls_keep_torchs_fast_path_under_the_instrumentor(instrumentor) -> None:
    """No global hook (which would send every module call of the process down nn.Module's slow path): the
    instrumentor wraps ``nn.Module.__call__``, and puts torch's back at ``uninstrument()``."""
    instrumentor.instrument(exporter="none")
    model = Net()
    model(torch.randn(3, 4))
    assert torch.nn.Module.__call__ is not TORCH_MODULE_CALL
    module_globals = torch.nn.modules.module
    assert not (module_globals._global_forward_pre_hooks or module_globals._global_forward_hooks)
    assert not (model.head._forward_pre_hooks or model.head._forward_hooks)  # traced through its forward
    instrumentor.uninstrument()
    assert torch.nn.Module.__call__ is TORCH_MODULE_CALL


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, offset: torch.Tensor, depth: int = 2) -> torch.Tensor:
        return self(self.layer(x) + offset, offset=offset, depth=depth - 1) if depth else x


def test_a_models_first_call_is_traced_whole_with_its_keyword_inputs(instrumentor) -> None:
    """The model is instrumented before torch runs its first call: a recursive model's first call is one forward
    like the next (nothing closed as interrupted), and its keyword inputs are summarised."""
    instrumentor.instrument(exporter="none", stats=torchtrace.Stats(inputs=True))
    model = Recursive()
    x, offset = torch.randn(3, 4), torch.full((4,), 2.0)
    model(x, offset=offset, depth=2)
    model(x, offset=offset, depth=2)
    (handle,) = instrumentor.handles
    first, second = handle.records[:5], handle.records[5:]
    assert [(call.path, call.depth, call.error) for call in first] == [
        ("", 0, None), ("layer", 1, None), ("", 1, None), ("layer", 2, None), ("", 2, None)
    ]  # fmt: skip
    assert [(call.path, call.depth, call.error) for call in second] == [
        (call.path, call.depth, call.error) for call in first
    ]
    assert first[0].attributes["torchtrace.input.0.shape"] == (3, 4)
    assert first[0].attributes["torchtrace.input.offset.mean"] == 2.0


def test_submodules_and_helpers_are_traced_with_their_model_not_on_their_own(instrumentor) -> None:
    instrumentor.instrument(exporter="none")
    model = Net()
    model(torch.randn(1, 4))
    model.head(torch.randn(1, 4))  # a submodule called directly: covered by its model's handle
    assert len(instrumentor.handles) == 1


def test_a_model_called_after_one_of_its_parts_is_traced_as_a_whole(instrumentor) -> None:
    instrumentor.instrument(exporter="none")
    model = Net()
    model.encoder(torch.randn(1, 4))  # traced on its own first
    model(torch.randn(1, 4))
    (handle,) = instrumentor.handles  # the part's handle was replaced by the model's
    assert handle.model is model
    assert len(handle.records) == CALLS


def test_a_stateless_module_made_in_the_loop_is_not_a_model_of_its_own(instrumentor, monkeypatch) -> None:
    from torchtrace import instrumentation

    instrumented = []
    real_instrument = instrumentation._handle.instrument
    monkeypatch.setattr(
        instrumentation._handle,
        "instrument",
        lambda model, **options: instrumented.append(model) or real_instrument(model, **options),
    )
    instrumentor.instrument(exporter="none")
    model = Net()
    for _ in range(3):
        loss = nn.MSELoss()(model(torch.randn(2, 4)), torch.zeros(2, 2))  # a new loss module every iteration
        loss.backward()
    assert instrumented == [model]  # not the losses: no hooks, records or summaries for them
    (handle,) = instrumentor.handles
    assert len(handle.records) == 3 * CALLS


def test_threads_calling_a_model_first_at_once_each_get_a_whole_trace(instrumentor, monkeypatch) -> None:
    import threading

    from torchtrace import instrumentation

    real_instrument = instrumentation._handle.instrument

    def slow_instrument(model, **options):  # noqa: ANN001, ANN003 -- the second thread arrives meanwhile
        time.sleep(0.3)
        return real_instrument(model, **options)

    monkeypatch.setattr(instrumentation._handle, "instrument", slow_instrument)
    instrumentor.instrument(exporter="none")
    model = Net()
    threads = [threading.Thread(target=model, args=(torch.randn(1, 4),)) for _ in range(2)]
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    for thread in threads:
        thread.join()
    (handle,) = instrumentor.handles
    roots = [record for record in handle.records if record.depth == 0]
    assert [root.path for root in roots] == ["", ""]  # no child of the second call became a root of its own
    assert len(handle.records) == 2 * CALLS


def test_run_summarises_a_model_that_lived_inside_main(tmp_path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "def main():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "    model(torch.randn(2, 4))\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    assert main(["run", "--exporter", "none", str(script)]) == 0
    err = capsys.readouterr().err
    assert "no model was called" not in err and "torchtrace: Sequential" in err


def test_uninstrument_removes_every_hook_and_delivers_pending_spans(instrumentor) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor.instrument(tracer_provider=provider, limits=torchtrace.Limits(export_interval_ms=60_000))
    model = Net()
    with provider.get_tracer("test").start_as_current_span("request") as request:
        model(torch.randn(2, 4))
    instrumentor.uninstrument()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"request", "Net", "encoder", "encoder.0", "encoder.1", "head"}
    assert spans["Net"].parent.span_id == request.get_span_context().span_id
    assert traced_modules(model) == []
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert torch.nn.Module.__call__ is TORCH_MODULE_CALL
    assert not _handle._live_handles
    model(torch.randn(2, 4))  # no longer traced
    assert len(exporter.get_finished_spans()) == 1 + CALLS


def test_invalid_torchtrace_variables_fail_at_instrument_time(instrumentor, monkeypatch) -> None:
    monkeypatch.setenv("TORCHTRACE_SAMPLE_RATIO", "-0.5")
    with pytest.raises(ValueError, match="TORCHTRACE_SAMPLE_RATIO"):
        instrumentor.instrument()
    assert not torch.nn.modules.module._global_forward_pre_hooks


def _clean_env(**updates: str) -> dict[str, str]:
    env = checkout_env(**updates)
    return env


SCRIPT = """
import sys, torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
for _ in range(3):
    model(torch.randn(2, 4))
print("args", sys.argv[1:], "name", __name__)
sys.exit(int(sys.argv[1]))
"""


def _spans_in(trace_file: Path) -> list[dict]:
    return [
        span
        for line in trace_file.read_text().splitlines()
        for resource_spans in json.loads(line)["resourceSpans"]
        for scope_spans in resource_spans["scopeSpans"]
        for span in scope_spans["spans"]
    ]


@pytest.mark.parametrize("command", ["torchtrace-run", "opentelemetry-instrument"])
def test_a_script_is_traced_without_changing_it(tmp_path: Path, command: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / "traces.jsonl"
    if command == "torchtrace-run":
        argv = [sys.executable, "-m", "torchtrace", "run", "--trace-file", str(trace_file), str(script), "3", "x"]
    else:
        bin_dir = Path(sys.executable).parent
        argv = [str(bin_dir / "opentelemetry-instrument"), sys.executable, str(script), "3", "x"]
    env = _clean_env(TORCHTRACE_TRACE_FILE=str(trace_file), TORCHTRACE_EXPORTER="file")
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]  # the script's own exit status
    assert "args ['3', 'x'] name __main__" in result.stdout
    assert [span["name"] for span in _spans_in(trace_file)].count("Sequential") == 3
    if command == "torchtrace-run":  # the per-layer summary at exit
        assert "torchtrace: Sequential" in result.stderr
        assert any(line.startswith("Sequential") and " 3 " in line for line in result.stderr.splitlines())


def test_inference_server_request_spans_parent_the_model_spans() -> None:
    requests = 3
    with OtlpHttpReceiver() as receiver:
        server = subprocess.Popen(
            [sys.executable, "-m", "torchtrace", "run", "examples/inference_server.py", "--port", "0"]
            + ["--requests", str(requests)],
            cwd=ROOT,
            env=_clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="inference"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url = server.stdout.readline().split()[-1] + "/predict"  # "listening on http://127.0.0.1:PORT"
            for _ in range(requests):
                request = urllib.request.Request(
                    url,
                    data=json.dumps({"features": [[0.5] * 8, [1.0] * 8]}).encode(),
                    headers={"traceparent": f"00-{TRACEPARENT_TRACE_ID}-{TRACEPARENT_SPAN_ID}-01"},
                )
                reply = json.loads(urllib.request.urlopen(request, timeout=30).read())
                assert len(reply["probabilities"]) == 2
            _, stderr = server.communicate(timeout=60)
        finally:
            server.kill()
        assert server.returncode == 0, stderr[-3000:]
        spans = receiver.wait_for_spans(requests * 7, timeout=10)  # request + Classifier, body, 4 layers, head
    by_id = {span.span_id: span for span in spans}
    request_spans = [span for span in spans if span.name == "POST /predict"]
    model_spans = [span for span in spans if span.name != "POST /predict"]
    assert len(request_spans) == requests and len(model_spans) == requests * 7
    assert {span.trace_id.hex() for span in spans} == {TRACEPARENT_TRACE_ID}
    assert {span.parent_span_id.hex() for span in request_spans} == {TRACEPARENT_SPAN_ID}
    for span in model_spans:
        root = span
        while root.parent_span_id in by_id and by_id[root.parent_span_id].name != "POST /predict":
            root = by_id[root.parent_span_id]
        assert root.name == "Classifier"
        assert by_id[root.parent_span_id].name == "POST /predict"  # the model's root span: a child of the request
    assert "torchtrace: Classifier" in stderr


def test_config_shows_each_value_and_where_it_came_from(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TORCHTRACE_SAMPLE_EVERY", "4")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=secret")
    monkeypatch.setenv("TORCHTRACE_TRITON", "off")
    monkeypatch.setenv("TORCHTRACE_STEP_EVERY", "5")
    torchtrace.configure(cuda_events=False)
    assert main(["config", "--json", "--stats", "mean,max", "--stats-sample", "512"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["Training.schedule"] == {
        "name": "Training.schedule", "value": "every(5)", "source": "env TORCHTRACE_STEP_EVERY"
    }  # fmt: skip
    triton = rows["configure.triton"]
    assert (triton["value"], triton["source"]) == ("False", "env TORCHTRACE_TRITON")
    assert rows["configure.cuda_events"] == {"name": "configure.cuda_events", "value": "False", "source": "configure()"}
    assert rows["sample_every"] == {"name": "sample_every", "value": "4", "source": "env TORCHTRACE_SAMPLE_EVERY"}
    assert rows["Stats.names"] == {"name": "Stats.names", "value": "mean,max", "source": "keyword"}
    assert rows["Stats.sample"] == {"name": "Stats.sample", "value": "512", "source": "keyword"}
    assert rows["Stats.max_tensors"] == {"name": "Stats.max_tensors", "value": "8", "source": "default"}
    assert rows["Limits.max_pending_calls"]["source"] == "default"
    assert rows["OTEL_EXPORTER_OTLP_HEADERS"]["value"] == "(set, hidden)"
    assert "secret" not in json.dumps(rows)


def test_config_reports_an_invalid_variable_like_instrument_would(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TORCHTRACE_MAX_DEPTH", "deep")
    assert main(["config"]) == 2
    assert "TORCHTRACE_MAX_DEPTH='deep': expected an integer" in capsys.readouterr().err


def test_run_reports_the_scripts_own_error_as_python_does(tmp_path, capsys) -> None:
    script = tmp_path / "raises.py"
    script.write_text("raise TypeError('bad tensor shape in my script')\n")
    assert main(["run", str(script)]) == 1  # python's status for an uncaught exception; 2 is for our usage errors
    err = capsys.readouterr().err
    assert "Traceback" in err and "TypeError: bad tensor shape in my script" in err
    assert "torchtrace run: error" not in err


def test_run_refuses_a_missing_script(capsys) -> None:
    assert main(["run", "no_such_script.py"]) == 2
    assert "no such script" in capsys.readouterr().err


def test_the_exit_summary_names_a_model_that_is_already_gone():
    model = nn.Sequential(nn.Linear(2, 2))
    handle = torchtrace.instrument(model, exporter="none")
    model(torch.randn(1, 2))
    handle.remove()
    del model
    gc.collect()  # a script's globals are gone by the time `torchtrace run` prints its summaries
    err = io.StringIO()
    _print_summaries([handle], err)
    assert "torchtrace: Sequential (none exporter)" in err.getvalue()


# -- modules replaced after instrument() -----------------------------------------------------------------------


class Wrapped(nn.Module):
    """What an adapter does: a new module around the one it replaces, which it still calls."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


@pytest.mark.parametrize("replacement", ["another", "a-wrapper"])
def test_a_module_replaced_after_instrument_is_no_longer_traced_under_its_old_path(caplog, replacement):
    """A span never names a path that is no longer the module's: the replaced module (still called inside a wrapper)
    and the traced modules under it stop being traced as the replacement is registered, with one warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="torchtrace"), capture_spans(model) as captured:
        model(x)
        old = model[1]
        model[1] = Wrapped(old) if replacement == "a-wrapper" else nn.Tanh()
        model[2] = nn.Linear(4, 2)  # a second replacement: not warned of again
        expected = model(x)
        captured.handle.flush()
        second = [span for span in captured.spans() if span.context.trace_id != captured.spans()[0].context.trace_id]
        assert sorted(span.name for span in second) == ["0", "Sequential"]  # nothing under the old paths
        assert torch.equal(model(x), expected)  # and the model computes as it does untraced
    warnings = [r.getMessage() for r in caplog.records if "after instrument()" in r.getMessage()]
    assert len(warnings) == 1 and "1 (Sequential) of Sequential was replaced by" in warnings[0]
    assert "the 2 traced modules under it" in warnings[0]


def test_a_module_registered_again_in_its_own_place_stays_traced():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with capture_spans(model) as captured:
        model[1] = model[1]  # the same module: nothing replaced
        model(torch.randn(2, 4))
        assert sorted(captured.names()) == ["0", "1", "Sequential"]


def test_peft_applied_after_instrument_leaves_no_span_under_a_stale_path(caplog):
    """PEFT's get_peft_model after instrument() puts a LoRA layer where each targeted layer was; the base layer
    still runs inside it, and its spans would have carried the adapted layer's path and shown the frozen output."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    with caplog.at_level(logging.WARNING, logger="torchtrace"), capture_spans(model) as captured:
        adapted = peft.get_peft_model(model, peft.LoraConfig(target_modules=["c_attn"], r=2, init_lora_weights=False))
        adapted(torch.randint(0, 100, (1, 8)))
        names = captured.names()
        assert names and not any("c_attn" in name for name in names)
        assert "transformer.h.0.mlp.c_fc" in names  # what was not replaced is traced as before
    assert sum("transformer.h.0.attn.c_attn (Conv1D)" in r.getMessage() for r in caplog.records) == 1


def test_accelerate_hooks_added_and_removed_after_instrument_keep_the_module_traced_and_picklable():
    """accelerate wraps a module's forward in its own (``add_hook_to_module``: the traced forward inside it) and
    puts the one it found back (``remove_hook_from_module``): the module is traced under its path throughout, with
    its own output's statistics, and the model still pickles (``torch.save``)."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(2, 8)
    with capture_spans(model) as captured:
        hooks.add_hook_to_module(model[0], hooks.ModelHook())
        model(x)
        assert captured.names() == ["Sequential", "0", "1", "2"]
        hooks.remove_hook_from_module(model, recurse=True)
        captured.clear()
        model(x)
        assert captured.names() == ["Sequential", "0", "1", "2"]
        mean = captured.spans_named("0")[0].attributes["torchtrace.output.mean"]
        assert mean == pytest.approx(float(model[0](x).mean()), rel=1e-6)
        buffer = io.BytesIO()
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), model(x))


def test_a_module_replaced_behind_torchs_registration_hook_stops_being_traced_with_one_warning(caplog):
    """``quantize_dynamic(..., inplace=True)`` writes ``parent._modules`` directly, so torch calls no registration
    hook: the replaced layers are found at the next drain (the worker's, or flush()), stop being traced and are
    named once, as a ``setattr`` replacement is."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    with caplog.at_level(logging.WARNING, logger="torchtrace"), capture_spans(model) as captured:
        model(torch.randn(2, 8))
        torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
        captured.handle.flush()
        replaced = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
        assert len(replaced) == 1 and replaced[0].startswith("torchtrace: 0 (Linear) of Sequential was replaced")
        captured.clear()
        x = torch.randn(2, 8)
        expected = model(x)
        assert captured.names() == ["Sequential", "1"]
        mean = captured.spans_named("Sequential")[0].attributes["torchtrace.output.mean"]
        assert mean == pytest.approx(float(expected.mean()), rel=1e-6)


class Slow(nn.Module):
    """Two layers; between them its forward sets ``reached`` and waits for ``resume``: where another thread acts
    while a forward is half done."""

    def __init__(self, reached: threading.Event, resume: threading.Event) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.reached, self.resume = reached, resume

    def forward(self, x):
        x = self.first(x)
        self.reached.set()
        self.resume.wait(10)
        return self.second(torch.relu(x))


def test_remove_lets_a_forward_running_on_another_thread_finish_traced_whole():
    """remove() while another thread is inside a forward: no forward begins to be traced from then on, the running
    one is waited for (a second here) and delivered whole, then the hooks come out."""
    paused, go = threading.Event(), threading.Event()
    model = Slow(paused, go)
    with capture_spans(model) as captured:
        worker = threading.Thread(target=model, args=(torch.randn(2, 4),))
        worker.start()
        assert paused.wait(10)
        threading.Timer(0.2, go.set).start()
        captured.handle.remove()
        assert not worker.is_alive() or worker.join(10) is None
        assert sorted(captured.names()) == ["Slow", "first", "second"]
        model(torch.randn(2, 4))  # untraced now
        assert len(captured.names()) == 3


def test_instrument_and_remove_while_other_threads_run_forwards_leave_only_whole_traces():
    """Four threads run a model while it is instrumented and removed again and again: every trace holds all six of
    its spans under the model's root; none is a submodule's orphan span or a forward cut short by the hooks coming
    in or out (there were both)."""
    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            model(torch.randn(2, 8))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(30):
            handle = torchtrace.instrument(model, tracer_provider=provider)
            time.sleep(0.002)
            handle.remove()
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    traces: dict[int, list[str]] = {}
    for span in exporter.get_finished_spans():
        traces.setdefault(span.context.trace_id, []).append(span.name)
    assert traces
    assert all(sorted(names) == ["0", "1", "2", "2.0", "2.1", "Sequential"] for names in traces.values())


def test_a_forward_that_began_before_instrument_stays_untraced_as_a_whole():
    """instrument() on one thread while the model runs on another: the forward that began before it is not traced,
    and the submodules it calls afterwards make no traces of their own (they made one orphan span each)."""
    started, instrumented = threading.Event(), threading.Event()
    model = Slow(started, instrumented)  # instrument() happens while it waits, on the main thread
    outputs = []
    worker = threading.Thread(target=lambda: outputs.append(model(torch.randn(2, 4))))
    worker.start()
    assert started.wait(10)
    with capture_spans(model) as captured:
        instrumented.set()
        worker.join(10)
        model.second(torch.randn(2, 4))  # called on its own: a forward of its own, as always
        assert captured.names() == ["second"]
        model(torch.randn(2, 4))  # a forward that begins traced: whole
        assert sorted(captured.names()) == ["Slow", "first", "second", "second"]
    assert len(outputs) == 1
