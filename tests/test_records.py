"""The in-memory records API, in the style of spikingjelly's monitors: ``handle["layer"]`` lists the calls of one
module, ``handle.records`` all calls in call order, with what the user's functions made of each output and input."""

from __future__ import annotations

import gc
from dataclasses import fields

import pytest
import torch
from seed_models import TestForHook as SeedModel
from torch import nn

import torchtrace
from torchtrace import CompressedTensor, ModuleCall


class TestForHook(SeedModel):
    """The seeds' model returning only its final output tensor."""

    __test__ = False

    def forward(self, x):
        return super().forward(x)[0]


HOOK_PATHS = ["", "linear_1", "linear_2", "relu", "relu6"]


class Spike(nn.Module):
    """A spiking neuron: integrates into ``v``, fires where ``v`` crosses ``v_threshold``, then resets."""

    def __init__(self, v_threshold: float = 1.0) -> None:
        super().__init__()
        self.v_threshold = v_threshold
        self.v = torch.zeros(())
        self.tau = torch.tensor(2.0)  # a one-element tensor attribute

    def forward(self, x):
        self.v = self.v + x
        spikes = (self.v >= self.v_threshold).float()
        self.v = self.v * (1 - spikes)
        return spikes


def record(**options) -> tuple[TestForHook, torchtrace.TraceHandle]:
    model = TestForHook()
    return model, torchtrace.instrument(model, exporter="none", **options)


def x_of(value: float) -> torch.Tensor:
    return torch.full((2, 2), value)


def linear_1_mean(value: float) -> float:
    return 2 * value + 1  # Linear(2, 2) with unit weights and bias


# -- records per module and in call order --------------------------------------------------------------------------


def test_records_per_module_path():
    model, handle = record()
    with handle:
        model(x_of(0.1))
        model(x_of(1.0))
        calls = handle["linear_1"]
        assert [type(call) for call in calls] == [ModuleCall, ModuleCall]
        assert [call.attributes["torchtrace.output.mean"] for call in calls] == [pytest.approx(1.2), pytest.approx(3.0)]
        assert [call.attributes["torchtrace.output.mean"] for call in handle["linear_2"]] == [
            pytest.approx(3.4),
            pytest.approx(7.0),
        ]
        with pytest.raises(KeyError, match="not_a_layer"):  # a typo, not a silent empty list (a dict would raise too)
            handle["not_a_layer"]
        ids = [call.span_id for call in handle.records]
        assert handle[0].span_id == ids[0] and [call.span_id for call in handle[-2:]] == ids[-2:]  # by position


def test_records_are_in_call_order_with_depth_and_parents():
    model, handle = record()
    with handle:
        model(x_of(0.1))
        model(x_of(0.1))
        records = handle.records
    assert [call.path for call in records] == HOOK_PATHS * 2
    assert [call.depth for call in records[:5]] == [0, 1, 1, 1, 1]
    root = records[0]
    assert all(call.parent_span_id == root.span_id and call.trace_id == root.trace_id for call in records[1:5])
    assert records[5].trace_id != root.trace_id
    assert all(call.start_ns <= call.end_ns for call in records)
    assert root.name == "TestForHook" and records[1].name == "linear_1"


def test_monitored_layers_lists_the_traced_module_paths():
    model, handle = record()
    with handle:
        assert handle.monitored_layers == HOOK_PATHS


