"""Modules inside the model are traced through their ``forward`` (one Python call; torch's hooks would send every call
down nn.Module's slow path): the module still behaves as itself to everything that looks at it, a copy computes
with its own parameters, and torch keeps the fast paths that hooks switch off."""

from __future__ import annotations

import copy
import functools
import gc
import importlib
import inspect
import threading
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


def negated_times(model: nn.Module, factor: float) -> nn.Module:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-factor)
    return model


def negated_twice(model: nn.Module) -> nn.Module:
    return negated_times(model, 2)


def test_a_deep_copy_of_a_traced_model_computes_with_its_own_parameters_untraced():
    model = mlp()
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        twin = negated_twice(copy.deepcopy(model))  # e.g. an EMA copy made while the model is traced
        assert torch.equal(twin(x), negated_twice(mlp())(x))
        assert torch.equal(model(x), mlp()(x))  # the original is untouched by the copy
        assert [record.path for record in handle.records] == ["", "0", "1", "2"]  # the original's forward alone
        assert traced_modules(twin) == [] and not twin._forward_hooks and not twin._forward_pre_hooks
        assert torchtrace.instrument(twin, exporter="none").remove() is None  # a model of its own to trace


def test_a_shallow_copy_of_a_traced_module_runs_as_itself():
    """copy.copy shares the parameters, not the plain attributes: the copy's own `training` flag decides."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)).eval()
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        dropout = copy.copy(model[1]).train()
        hidden = model[0](x)
        assert torch.equal(model[1](hidden), hidden)  # the traced original, in eval: no dropout
        torch.manual_seed(1)
        dropped = dropout(hidden)
        torch.manual_seed(1)
        assert torch.equal(dropped, nn.functional.dropout(hidden, 0.5, training=True))  # the copy trains
        assert (dropped == 0).any()
        assert "forward" not in dropout.__dict__ and "__getstate__" not in dropout.__dict__
        assert [record.path for record in handle.records] == ["0", "1"]  # the copy's call is not the model's


def test_a_traced_model_saves_whole_and_loads_untraced_and_stays_traced(tmp_path):
    """torch.save(model) (the module object, not its state dict) as a checkpoint in a traced training job."""
    model, other = mlp(), negated_twice(mlp())
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        torch.save(other.state_dict(), tmp_path / "other.pt")
        model.load_state_dict(torch.load(tmp_path / "other.pt"))  # into the traced model: its forwards read them
        assert torch.equal(model(x), other(x))
        torch.save(model.state_dict(), tmp_path / "model.pt")
        torch.save(model, tmp_path / "whole.pt")
        model(x)
        assert [record.path for record in handle.records] == ["", "0", "1", "2"] * 2  # still traced after saving
    assert torch.equal(torch.load(tmp_path / "model.pt")["0.weight"], other[0].weight)
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert traced_modules(loaded) == [] and not loaded._forward_pre_hooks and not loaded._forward_hooks
    assert all("__getstate__" not in module.__dict__ for module in loaded.modules())
    assert torch.equal(loaded(x), other(x))
    torch.save(model, tmp_path / "removed.pt")  # and after remove(), as any module
    assert torch.equal(torch.load(tmp_path / "removed.pt", weights_only=False)(x), other(x))
    assert all("__getstate__" not in module.__dict__ for module in model.modules())


def test_data_parallels_replicas_each_run_their_own_parameters_traced(monkeypatch):
    """nn.DataParallel copies each module's instance dict into a replica per GPU at every forward: a replica's traced
    forward runs the replica (the original's would compute with GPU 0's weights on another GPU's input). torch's own
    replicate() here, its CUDA broadcast swapped for per-replica CPU copies (this machine has no GPUs)."""
    replicate_module = importlib.import_module("torch.nn.parallel.replicate")  # the package's name is the function

    def broadcast(tensors, devices, detach=False):  # replica j's parameters: the original's times -(j + 1)
        return [[(tensor * -(j + 1)).detach() for tensor in tensors] for j in range(len(devices))]

    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast)
    model = mlp()
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        replicas = replicate_module.replicate(model, [0, 1])
        outputs: dict[int, torch.Tensor] = {}
        threads = [threading.Thread(target=lambda j=j: outputs.update({j: replicas[j](x)})) for j in range(2)]
        for thread in threads:  # one thread per replica, as DataParallel's parallel_apply runs them
            thread.start()
        for thread in threads:
            thread.join()
        for j, output in outputs.items():
            assert torch.equal(output, negated_times(mlp(), j + 1)(x))
        assert torch.equal(model(x), mlp()(x))  # the original keeps its own
        assert sorted(record.path for record in handle.records) == sorted(["", "0", "1", "2"] * 3)
        assert all(traced_modules(replica) for replica in replicas)  # its hooks and forwards trace it
    assert traced_modules(model) == []


def test_a_parametrized_module_deep_copies_its_own_instance_dict_and_the_copy_is_traced_as_itself():
    """torch's parametrized modules deep-copy their __dict__ (not __getstate__, which refuses to pickle): the copy
    keeps torchtrace's forward, which then runs the copy, as torch's deep-copied hooks would."""

    class Doubled(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * 2

    model = mlp()
    nn.utils.parametrize.register_parametrization(model[0], "weight", Doubled())
    x = torch.randn(3, 4)
    with torchtrace.instrument(model, exporter="none") as handle:
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin[0].parametrizations.weight.original.mul_(-1)
        expected = nn.functional.linear(x, -2 * model[0].parametrizations.weight.original, model[0].bias)
        assert torch.equal(twin[0](x), expected)  # the copy's weight, not the original's
        assert twin[0].__getstate__.module_ref() is twin[0]
        assert [record.path for record in handle.records] == ["0"]


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
