"""instrument() is all or nothing: when it raises part way (a TorchScript module cannot take hooks), every hook it
added is gone, the model computes exactly as before, and a retry with a compatible selection traces normally."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn
from torch.nn.modules import module as torch_module

import torchtrace
from torchtrace import MetricsSink
from torchtrace._handle import _live_handles

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), torch.jit.script(nn.Linear(4, 4)), nn.Linear(4, 2))


def _hooks_left(model: nn.Module) -> dict[str, int]:
    counts = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            continue
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, kind):
                counts[f"{path}.{kind}"] = len(getattr(module, kind))
        if "forward" in module.__dict__:
            counts[f"{path}.forward"] = 1
    for kind in GLOBAL_HOOKS:
        if getattr(torch_module, kind):
            counts[kind] = len(getattr(torch_module, kind))
    return counts


def _workers() -> int:
    return sum(thread.name == "torchtrace-dispatch" for thread in threading.enumerate())


@pytest.mark.parametrize(
    "options",
    [
        {"exporter": "none"},
        {"exporter": "file", "metrics": "own sink", "backward": True},
        {"exporter": "none", "optimizer": "sgd"},
    ],
    ids=["plain", "file-metrics-backward", "optimizer"],
)
def test_a_failed_instrument_leaves_nothing_behind(tmp_path, options):
    model = _model()
    x = torch.randn(3, 4)
    expected = model(x)
    globals_before = _hooks_left(nn.Module())
    workers, handles = _workers(), len(_live_handles)
    options = dict(options, trace_file=str(tmp_path / "t.jsonl"))
    optimizer = None
    if options.get("optimizer") == "sgd":
        optimizer = options["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    if options.get("metrics") == "own sink":
        options["metrics"] = MetricsSink(registry=CollectorRegistry())

    with pytest.raises(RuntimeError, match="ScriptModule"):
        torchtrace.instrument(model, **options)

    assert _hooks_left(model) == globals_before == {}
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert torchtrace.handle_of(model) is None
    assert (_workers(), len(_live_handles)) == (workers, handles)
    assert torch.equal(model(x), expected)

    # a compatible selection (the scripted module left out) traces, and its remove() leaves no hook either; a
    # MetricsSink the failed call had claimed serves the retry
    retry = {"metrics": options["metrics"]} if "metrics" in options else {}
    with torchtrace.instrument(model, exporter="none", exclude="2", **retry) as handle:
        assert torch.equal(model(x), expected)
        assert [call.path for call in handle.records] == ["", "0", "1", "3"]
    assert _hooks_left(model) == {}
    assert torch.equal(model(x), expected)