# -- which modules --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"types": nn.ReLU}, ["relu"]),  # ReLU6 is a Hardtanh, not a ReLU
        ({"types": (nn.ReLU, nn.ReLU6)}, ["relu", "relu6"]),
        ({"types": nn.Linear}, ["linear_1", "linear_2"]),
        ({"include": "linear_*"}, ["linear_1", "linear_2"]),
        ({"include": ["relu", "linear_2"]}, ["linear_2", "relu"]),
        ({"exclude": "relu*"}, ["", "linear_1", "linear_2"]),
        ({"include": "*_?", "exclude": "linear_2"}, ["linear_1"]),
        ({"max_depth": 0}, [""]),
        ({"max_depth": 1}, HOOK_PATHS),
    ],
)
def test_module_selection(options, expected):
    model, handle = record(**options)
    with handle:
        assert handle.monitored_layers == expected
        model(x_of(0.1))
        assert [call.path for call in handle.records] == expected
        # without the model's own span, each selected call is an outermost call
        if "" not in expected:
            assert all(call.depth == 0 and call.parent_span_id == 0 for call in handle.records)


def test_max_depth_on_nested_modules():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU())), nn.Linear(2, 2))
    with torchtrace.instrument(model, exporter="none", max_depth=2) as handle:
        assert handle.monitored_layers == ["", "0", "0.0", "0.1", "1"]
        model(torch.ones(1, 2))
        assert [(call.path, call.depth) for call in handle.records] == [
            ("", 0),
            ("0", 1),
            ("0.0", 2),
            ("0.1", 2),
            ("1", 1),
        ]


# -- user functions -------------------------------------------------------------------------------------------------


def test_function_on_output_stores_the_firing_rate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 6), Spike(), nn.Linear(6, 4), Spike())
    x = torch.rand(3, 2, 4) * 2
    with torchtrace.instrument(
        model,
        exporter="none",
        types=Spike,
        records=torchtrace.Records(function_on_output=lambda y: y.flatten(1).mean(1)),
    ) as handle:
        with torch.no_grad():
            hidden = model[1](model[0](x))
        model[2].v = torch.zeros(())  # the reference call above did not touch the neurons: start them at rest
        spikes_1 = (hidden >= 1.0).float()
        with torch.no_grad():
            model(x)
        assert handle.monitored_layers == ["2", "4"]
        (first,) = handle["2"]
        assert torch.equal(first.output_value, spikes_1.flatten(1).mean(1))
        assert handle["4"][0].output_value.shape == (3,)
        assert all(0 <= rate <= 1 for rate in handle["4"][0].output_value.tolist())


def test_function_on_input_stores_its_result():
    model, handle = record(include="linear_*", records=torchtrace.Records(function_on_input=lambda x: x.sum()))
    with handle:
        model(x_of(0.5))
        assert handle["linear_1"][0].input_value.item() == pytest.approx(2.0)
        assert handle["linear_2"][0].input_value.item() == pytest.approx(4 * linear_1_mean(0.5))
        assert handle["linear_1"][0].output_value is None


def test_a_failing_user_function_does_not_break_the_forward_nor_the_statistics():
    def broken(y):
        raise RuntimeError("user function bug")

    model, handle = record(
        stats=torchtrace.Stats(inputs=True),
        records=torchtrace.Records(function_on_output=broken, function_on_input=broken),
    )
    with handle:
        out = model(x_of(0.1))
        assert out.flatten().tolist() == [pytest.approx(3.4)] * 2
        assert [call.path for call in handle.records] == HOOK_PATHS
        attributes = handle["linear_1"][0].attributes
        assert attributes["torchtrace.output.stats_error"] == "RuntimeError: user function bug"
        assert attributes["torchtrace.input.stats_error"] == "RuntimeError: user function bug"
        assert attributes["torchtrace.output.mean"] == pytest.approx(linear_1_mean(0.1))  # the other features stay
        assert attributes["torchtrace.input.0.mean"] == pytest.approx(0.1)
        assert handle["linear_1"][0].output_value is None


