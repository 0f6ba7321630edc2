"""Modules inside the model are traced through their ``forward`` (one Python call; torch's hooks would send every call
down nn.Module's slow path): the module still behaves as itself to everything that looks at it, a copy computes
with its own parameters, and torch keeps the fast paths that hooks switch off."""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import weakref

import torch
from instrumented import traced_modules
from torch import nn

import torchtrace
from torchtrace.testing import capture_spans


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_a_traced_forward_has_the_modules_own_signature():
    model = mlp()
    expected = inspect.signature(model[0].forward)
    with torchtrace.instrument(model, exporter="none"):
        assert "forward" in model[0].__dict__  # traced through its forward
        assert inspect.signature(model[0].forward) == expected  # what HF's Trainer and generate() read


def test_a_deep_copy_of_a_traced_model_computes_with_its_own_parameters_and_is_traced():
    model = mlp()
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        twin = copy.deepcopy(model)  # e.g. an EMA copy made while the model is traced
        with torch.no_grad():
            for parameter in twin.parameters():
                parameter.mul_(-2)
        untraced = mlp()
        with torch.no_grad():
            for parameter in untraced.parameters():
                parameter.mul_(-2)
        assert torch.equal(twin(x), untraced(x))
        assert torch.equal(model(x), mlp()(x))  # the original is untouched by the copy
        assert [record.path for record in handle.records] == ["", "0", "1", "2"] * 2  # both traced, as hooks are
    assert torch.equal(twin(x), untraced(x))  # after remove() the copy still computes, untraced
    assert len(handle.records) == 8


def test_a_traced_models_state_dict_saves_and_loads_and_the_whole_module_pickles_once_removed(tmp_path):
    model, other = mlp(), mlp()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(-2)
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        torch.save(other.state_dict(), tmp_path / "other.pt")
        model.load_state_dict(torch.load(tmp_path / "other.pt"))  # into the traced model: its forwards read them
        assert torch.equal(model(x), other(x))
        torch.save(model.state_dict(), tmp_path / "model.pt")
        assert [record.path for record in handle.records] == ["", "0", "1", "2"]
    assert torch.equal(torch.load(tmp_path / "model.pt")["0.weight"], other[0].weight)
    torch.save(model, tmp_path / "whole.pt")  # the module itself: once remove() took the hooks and forwards out
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert "forward" not in loaded[0].__dict__ and not loaded._forward_pre_hooks and not loaded._forward_hooks
    assert torch.equal(loaded(x), other(x))


def test_a_model_dropped_without_remove_is_freed_at_once():
    model = mlp()
    handle = torchtrace.instrument(model, exporter="none")
    model(torch.randn(2, 4))
    model_ref = weakref.ref(model)
    gc.disable()  # freed by reference counting, with no cycle for the collector to find
    try:
        del model
        assert model_ref() is None
    finally:
        gc.enable()
    handle.remove()


def test_a_forward_another_library_set_on_the_instance_is_traced_through_hooks_and_kept():
    model = mlp()
    x = torch.randn(2, 4)
    calls: list[int] = []

    def offloaded_forward(module: nn.Linear, tensor: torch.Tensor) -> torch.Tensor:  # as accelerate's hooks do
        calls.append(1)
        return nn.Linear.forward(module, tensor)

    replaced = functools.partial(offloaded_forward, model[0])
    model[0].forward = replaced
    with capture_spans(model) as captured:
        expected_output = mlp()(x)
        assert torch.equal(model(x), expected_output)
        assert captured.names() == ["Sequential", "0", "1", "2"]
    assert model[0].__dict__["forward"] is replaced and len(calls) == 1
    assert traced_modules(model) == []


def test_a_forward_set_over_ours_survives_remove_and_runs_the_module_untraced():
    model = mlp()
    x = torch.randn(2, 4)
    handle = torchtrace.instrument(model, exporter="none")
    ours = model[0].forward
    model[0].forward = lambda tensor: ours(tensor) * 1  # another library wraps the forward it finds
    handle.remove()
    assert torch.equal(model(x), mlp()(x))
    assert model[0].forward(x).shape == (2, 8)
    assert len(handle.records) == 0


def test_torch_keeps_the_fused_encoder_layer_when_it_is_traced():
    """Any forward hook on a TransformerEncoderLayer or its sub-modules turns torch's fused inference path off."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, batch_first=True)
    model = nn.Sequential(nn.Linear(16, 16), layer).eval()
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        expected = model(x)
        with capture_spans(model) as captured:
            got = model(x)
    assert torch.equal(got, expected)  # the same kernels: bit for bit
    assert captured.names() == ["Sequential", "0", "1"]  # fused: the layer's sub-modules are not called


def test_a_sub_module_called_on_its_own_is_traced_as_its_own_forward():
    model = mlp()
    with capture_spans(model) as captured:
        model[2](torch.randn(2, 8))
    assert captured.names() == ["2"]
    assert captured.spans()[0].parent is None


def test_torch_export_of_a_traced_model_holds_only_the_models_ops():
    model = mlp()
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        exported = torch.export.export(model, (x,))
        targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
        assert targets == {"aten.linear.default", "aten.relu.default"}  # no statistic, no clock read
        assert handle.records == []  # export's tracing run is not a forward of the model
    assert torch.equal(exported.module()(x), model(x))


def test_a_forward_that_is_no_plain_method_keeps_torchs_hooks():
    class Doubled(nn.Module):
        forward = staticmethod(lambda x: x * 2)  # called without the module

    class Scaled(nn.Module):
        forward = functools.partial(torch.mul, other=3.0)  # a partial is no method: called without the module

    model = nn.Sequential(Doubled(), Scaled())
    with capture_spans(model) as captured:
        assert torch.equal(model(torch.ones(2)), torch.full((2,), 6.0))
        assert captured.names() == ["Sequential", "0", "1"]
        assert "forward" not in model[0].__dict__ and len(model[0]._forward_hooks) == 1
    assert traced_modules(model) == []
