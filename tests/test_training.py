"""Training: one trace per step with its forwards, a backward span per module, gradient statistics, schedules,
NaN/Inf provenance and torch.compile behaviour."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from nan_models import InjectNaN, bad_backward_model, nan_model
from opentelemetry.trace import StatusCode
from torch import nn

import torchtrace
from torchtrace.testing import capture_spans


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, handle=None, batch_s: float = 0.0) -> None:
    """``steps`` training steps; ``batch_s``: how long each step's batch takes to come (a data loader's wait)."""
    for _ in range(steps):
        time.sleep(batch_s)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if handle is not None:
            handle.step()


@contextlib.contextmanager
def metered_training(model: nn.Module, registry) -> Iterator[tuple]:
    """(handle, optimizer): ``model`` traced in training (backward, SGD's steps) with a MetricsSink on ``registry``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchtrace.instrument(
        model, exporter="none", backward=True, optimizer=optimizer, metrics=torchtrace.MetricsSink(registry)
    ) as handle:
        yield handle, optimizer


def test_a_step_is_one_trace_holding_its_forward_backward_and_optimizer_step():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        train(model, optimizer, steps=1)
        assert captured.tree() == {
            "train_step": {
                "data wait": {},
                "Sequential": {"0": {}, "1": {}, "2": {}},
                "backward": {"Sequential backward": {"2 backward": {}, "1 backward": {}, "0 backward": {}}},
                "optimizer.step": {},
            }
        }
        assert len({span.context.trace_id for span in captured.spans()}) == 1
        assert captured.span("train_step").attributes["torchtrace.step"] == 0


def test_each_step_gets_its_own_trace_and_number():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        train(model, optimizer, steps=3)
        steps = captured.spans_named("train_step")
        assert sorted(span.attributes["torchtrace.step"] for span in steps) == [0, 1, 2]
        assert len({span.context.trace_id for span in steps}) == 3
        assert captured.handle.step_number == 3


def test_backward_spans_time_the_backward_inside_the_step():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        train(model, optimizer, steps=1)
        step, forward = captured.span("train_step"), captured.span("Sequential")
        backward, optimizer_span = captured.span("backward"), captured.span("optimizer.step")
        assert step.start_time <= forward.start_time < forward.end_time <= backward.start_time
        assert backward.end_time <= optimizer_span.start_time < optimizer_span.end_time <= step.end_time
        container = captured.span("Sequential backward")
        for name in ("0 backward", "1 backward", "2 backward"):
            child = captured.span(name)
            assert container.start_time <= child.start_time <= child.end_time <= container.end_time
        # backward runs last layer first
        assert captured.span("2 backward").start_time <= captured.span("0 backward").start_time


def test_the_time_before_a_steps_first_forward_is_its_data_wait_phase():
    """What the loop does between two steps (the data loader's next batch, its copy to the device) is the "data
    wait" phase of the step it starts: from the step's start (the previous step's end; for the first, instrument())
    to its first forward. A micro-batch's loading inside a step (gradient accumulation) is not in it."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        train(model, optimizer, steps=3, batch_s=0.05)
        by_step = {}
        for name in ("train_step", "data wait", "Sequential"):
            for span in sorted(captured.spans_named(name), key=lambda span: span.start_time):
                by_step.setdefault(span.context.trace_id, {})[name] = span
    assert len(by_step) == 3
    for spans in by_step.values():
        step, wait, forward = spans["train_step"], spans["data wait"], spans["Sequential"]
        assert wait.parent.span_id == step.context.span_id
        assert wait.start_time == step.start_time and wait.end_time == forward.start_time
        assert wait.end_time - wait.start_time >= 50_000_000


def test_the_data_wait_counter_adds_up_each_steps_data_wait_span():
    """torchtrace_data_wait_seconds_total{model, rank}: a rank waiting on input, in Grafana, over time."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    model = mlp()
    with metered_training(model, registry) as (handle, optimizer):
        train(model, optimizer, steps=3, batch_s=0.03)
        handle.flush()
        waits = [call.end_ns - call.start_ns for call in handle.records if call.name == "data wait"]
    assert len(waits) == 3
    counted = registry.get_sample_value("torchtrace_data_wait_seconds_total", {"model": "Sequential", "rank": "0"})
    assert counted == pytest.approx(sum(waits) / 1e9) and counted >= 0.09