def test_a_failing_feature_leaves_a_shared_summary_of_the_same_tensor_alone():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x):
            return self.inner(x)  # the same tensor: one cached summary for both calls

    def broken_for_inner(y):
        if broken_for_inner.calls == 0:
            broken_for_inner.calls += 1
            raise RuntimeError("only once")
        return "ok"

    broken_for_inner.calls = 0
    model = Outer()
    with torchtrace.instrument(
        model, exporter="none", records=torchtrace.Records(function_on_output=broken_for_inner)
    ) as handle:
        model(torch.ones(1, 2))
        inner, outer = handle["inner"][0], handle[""][0]
    assert inner.attributes["torchtrace.output.stats_error"] == "RuntimeError: only once"
    assert "torchtrace.output.stats_error" not in outer.attributes
    assert outer.attributes["torchtrace.output.mean"] == inner.attributes["torchtrace.output.mean"]
    assert outer.output_value == "ok"


# -- enable / disable / clear --------------------------------------------------------------------------------------


def test_disable_records_nothing_and_enable_records_again():
    model, handle = record()
    with handle:
        assert handle.enabled
        handle.disable()
        assert not handle.enabled
        out = model(x_of(0.1))
        assert out.flatten().tolist() == [pytest.approx(3.4)] * 2  # still computes
        assert handle.records == []
        handle.enable()
        model(x_of(1.0))
        assert [call.path for call in handle.records] == HOOK_PATHS
        assert handle["linear_1"][0].attributes["torchtrace.output.mean"] == pytest.approx(3.0)


def test_clear_recorded_data_forgets_everything_recorded_so_far():
    model, handle = record()
    with handle:
        model(x_of(0.1))
        handle.clear_recorded_data()
        assert handle.records == []
        assert handle["linear_1"] == []
        model(x_of(1.0))
        assert [call.attributes["torchtrace.output.mean"] for call in handle["linear_1"]] == [pytest.approx(3.0)]


def test_max_records_keeps_the_latest_calls():
    model, handle = record(records=torchtrace.Records(max_records=7))
    with handle:
        for value in (0.0, 1.0, 2.0):
            model(x_of(value))
        records = handle.records
        assert len(records) == 7
        # the last 7 of 15 calls: the last three of the second forward, all five of the third
        assert [call.path for call in records] == HOOK_PATHS[3:] + HOOK_PATHS
        assert [call.attributes["torchtrace.output.mean"] for call in handle["linear_1"]] == [
            pytest.approx(linear_1_mean(2.0))
        ]
        assert len(handle["relu"]) == 2


# -- module attributes, inputs, captured tensors ---------------------------------------------------------------------


def test_module_attributes_are_recorded_after_each_call():
    model = nn.Sequential(nn.Linear(4, 4), Spike(v_threshold=0.5))
    nn.init.ones_(model[0].weight)
    nn.init.zeros_(model[0].bias)
    x = torch.tensor([[0.1, 0.0, 0.0, 0.0]])  # 0.1 into every neuron: fires on the 5th step
    with torchtrace.instrument(
        model, exporter="none", types=Spike, records=torchtrace.Records(module_attributes=("v_threshold", "v", "tau"))
    ) as h:
        for _ in range(2):
            with torch.no_grad():
                model(x)
        first, second = h["1"]
        assert first.module_attributes["v_threshold"] == 0.5
        assert torch.allclose(first.module_attributes["v"], torch.full((1, 4), 0.1))
        assert torch.allclose(second.module_attributes["v"], torch.full((1, 4), 0.2))
        assert first.module_attributes["tau"] == 2.0  # a one-element tensor is read as a number
        # span attributes take the scalar ones only
        assert first.attributes["torchtrace.module_attribute.v_threshold"] == 0.5
        assert first.attributes["torchtrace.module_attribute.tau"] == 2.0
        assert "torchtrace.module_attribute.v" not in first.attributes


def test_module_attributes_before_the_call_and_through_a_function_as_attribute_monitor_does():
    model = nn.Sequential(nn.Linear(4, 4), Spike(v_threshold=0.5))
    nn.init.ones_(model[0].weight)
    nn.init.zeros_(model[0].bias)
    x = torch.tensor([[0.1, 0.0, 0.0, 0.0]])
    with torchtrace.instrument(
        model,
        exporter="none",
        types=Spike,
        records=torchtrace.Records(
            module_attributes="v",
            attributes_before_forward=True,  # spikingjelly's AttributeMonitor(pre_forward=True)
            function_on_attribute=lambda v: v.sum().item() if isinstance(v, torch.Tensor) else v,
        ),
    ) as handle:
        for _ in range(3):
            with torch.no_grad():
                model(x)
        assert [call.module_attributes["v"] for call in handle["1"]] == [
            pytest.approx(0.0),  # before the first call
            pytest.approx(0.4),
            pytest.approx(0.8),
        ]


def test_gradient_functions_as_grad_output_and_grad_input_monitors_have_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    twin = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    twin.load_state_dict(model.state_dict())
    seen = []  # what spikingjelly's monitors see: full backward hooks on an untraced twin
    twin[1].register_full_backward_hook(lambda module, grad_input, grad_output: seen.append((grad_input, grad_output)))
    x = torch.randn(3, 4)
    twin(x).sum().backward()
    with torchtrace.instrument(
        model,
        exporter="none",
        backward=True,
        records=torchtrace.Records(
            function_on_grad_output=torch.norm,  # GradOutputMonitor(function_on_grad_output=torch.norm)
            function_on_grad_input=torch.norm,  # GradInputMonitor(function_on_grad_input=torch.norm)
        ),
    ) as handle:
        model(x).sum().backward()
        handle.step()
        (tanh,) = handle.backward_records("1")
    (grad_input,), (grad_output,) = seen[0]
    assert tanh.output_value.item() == pytest.approx(torch.norm(grad_output).item())
    assert tanh.input_value.item() == pytest.approx(torch.norm(grad_input).item())


def test_a_failing_gradient_function_is_reported_on_the_backward_span():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def broken(grad):
        raise RuntimeError("bad gradient function")

    with torchtrace.instrument(
        model, exporter="none", backward=True, records=torchtrace.Records(function_on_grad_output=broken)
    ) as handle:
        model(torch.randn(2, 4)).sum().backward()  # the backward itself is unharmed
        handle.step()
        (tanh,) = handle.backward_records("1")
    assert tanh.attributes["torchtrace.grad_output.stats_error"] == "RuntimeError: bad gradient function"
    assert tanh.attributes["torchtrace.grad_output.0.norm"] > 0  # the statistics stay


def test_module_attribute_copies_count_against_the_capture_budget():
    model = Spike()
    with torchtrace.instrument(
        model, exporter="none", records=torchtrace.Records(module_attributes="v", capture_max_bytes=3 * 16)
    ) as handle:
        for _ in range(4):
            model(torch.ones(4))  # v: 4 float32 values, 16 bytes copied per call
        copies = [call.module_attributes["v"] for call in handle[""]]
    assert [copy is not None for copy in copies] == [True, True, True, False]
    assert handle.skipped_captures == 1


def test_module_attribute_copies_go_back_to_the_budget_when_their_record_leaves():
    model = Spike()
    records = torchtrace.Records(module_attributes="v", capture_max_bytes=2 * 16, max_records=1)
    with torchtrace.instrument(model, exporter="none", records=records) as handle:
        for _ in range(4):
            model(torch.ones(4))
            handle.flush()  # the previous record leaves: its 16 bytes are free again
        assert handle.skipped_captures == 0
        assert handle[""][-1].module_attributes["v"] is not None


def test_module_attributes_reach_the_span():
    from torchtrace.testing import capture_spans

    model = Spike(v_threshold=0.75)
    with capture_spans(model, records=torchtrace.Records(module_attributes="v_threshold")) as captured:
        model(torch.ones(3))
        assert captured.span("Spike").attributes["torchtrace.module_attribute.v_threshold"] == 0.75