def test_gradient_statistics_equal_autograd_results():
    model = mlp()
    x = torch.randn(3, 4)
    outputs = {}

    def keep_output(module, args, output):
        output.retain_grad()
        outputs["linear2"] = output

    model[2].register_forward_hook(keep_output)
    with capture_spans(model, backward=True) as captured:
        loss = model(x).pow(2).sum()
        loss.backward()
        captured.handle.step()
        grad = outputs["linear2"].grad  # what autograd delivered to the last layer's output
        attributes = captured.span("2 backward").attributes
        assert attributes["torchtrace.grad_output.0.norm"] == pytest.approx(float(torch.linalg.vector_norm(grad)))
        assert attributes["torchtrace.grad_output.0.mean"] == pytest.approx(float(grad.mean()))
        assert attributes["torchtrace.grad_output.0.abs_max"] == pytest.approx(float(grad.abs().max()))
        assert attributes["torchtrace.grad_output.0.nan_count"] == 0


def test_gradients_get_the_statistics_named_in_stats_and_none_with_stats_off():
    """Backward spans carry the gradient statistics that ``stats`` names (of mean, abs_max, norm, nan_count,
    inf_count); ``stats=False`` leaves spans only, forward and backward, each backward span still timed."""
    model = mlp()
    for stats, expected in ((("norm", "std"), {"norm"}), (False, set())):
        with capture_spans(model, backward=True, stats=stats) as captured:
            model(torch.randn(3, 4)).pow(2).sum().backward()
            captured.handle.step()
            for name in ("2 backward", "0 backward"):
                span = captured.span(name)
                gradient_stats = {key.rsplit(".", 1)[1] for key in span.attributes if ".grad_" in key}
                assert gradient_stats == expected, (stats, name, dict(span.attributes))
                assert span.end_time > span.start_time


def test_parameter_and_parameter_gradient_norms_are_read_before_the_update():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = {}

    def remember(*_):
        first = model[0]
        seen["param"] = float(torch.linalg.vector_norm(torch.stack([p.detach().norm() for p in first.parameters()])))
        seen["grad"] = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in first.parameters()])))

    optimizer.register_step_pre_hook(remember)
    with capture_spans(
        model, backward=True, optimizer=optimizer, training=torchtrace.Training(param_stats=True)
    ) as captured:
        train(model, optimizer, steps=1)
        attributes = captured.span("0 backward").attributes
        assert attributes["torchtrace.param.norm"] == pytest.approx(seen["param"])
        assert attributes["torchtrace.param_grad.norm"] == pytest.approx(seen["grad"])


def test_in_place_modules_and_in_place_ops_do_not_break_backward_tracing():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            y = self.linear(x)
            y += x  # in-place on a traced module's output
            return self.act(y)

    model = Residual()
    x = torch.randn(2, 4, requires_grad=True)
    reference = Residual()
    reference.load_state_dict(model.state_dict())
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    with capture_spans(model, backward=True) as captured:
        model(x).sum().backward()
        captured.handle.step()
        assert {"Residual backward", "linear backward", "act backward"} <= set(captured.names())
    assert torch.equal(x.grad, x_ref.grad)  # tracing changed nothing in the gradients


def test_a_schedule_decides_which_steps_are_traced():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torchtrace.schedule(wait=1, warmup=1, active=2, repeat=1)
    with capture_spans(
        model, backward=True, optimizer=optimizer, training=torchtrace.Training(schedule=schedule)
    ) as captured:
        train(model, optimizer, steps=6)
        traced = sorted(span.attributes["torchtrace.step"] for span in captured.spans_named("train_step"))
        assert traced == [2, 3]
        assert len(captured.spans_named("Sequential")) == 2  # untraced steps leave no forward spans either


def test_schedule_semantics_step_by_step():
    cycle = torchtrace.schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    assert [cycle(step) for step in range(11)] == [
        False,
        False,
        False,
        True,
        True,
        False,
        False,
        True,
        True,
        False,
        False,
    ]
    assert [torchtrace.every(3)(step) for step in range(7)] == [True, False, False, True, False, False, True]
    forever = torchtrace.schedule(wait=2, active=1)
    assert [forever(step) for step in range(9)] == [False, False, True] * 3
    with pytest.raises(ValueError, match="active"):
        torchtrace.schedule(active=0)
    with pytest.raises(ValueError, match="every"):
        torchtrace.every(0)


@pytest.mark.parametrize(
    "arguments",
    [
        {"skip_first": 1, "wait": 1, "warmup": 1, "active": 2, "repeat": 2},
        {"wait": 3, "warmup": 1, "active": 1, "skip_first_wait": 1},
        {"skip_first": 2, "wait": 2, "warmup": 1, "active": 3, "repeat": 1, "skip_first_wait": 1},
    ],
)
def test_a_schedule_traces_exactly_the_steps_torch_profiler_records(arguments):
    from torch.profiler import ProfilerAction
    from torch.profiler import schedule as profiler_schedule

    ours, torchs = torchtrace.schedule(**arguments), profiler_schedule(**arguments)
    recorded = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
    assert [ours(step) for step in range(30)] == [torchs(step) in recorded for step in range(30)]