def test_input_statistics_are_recorded_when_inputs_is_on():
    model, handle = record(stats=torchtrace.Stats(inputs=True))
    with handle:
        model(x_of(0.1))
        linear_2 = handle["linear_2"][0].attributes
        assert linear_2["torchtrace.input.0.mean"] == pytest.approx(1.2)
        assert linear_2["torchtrace.input.0.shape"] == (2, 2)
        assert handle[""][0].attributes["torchtrace.input.0.max"] == pytest.approx(0.1)


def test_tensors_are_not_captured_by_default():
    model, handle = record()
    with handle:
        model(x_of(0.1))
        assert all(call.tensors is None for call in handle.records)


def test_captured_tensors_are_copies_of_each_output():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(3, 4)
    with torch.no_grad():
        linear_out = model[0](x)
    with (
        torchtrace.instrument(model, exporter="none", records=torchtrace.Records(capture_tensors=True)) as handle,
        torch.no_grad(),
    ):
        out = model(x)
        assert torch.equal(handle["0"][0].tensors[""], linear_out)  # before the in-place ReLU
        assert torch.equal(handle["1"][0].tensors[""], out)


def test_captured_tensors_stay_within_capture_max_bytes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # every output: 4 float32 = 16 bytes
    x = torch.randn(1, 4)
    with torchtrace.instrument(
        model, exporter="none", records=torchtrace.Records(capture_tensors=True, capture_max_bytes=40)
    ) as handle:
        model(x)
        # outputs are captured as modules return: "0" (16 bytes) and "1" (32) fit, "2" and the model (48) do not
        assert {call.path: sorted(call.tensors) for call in handle.records} == {"": [], "0": [""], "1": [""], "2": []}
        assert handle.skipped_captures == 2
        model(x)
        assert all(call.tensors == {} for call in handle.records[4:])  # the budget is spent
        assert handle.skipped_captures == 6
        handle.clear_recorded_data()  # ... until the recorded data is cleared
        model(x)
        assert sorted(call.path for call in handle.records if call.tensors) == ["0", "1"]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5),
        torch.randn(4, 6).t(),  # not contiguous
        torch.tensor([1.0, float("nan"), float("-inf"), -0.0]),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(2, 3).half(),
        torch.arange(-5, 5, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),
        torch.empty(0, 2),
        torch.randn(3, dtype=torch.complex64),
    ],
    ids=["f32", "non-contiguous", "non-finite", "bf16", "f16", "int64", "bool", "0-dim", "empty", "complex"],
)
def test_compressed_captures_round_trip_bit_exact(tensor):
    class Emit(nn.Module):
        def forward(self):
            return tensor

    module = Emit()
    with torchtrace.instrument(
        module, exporter="none", records=torchtrace.Records(capture_tensors=True, capture_compress=True)
    ) as handle:
        module()
        compressed = handle.records[0].tensors[""]
    assert isinstance(compressed, CompressedTensor)
    restored = compressed.tensor()
    assert restored.dtype == tensor.dtype
    assert restored.shape == tensor.shape
    assert bits(restored) == bits(tensor)


def bits(tensor: torch.Tensor) -> list[int]:
    return tensor.contiguous().reshape(-1).view(torch.uint8).tolist()


def test_the_capture_budget_is_given_back_when_records_leave():
    model, handle = record(
        include="linear_1", records=torchtrace.Records(capture_tensors=True, capture_max_bytes=3 * 16, max_records=2)
    )
    with handle:
        for value in (0.1, 0.2, 0.3, 0.4):
            model(x_of(value))  # 16 bytes captured per forward; two records kept, a third in flight
            handle.flush()  # records leave as calls arrive (the worker does this every export interval)
        means = [call.tensors[""].mean().item() for call in handle["linear_1"]]
        assert means == [pytest.approx(linear_1_mean(value)) for value in (0.3, 0.4)]
        assert (handle.skipped_captures, handle.dropped_records) == (0, 2)


def test_handle_of_gives_back_a_handle_that_was_not_kept():
    model = TestForHook()
    torchtrace.instrument(model, exporter="none")  # the handle is not kept: tracing goes on
    with pytest.raises(ValueError, match="handle_of"):
        torchtrace.instrument(model, exporter="none")
    torchtrace.handle_of(model).remove()
    assert torchtrace.handle_of(model) is None
    torchtrace.instrument(model, exporter="none").remove()  # free to instrument again


def test_kept_records_cost_the_garbage_collector_nothing() -> None:
    """Records live long: kept as ModuleCall objects (and attribute dicts) they would be promoted by the thousand
    to the oldest generation and trigger full collections of the whole heap (benchmarks/latency.py)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torchtrace.instrument(model, exporter="none", records=torchtrace.Records(max_records=3000)) as handle:
        for _ in range(20):  # warm-up: whatever the first calls create once
            model(torch.randn(2, 4))
        handle.clear_recorded_data()
        gc.collect()
        tracked_before = len(gc.get_objects())
        for _ in range(1000):
            model(torch.randn(2, 4))
        handle.flush()
        gc.collect()
        grown = len(gc.get_objects()) - tracked_before
        records = handle.records
    assert len(records) == 3000 and {call.path for call in records} == {"", "0", "1"}
    assert grown < 300  # 3,000 records kept, not one tracked object each


@pytest.fixture(params=["compiled", "python"])
def untracking(request, monkeypatch):
    """Records made where ``torchtrace._native`` is built (a forward's tuple untracked as it is made), and without it
    (CPython untracks it at the first young collection it survives)."""
    from torchtrace._core import calls as _calls
    from torchtrace._sinks import records as _records

    if request.param == "compiled" and _calls.untracked.__module__ != "torchtrace._native":
        pytest.skip("torchtrace._native is not built here")
    if request.param == "python":
        monkeypatch.setattr(_calls, "untracked", lambda t: t)
        monkeypatch.setattr(_records, "untracked", lambda t: t)
    return request.param


def test_a_young_collection_does_not_visit_the_kept_forwards(untracking) -> None:
    """A forward's record is one tuple of thousands of numbers. While it is tracked, each young collection visits
    every one of them: 0.6-0.9 ms a collection, one every ~20 forwards of a 129-call model with statistics (the tail
    of benchmarks/latency.py). Built, torchtrace hands the collector none; without the extension, a record leaves the
    collector's lists in the first two young collections it survives."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)])  # a forward's record: 41 calls, ~700 values
    with torchtrace.instrument(model, exporter="none") as handle:
        model(torch.randn(2, 4))
        handle.flush()
        gc.collect()
        gc.disable()  # no collection in between: what the next young collection would find
        try:
            for _ in range(30):
                model(torch.randn(2, 4))
            handle.flush()
            young = [o for o in gc.get_objects(generation=0) if type(o) is tuple]
            # a forward's values (~700), and the records holding its columns (a tuple of 41 calls each)
            young_tuples = [o for o in young if len(o) > 200 or any(type(i) is tuple and len(i) == 41 for i in o)]
            del young
            gc.collect(0)
            gc.collect(1)  # the second young collection they survive: a tuple holding tuples goes one after them
            still_tracked = [len(o) for o in young_tuples if gc.is_tracked(o)]
        finally:
            gc.enable()
        assert len(handle.records) == 31 * 41
    assert still_tracked == []
    if untracking == "compiled":
        assert young_tuples == []
    else:
        assert len(young_tuples) >= 30  # a record (and its values) per forward waited for the collector


def test_a_record_reads_back_field_by_field_as_it_was_delivered() -> None:
    delivered = []
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torchtrace.instrument(
        model, exporter="none", sinks=[delivered.extend], records=torchtrace.Records(module_attributes="weight")
    ) as handle:
        model(torch.randn(2, 4))
        records = handle.records
    assert len(records) == len(delivered) == 3
    for kept, original in zip(records, delivered):
        for field in fields(ModuleCall):
            value = getattr(kept, field.name)
            if field.name == "module_attributes":
                assert value.keys() == original.module_attributes.keys()
            else:
                assert value == getattr(original, field.name), field.name


def test_records_of_forwards_traced_without_statistics_read_back_as_delivered() -> None:
    """Such a forward is kept as one packed tuple of its columns; reading it back gives the calls delivered, past
    max_records too (a forward cut in two)."""
    delivered = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))  # 5 calls a forward
    with torchtrace.instrument(
        model, exporter="none", stats=False, sinks=[delivered.extend], records=torchtrace.Records(max_records=12)
    ) as handle:
        for _ in range(4):
            model(torch.randn(2, 4))
        handle.flush()
        records, inner, second = handle.records, handle["1.0"], handle[1]
    assert len(records) == 12 and handle.dropped_records == 8
    for kept, original in zip(records, delivered[-12:], strict=True):
        for field in fields(ModuleCall):
            assert getattr(kept, field.name) == getattr(original, field.name), field.name
    assert [call.span_id for call in inner] == [call.span_id for call in delivered[-12:] if call.path == "1.0"]
    assert second.span_id == delivered[-11].span_id