def test_a_manual_step_after_optimizer_step_is_not_another_step():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchtrace.instrument(model, exporter="none", optimizer=optimizer) as handle:
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()  # closes the step
            handle.step()  # as a script written without optimizer= also does: no empty extra step
        assert handle.step_number == 3


def test_step_without_step_tracing_is_a_clear_error():
    model = mlp()
    with torchtrace.instrument(model, exporter="none") as handle, pytest.raises(RuntimeError, match="step tracing"):
        handle.step()


def test_the_first_module_to_produce_nan_in_a_forward_is_marked():
    model = nan_model()
    with capture_spans(model) as captured:
        model(torch.randn(2, 4))
        culprit = captured.span("1")
        assert culprit.status.status_code is StatusCode.ERROR
        event = culprit.events[0]
        assert event.name == "exception"
        assert event.attributes["exception.type"] == "torchtrace._core.calls.NonFiniteError"
        assert "output" in event.attributes["exception.message"]
        # downstream layers and the container only pass the NaN on
        for name in ("0", "2", "3", "Sequential"):
            assert captured.span(name).status.status_code is StatusCode.UNSET, name


def nan_after(layers: int, width: int) -> nn.Sequential:
    """``layers`` Tanh, then layer ``layers`` puts a NaN into its (2, width // 2) output, then a ReLU."""
    return nn.Sequential(*[nn.Tanh() for _ in range(layers)], InjectNaN(), nn.ReLU())


@pytest.mark.parametrize(
    ("layers", "width"), [(1, 4), (8, 4), (1, 8192)], ids=["small-alone", "small-batched", "large"]
)
def test_the_first_module_to_produce_nan_is_marked_however_its_statistics_were_taken(layers, width):
    """Small tensors reduced one by one or together at the forward's end, large ones at once: each says whether it
    counted NaN or Inf, and only then are the forward's calls looked at for the first producer."""
    model = nan_after(layers, width)
    with capture_spans(model) as captured:
        model(torch.randn(2, width // 2))
        model[layers].armed = False
        model(torch.randn(2, width // 2))
        culprit, clean = captured.spans_named(str(layers))
        assert culprit.status.status_code is StatusCode.ERROR
        assert "produced 1 NaN and 0 Inf in its output" in culprit.status.description
        assert clean.status.status_code is StatusCode.UNSET
        others = [span for span in captured.spans() if span.name != str(layers)]
        assert all(span.status.status_code is StatusCode.UNSET for span in others)


def test_the_first_module_whose_backward_produces_nan_is_marked():
    model = bad_backward_model()
    with capture_spans(model, backward=True) as captured:
        model(torch.randn(2, 4)).sum().backward()
        captured.handle.step()
        assert captured.span("1 backward").status.status_code is StatusCode.ERROR
        assert "grad_input" in captured.span("1 backward").events[0].attributes["exception.message"]
        assert captured.span("2 backward").status.status_code is StatusCode.UNSET  # its gradients were fine
        assert captured.span("0 backward").status.status_code is StatusCode.UNSET  # it only received the NaN


def test_raise_mode_stops_training_at_the_step_naming_the_module():
    model = nan_model()
    with torchtrace.instrument(
        model, exporter="none", backward=True, stats=torchtrace.Stats(on_nonfinite="raise")
    ) as handle:
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(torchtrace.NonFiniteError, match=r"^1 produced NaN/Inf in output"):
            handle.step()


def test_callback_mode_receives_the_verdict_off_the_hot_path():
    model = nan_model()
    verdicts = []
    with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(on_nonfinite=verdicts.append)) as handle:
        model(torch.randn(2, 4))
        handle.flush()
    assert len(verdicts) == 1
    assert isinstance(verdicts[0], torchtrace.NonFiniteError)
    assert verdicts[0].call.path == "1"


def test_step_metrics_and_gradient_norms_reach_prometheus_metrics():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    model = mlp()
    with metered_training(model, registry) as (handle, optimizer):
        train(model, optimizer, steps=1)
        x = torch.randn(3, 4)
        hidden = model[0](x)  # what torch says of the last step's gradient reaching layer 0's output
        hidden.retain_grad()
        model[2](model[1](hidden.clone())).sum().backward()
        expected = float(torch.linalg.vector_norm(hidden.grad))
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.flush()
    labels = {"model": "Sequential", "rank": "0"}
    assert registry.get_sample_value("torchtrace_step_duration_seconds_count", labels) == 2
    norm = registry.get_sample_value("torchtrace_gradient_norm", {**labels, "module": "0", "module_type": "Linear"})
    assert norm == pytest.approx(expected, rel=1e-5)


class MLP(nn.Module):
    """mlp()'s layers in a model class of its own, as real models are (not a torch.nn container)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.act, self.last = nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.act(self.first(x)))


# Before torch 2.13 (seen on 2.11), dynamo does not compile a torch.nn container's forward (nn.Sequential's) as a
# frame of its own after the graph break of the model's hooks: such a model runs eagerly when compiled after
# instrument(). A model class of the user's own (every real model) compiles on all versions.
CONTAINERS_COMPILE = torch.__version__ >= "2.13"


@pytest.mark.parametrize("make", [MLP, mlp], ids=["model-class", "sequential"])
def test_a_model_compiled_after_instrumenting_is_traced_at_region_level_with_one_warning(make):
    if make is mlp and not CONTAINERS_COMPILE:
        pytest.skip("this torch runs a compiled container eagerly: see the test after this one")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = make()
    name = type(model).__name__
    with capture_spans(model) as captured:
        compiled = torch.compile(model, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(torch.randn(3, 4))
            graphs_after_first_call = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for _ in range(3):
                compiled(torch.randn(3, 4))
        assert captured.names() == [name] * 4  # region-level: the model's own span, per call
        ours = [w for w in caught if "torchtrace" in str(w.message)]
        assert len(ours) == 1 and "region level" in str(ours[0].message)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_first_call  # no recompiles
        # the root's hooks run outside the graph (the only graph breaks, if any); its modules' traced forwards fold
        # away: all three of the model's ops are compiled (how many frames around the break dynamo counts varies)
        breaks = list(torch._dynamo.utils.counters["graph_break"])
        assert all("_call_uncompiled" in reason for reason in breaks)  # how torchtrace calls the model's hooks
        assert torch._dynamo.utils.counters["stats"]["calls_captured"] == 3
        stats = captured.spans()[-1].attributes
        assert stats["torchtrace.output.shape"] == (3, 2) and math.isfinite(stats["torchtrace.output.mean"])
    torch._dynamo.reset()


def test_where_the_compiled_module_is_missing_torch_compiler_disable_keeps_the_models_hooks_outside(monkeypatch):
    monkeypatch.setattr(torchtrace._capture.recorder, "_UNCOMPILED", False)  # as where torchtrace._native is not built
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = MLP()
    with capture_spans(model) as captured:
        compiled = torch.compile(model, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                compiled(torch.randn(3, 4))
        assert captured.names() == ["MLP"] * 2
        assert [str(w.message) for w in caught if "torchtrace" in str(w.message)] != []
        assert torch._dynamo.utils.counters["stats"]["calls_captured"] == 3
    torch._dynamo.reset()


def test_instrumenting_and_tracing_do_not_import_torch_dynamo():
    """torch.compile's machinery (torch._dynamo, ~1-2.6 s to import) is left alone by a process that never compiles:
    the model's own hooks reach their compiled-region behaviour without it."""
    script = """
import sys, torch, torchtrace
from torch import nn
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
with torchtrace.instrument(model, exporter="none", backward=True) as handle:
    model(torch.randn(3, 4)).sum().backward()
    handle.step()
    handle.flush()
    assert len([record for record in handle.records if record.kind == "forward"]) == 4, handle.records
print("torch._dynamo" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.skipif(CONTAINERS_COMPILE, reason="this torch compiles a container's forward after the hooks' break")
def test_a_container_compiled_after_instrumenting_runs_eagerly_before_torch_2_13_traced_per_module():
    """What such a torch does with nn.Sequential compiled after instrument(): the model runs eagerly, every module
    traced, and its outputs are the untraced model's."""
    torch._dynamo.reset()
    model, reference = mlp(), mlp()
    x = torch.randn(3, 4)
    with capture_spans(model) as captured:
        compiled = torch.compile(model, backend="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            output = compiled(x)
        assert torch.equal(output, reference(x))
        assert captured.names() == ["Sequential", "0", "1", "2"]
    torch._dynamo.reset()


def test_a_model_compiled_before_instrumenting_is_traced_at_region_level_with_one_warning():
    torch._dynamo.reset()
    compiled = torch.compile(mlp(), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture_spans(compiled) as captured:
            for _ in range(3):
                compiled(torch.randn(3, 4))
            assert captured.names() == ["Sequential"] * 3
    assert len([w for w in caught if "torchtrace" in str(w.message)]) == 1
    torch._dynamo.reset()


def test_outputs_and_gradients_are_unchanged_by_backward_tracing():
    model, reference = mlp(), mlp()
    x = torch.randn(5, 4)
    reference(x).sum().backward()
    with torchtrace.instrument(
        model, exporter="none", backward=True, training=torchtrace.Training(param_stats=True)
    ) as handle:
        out = model(x)
        out.sum().backward()
        handle.step()
    assert torch.equal(out, reference(x))
    for traced, plain in zip(model.parameters(), reference.parameters()):
        assert torch.equal(traced.grad, plain.grad)


def test_a_step_that_is_never_closed_stays_bounded_and_counts_what_it_drops(caplog):
    model = mlp()
    with torchtrace.instrument(
        model, exporter="none", backward=True, limits=torchtrace.Limits(max_pending_calls=8)
    ) as handle:
        for _ in range(5):  # training forwards (gradients on), never backward: 4 calls each, two fit, three dropped
            model(torch.randn(2, 4))
        assert handle.dropped_calls == 12
        assert "handle.step()" in caplog.text
        handle.step()
        assert len([call for call in handle.records if call.kind == "forward"]) == 8


def test_the_summary_shares_are_of_the_forward_even_with_step_and_backward_rows():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchtrace.instrument(model, exporter="none", backward=True, optimizer=optimizer) as handle:
        train(model, optimizer, steps=2)
        rows = {row.path: row for row in handle.summary_rows()}
    assert rows["Sequential"].share == pytest.approx(1.0)
    assert rows["Sequential"].calls == 2 and rows["0 backward"].calls == 2 and rows["train_step"].calls == 2
    assert rows["0"].share < 1.0


# -- autograd beyond loss.backward() ------------------------------------------------------------------------------


def test_torch_autograd_grad_works_with_backward_tracing():
    model = mlp()
    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        x = torch.randn(3, 4, requires_grad=True)
        loss = model(x).square().sum()
        by_tracing = torch.autograd.grad(loss, [x, *model.parameters()], create_graph=True)  # e.g. a gradient penalty
        handle.step()
        assert handle.backward_records("2")  # traced
    expected = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    for got, want in zip(by_tracing, expected):
        assert torch.equal(got, want)


def test_gradient_accumulation_gives_each_micro_batch_its_own_backward_spans():
    model = mlp()
    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        for _ in range(2):  # two micro-batches, one step
            model(torch.randn(3, 4)).sum().backward()
        handle.step()
        first, second = handle.backward_records("0")  # the first layer: its hooks sit on its (leaf) parameters
        forwards = handle[""]
    assert first.end_ns <= forwards[1].start_ns  # not stretched to the second micro-batch's backward
    assert second.start_ns >= forwards[1].end_ns


def test_the_first_layers_backward_summarises_its_parameter_gradient_as_a_whole():
    model = mlp()
    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        model(torch.randn(3, 4)).sum().backward()  # the input needs no gradient: the parameters end the backward
        handle.step()
        (first,) = handle.backward_records("0")
    grad_inputs = {key for key in first.attributes if key.startswith("torchtrace.grad_input.")}
    assert grad_inputs == {
        f"torchtrace.grad_input.0.{stat}" for stat in ("mean", "abs_max", "norm", "nan_count", "inf_count")
    }
    norms = [float(parameter.grad.norm()) for parameter in model[0].parameters()]  # weight, bias
    assert any(first.attributes["torchtrace.grad_input.0.norm"] == pytest.approx(norm) for norm in norms)


def test_leaf_hooks_do_not_pile_up_when_steps_are_never_closed():
    model = mlp()
    with torchtrace.instrument(model, exporter="none", backward=True, limits=torchtrace.Limits(max_pending_calls=50)):
        for _ in range(100):
            model(torch.randn(3, 4)).sum().backward()  # no step(): forwards are dropped past max_pending_calls
        assert len(model[0].weight._backward_hooks or {}) <= 1


def test_a_checkpointed_module_recomputed_in_backward_is_not_a_second_forward():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(checkpoint(self.inner, x, use_reentrant=False))

    model = Checkpointed()
    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        handle.step()
        assert [call.path for call in handle.records if call.kind == "forward"] == ["", "inner", "head"]


def test_reading_records_while_a_step_is_open_says_once_how_to_close_it(caplog):
    model = mlp()
    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        model(torch.randn(3, 4)).sum().backward()
        assert handle.records == []  # the step is open: nothing delivered yet
        assert handle["0"] == []
        handle.step()
        assert handle["0"] and handle.backward_records("0")
    warnings = [record for record in caplog.records if "handle.step()" in record.getMessage()]
    assert len(warnings) == 1


# -- NaN/Inf provenance: who produced it, not who received it ----------------------------------------------------


def test_an_inf_gradient_made_by_the_loss_is_not_blamed_on_a_module():
    model = mlp()
    with torchtrace.instrument(
        model, exporter="none", backward=True, stats=torchtrace.Stats(on_nonfinite="raise")
    ) as handle:
        output = model(torch.randn(3, 4))
        (output - output.detach()).abs().sqrt().sum().backward()  # d sqrt(x)/dx at 0: Inf, made by the loss
        handle.step()  # no module produced it: nothing raised
        assert not any(isinstance(call.error, torchtrace.NonFiniteError) for call in handle.records)
        (last,) = handle.backward_records("2")
        infs = (
            last.attributes["torchtrace.grad_output.0.inf_count"]
            + last.attributes["torchtrace.grad_output.0.nan_count"]
        )
        assert infs > 0  # seen, and passed on: just not made by a module


def test_nan_already_in_the_models_input_is_not_blamed_on_the_first_layer_when_inputs_are_summarised():
    model = mlp()
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(inputs=True)) as handle:
        model(x)
        assert not any(isinstance(call.error, torchtrace.NonFiniteError) for call in handle.records)
        assert handle["0"][0].attributes["torchtrace.input.0.nan_count"] == 1  # seen where it came in
        assert handle["0"][0].attributes["torchtrace.output.nan_count"] > 0


def test_a_module_whose_output_got_no_gradient_has_no_backward_span():
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)
            self.aux = nn.Linear(4, 1)  # its output is left out of the loss

        def forward(self, x):
            h = self.body(x)
            return self.head(h), self.aux(h)

    model = TwoHeads()
    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        main, _ = model(torch.randn(2, 4))
        main.sum().backward()
        handle.step()
        assert handle.backward_records("head") and handle.backward_records("body")
        assert handle.backward_records("aux") == []  # its input's gradient arrived, but not through it


# -- several models, wrappers --------------------------------------------------------------------------------------


def test_a_model_cannot_be_instrumented_again_inside_a_wrapper():
    model = mlp()
    with torchtrace.instrument(model, exporter="none"):
        wrapper = nn.Sequential(model)  # as DistributedDataParallel(model) or torch.compile(model) wrap it
        with pytest.raises(ValueError, match="part of"):
            torchtrace.instrument(wrapper, exporter="none")
        with pytest.raises(ValueError, match="part of"):
            torchtrace.instrument(model[0], exporter="none")
    torchtrace.instrument(wrapper, exporter="none").remove()  # fine once the first handle is gone


def test_two_models_trained_in_one_job_get_their_own_step_traces(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "TORCHTRACE_RUN_ID": "job"}.items():
        monkeypatch.setenv(name, value)
    generator, discriminator = mlp(), mlp()
    with (
        torchtrace.instrument(generator, exporter="none", backward=True) as g,
        torchtrace.instrument(discriminator, exporter="none", backward=True) as d,
    ):
        for model, handle in ((generator, g), (discriminator, d)):
            model(torch.randn(3, 4)).sum().backward()
            handle.step()
        steps = [[call for call in handle.records if call.kind == "step"] for handle in (g, d)]
    (g_root, g_rank), (d_root, d_rank) = steps  # rank 0 sends the root and its rank span
    assert g_root.trace_id != d_root.trace_id
    assert len({g_root.span_id, g_rank.span_id, d_root.span_id, d_rank.span_id}) == 4


def test_a_tensor_between_two_layers_gets_one_gradient_hook_and_one_summary_for_both_spans():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    between = {}

    def keep_output(module, args, output):  # registered after torchtrace's: runs once its hooks are in place
        between["tanh"] = output

    with capture_spans(model, backward=True) as captured:
        model[1].register_forward_hook(keep_output)
        loss = model(torch.randn(3, 4)).pow(2).sum()
        tanh_output = between["tanh"]
        # the Tanh made it (its backward starts there), the last Linear took it in (its backward ends there)
        assert len(tanh_output._backward_hooks) == 1
        tanh_output.retain_grad()
        loss.backward()
        captured.handle.step()
        grad = tanh_output.grad
        made, received = captured.span("2 backward").attributes, captured.span("1 backward").attributes
        for statistic, expected in (
            ("norm", float(torch.linalg.vector_norm(grad))),
            ("mean", float(grad.mean())),
            ("abs_max", float(grad.abs().max())),
        ):
            assert made[f"torchtrace.grad_input.0.{statistic}"] == pytest.approx(expected)
            assert received[f"torchtrace.grad_output.0.{statistic}"] == made[f"torchtrace.grad_input.0.{statistic}"]
        # one moment: the gradient's arrival ends one span and starts the other
        assert captured.span("2 backward").end_time == captured.span("1 backward").start_time


def test_a_tensor_taken_in_by_two_layers_ends_both_backward_spans():
    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.left, self.right = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.stem(x)
            return self.left(hidden) + self.right(hidden)

    torch.manual_seed(0)
    model = Fork()
    with capture_spans(model, backward=True) as captured:
        model(torch.randn(3, 4)).sum().backward()
        captured.handle.step()
        stem, left, right = (captured.span(f"{name} backward") for name in ("stem", "left", "right"))
        # the stem's output gradient is the sum of both branches' input gradients: it arrives after both ended
        assert left.end_time <= stem.start_time and right.end_time <= stem.start_time
        assert "torchtrace.grad_input.0.norm" in left.attributes and "torchtrace.grad_input.0.norm" in right.attributes


def test_a_layers_output_is_freed_after_backward_while_its_step_is_still_open():
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    kept = []

    def keep_reference(module, args, output):
        kept.append(weakref.ref(output))

    with torchtrace.instrument(model, exporter="none", backward=True) as handle:
        model[1].register_forward_hook(keep_reference)
        for _ in range(3):  # micro-batches accumulating into one step
            model(torch.randn(3, 4)).sum().backward()
        gc.collect()
        # the step keeps its spans' hooks until it closes, not the tensors they watched
        assert [reference() for reference in kept] == [None, None, None]
        handle.step()
        assert len([call for call in handle.records if call.name == "1 backward"]) == 3


def test_the_users_own_gradient_hooks_run_beside_torchtraces_and_none_of_torchtraces_outlive_the_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    seen, between = [], {}

    def keep_output(module, args, output):
        between["tanh"] = output
        between["handle"] = output.register_hook(lambda grad: seen.append(("tanh", grad.clone())))

    with capture_spans(model, backward=True) as captured:
        model[1].register_forward_hook(keep_output)
        weight_handle = model[0].weight.register_hook(lambda grad: seen.append(("weight", grad.clone())))
        loss = model(torch.randn(3, 4)).pow(2).sum()
        tanh_output = between["tanh"]
        tanh_output.retain_grad()
        loss.backward()
        captured.handle.step()
        assert [name for name, _ in seen] == ["tanh", "weight"]
        assert torch.equal(seen[0][1], tanh_output.grad) and torch.equal(seen[1][1], model[0].weight.grad)
        assert captured.span("1 backward").attributes["torchtrace.grad_output.0.norm"] == pytest.approx(
            float(torch.linalg.vector_norm(tanh_output.grad))
        )
        # what is left on the tensors is the user's own (and retain_grad's), theirs to remove
        assert len(model[0].weight._backward_hooks) == 1
        weight_handle.remove()
        between["handle"].remove()
        assert not model[0].weight._backward_hooks


def test_a_tensor_subclass_output_gets_its_backward_span_through_its_own_register_hook():
    class Tagged(torch.Tensor):
        registered = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.register_hook:
                cls.registered += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    class TaggedTanh(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x).as_subclass(Tagged)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), TaggedTanh(), nn.Linear(8, 2))
    with capture_spans(model, backward=True) as captured:
        model(torch.randn(3, 4)).pow(2).sum().backward()
        captured.handle.step()
        assert Tagged.registered >= 1
        assert captured.span("1 backward").end_time <= captured.span("0 backward").start_time


def test_an_optimizer_wrapped_by_accelerate_closes_each_step():
    """HF's Trainer and ``accelerator.prepare`` hand out an ``AcceleratedOptimizer`` (a torch Optimizer without step
    hooks of its own, wrapping the one that steps): passed as ``optimizer=``, each of its steps closes a traced
    step, as the optimizer inside would."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        for _ in range(3):
            accelerator.backward(model(torch.randn(3, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
        steps = [span for span in captured.spans() if span.name == "train_step"]
        assert len(steps) == 3
        assert len({span.context.trace_id for span in steps}) == 3
        assert sum(span.name == "optimizer.step" for span in captured.spans()) == 3


def test_something_that_is_no_optimizer_is_refused_as_one():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        torchtrace.instrument(mlp(), exporter="none", backward=True, optimizer=object())


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_an_evaluation_between_steps_is_a_trace_of_its_own(grad_off):
    """A validation forward (gradients off) between training steps is not merged into the next step: each step
    holds its one training forward, the evaluation is a trace of its own, and no step is left over at the end."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        for step in range(4):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 2 == 1:
                with grad_off():
                    model(torch.randn(5, 4))
        captured.handle.flush()
        steps = captured.spans_named("train_step")
        assert len(steps) == 4
        roots = captured.spans_named("Sequential")
        in_steps = [span for span in roots if span.parent is not None]
        on_their_own = [span for span in roots if span.parent is None]
        assert len(in_steps) == 4 and {span.parent.span_id for span in in_steps} == {
            span.context.span_id for span in steps
        }
        assert len(on_their_own) == 2
        assert {span.context.trace_id for span in on_their_own}.isdisjoint(span.context.trace_id for span in steps)
        assert all(span.attributes["torchtrace.output.shape"] == (5, 2) for span in on_their_own)
        assert captured.handle.step_number == 4  # the evaluations opened no step
    assert len(captured.spans_named("train_step")) == 4  # and remove() delivered no step made of one


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.1),
        lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=1),
    ],
    ids=["sgd", "lbfgs"],
)
def test_a_closure_optimizer_keeps_forward_backward_and_optimizer_apart(make_optimizer):
    """``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization) runs the forward and backward inside
    the optimizer's call: the optimizer.step span starts where they ended, so it does not contain them, and says
    how many forwards its closure ran and how long the whole call took."""
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    x = torch.randn(3, 4)

    def closure():
        optimizer.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        for _ in range(2):
            optimizer.step(closure)
        steps = captured.spans_named("train_step")
        assert len(steps) == 2
        for step in steps:
            step_id = step.context.span_id
            by_name = {span.name: span for span in captured.spans() if span.parent and span.parent.span_id == step_id}
            forward, backward, update = by_name["Sequential"], by_name["backward"], by_name["optimizer.step"]
            assert update.start_time >= max(forward.end_time, backward.end_time)
            assert update.attributes["torchtrace.optimizer.closure_forwards"] == 1
            call_seconds = update.attributes["torchtrace.optimizer.call_seconds"]
            assert call_seconds * 1e9 >= (update.end_time - update.start_time) + (forward.end_time - forward.start_time)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_modules_have_backward_spans_or_a_warning_that_says_why_not(caplog, reentrant):
    """torch.utils.checkpoint with use_reentrant=False keeps the checkpointed modules' backward spans; with
    use_reentrant=True they run with gradients off (and again inside backward, where nothing is traced): their
    backward is not traced, and one warning says so and what to use instead."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    head = nn.Linear(4, 2)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = block, head

        def forward(self, x):
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=reentrant)
            return self.head(x)

    model = Model()
    x = torch.randn(3, 4, requires_grad=True)
    with caplog.at_level("WARNING", logger="torchtrace"), capture_spans(model, backward=True) as captured:
        for _ in range(2):
            model(x).sum().backward()
            captured.handle.step()
        names = set(captured.names())
    warnings = [r for r in caplog.records if "use_reentrant=False keeps" in r.getMessage()]
    assert "head backward" in names
    if reentrant:
        assert "block backward" not in names and len(warnings) == 1 and "block" in warnings[0].getMessage()
    else:
        assert {"block backward", "block.0 backward"} <= names and not warnings


def test_sample_every_and_sample_ratio_pick_training_steps():
    """In training the step is what is traced: sample_every=N traces every N-th step (as schedule=every(N)), and
    sample_ratio a share of steps chosen by the step number alone, the same on every rank; schedule= wins."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(model, backward=True, optimizer=optimizer, sample_every=5) as captured:
        train(model, optimizer, steps=20)
        steps = captured.spans_named("train_step")
        assert sorted(span.attributes["torchtrace.step"] for span in steps) == [0, 5, 10, 15]
    traced_steps = []
    for _ in range(2):  # two ranks (two models and handles) trace the same steps
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with capture_spans(model, backward=True, optimizer=optimizer, sample_ratio=0.5) as captured:
            train(model, optimizer, steps=40)
            traced_steps.append(sorted(s.attributes["torchtrace.step"] for s in captured.spans_named("train_step")))
    assert traced_steps[0] == traced_steps[1] and 10 <= len(traced_steps[0]) <= 30
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_spans(
        model, optimizer=optimizer, sample_every=5, training=torchtrace.Training(schedule=torchtrace.every(2))
    ) as captured:
        train(model, optimizer, steps=4)
        assert sorted(s.attributes["torchtrace.step"] for s in captured.spans_named("train_step")) == [0, 2]