def test_a_forward_cut_again_and_again_by_max_records_reads_back_as_its_latest_calls() -> None:
    """A full store drops part of the oldest forward at each batch, then more of what is left of it: what stays
    reads back as the latest calls delivered, in order."""
    delivered = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))  # 5 calls a forward
    with torchtrace.instrument(
        model, sinks=[delivered.extend], exporter="none", records=torchtrace.Records(max_records=8)
    ) as handle:
        for call in (model, model, model[0], model[0], model, model[0]):  # 5, 5, then 1 call at a time
            call(torch.randn(2, 4))
            handle.flush()  # one batch each: every batch past 8 calls cuts the oldest forward again
            kept = handle.records
            assert len(kept) == min(8, len(delivered))
            for record, original in zip(kept, delivered[-8:], strict=True):
                assert (record.path, record.span_id, record.attributes) == (
                    original.path, original.span_id, original.attributes)  # fmt: skip
    assert handle.dropped_records == len(delivered) - 8 == 10


class Emit(nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def forward(self) -> object:
        return self.value


class WithQuietChild(nn.Module):
    """Three calls with statistics and one whose output is no tensor (a call with only its module path and type)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.quiet = Emit(None)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.quiet()
        return self.relu(self.linear(x))


def test_records_of_forwards_with_statistics_read_back_as_delivered() -> None:
    """Such a forward is kept as one packed tuple of its columns and its calls' attributes; reading it back gives
    the calls delivered, attribute values and their types included, past max_records too (a forward cut in two)."""
    delivered = []
    model = WithQuietChild()
    with torchtrace.instrument(
        model, exporter="none", sinks=[delivered.extend], records=torchtrace.Records(max_records=10)
    ) as handle:
        for _ in range(4):
            model(torch.randn(2, 4))
        handle.flush()
        records, linear = handle.records, handle["linear"]
    assert len(records) == 10 and handle.dropped_records == 6
    for kept, original in zip(records, delivered[-10:], strict=True):
        for field in fields(ModuleCall):
            assert getattr(kept, field.name) == getattr(original, field.name), field.name
        assert list(kept.attributes.items()) == list(original.attributes.items())
        assert [type(value) for value in kept.attributes.values()] == [
            type(value) for value in original.attributes.values()
        ]
    assert records[-3].attributes == {"torchtrace.module.path": "quiet", "torchtrace.module.type": "Emit"}
    assert [call.span_id for call in linear] == [call.span_id for call in delivered[-10:] if call.path == "linear"]
    assert linear[-1].attributes["torchtrace.output.nan_count"] == 0
