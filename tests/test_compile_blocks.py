"""Per-block torch.compile: ``block.compile()`` on each of a model's identical blocks (the usual LLM recipe), before
or after ``instrument()``. Traced, the blocks compile exactly as untraced (dynamo's own counters: graphs, graph breaks,
frames), every block call runs its compiled code (more blocks than dynamo's recompile limit, 8: a graph per block would
leave the later ones uncompiled), outputs are bitwise the untraced ones, and each block call is one span with the
statistics of the block's output."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from torchtrace.testing import capture_spans

BLOCKS = 12
assert torch._dynamo.config.recompile_limit < BLOCKS  # a graph per block would run the later blocks uncompiled


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net() -> tuple[nn.Module, nn.ModuleList, list, Callable]:
    torch.manual_seed(1)
    inputs = [torch.randn(2, 5, 8) for _ in range(3)]
    model = Net().eval()
    return model, model.blocks, inputs, model


def gpt2() -> tuple[nn.Module, nn.ModuleList, list, Callable]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    inputs = [torch.randint(0, 64, (2, 7)) for _ in range(3)]
    config = transformers.GPT2Config(
        n_layer=BLOCKS, n_embd=32, n_head=2, n_positions=32, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    # use_cache=False: a KV cache guards on each layer's state, a graph per block untraced too
    return model, model.transformer.h, inputs, lambda x: model(x, use_cache=False).logits


class CountingBackend:
    """dynamo's "eager" backend, counting the graphs it was given and the calls of their compiled code."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1

        def run(*args: torch.Tensor) -> object:
            self.calls += 1
            return graph.forward(*args)

        return run


def run_compiled_blocks(make: Callable, traced: str | None) -> dict:
    """The model's blocks compiled one by one (``traced``: instrument()ed "before" or "after" they are, or None),
    three forwards; dynamo's counters, the outputs and the spans."""
    torch._dynamo.reset()
    counters.clear()
    model, blocks, inputs, run = make()
    backend = CountingBackend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if traced == "after":
            with capture_spans(model) as captured:
                for block in blocks:
                    block.compile(backend=backend)
                outputs, names, spans = _forwards(run, inputs, captured)
        else:
            for block in blocks:
                block.compile(backend=backend)
            if traced == "before":
                with capture_spans(model) as captured:
                    outputs, names, spans = _forwards(run, inputs, captured)
            else:
                outputs, names, spans = _forwards(run, inputs, None)
    result = {
        "graphs": counters["stats"]["unique_graphs"],
        "graph breaks": sum(counters["graph_break"].values()),
        "frames": dict(counters["frames"]),
        "backend graphs": backend.graphs,
        "compiled block calls": backend.calls,
        "outputs": outputs,
        "names": names,
        "spans": spans,
        "warnings": [str(w.message) for w in caught if "torchtrace" in str(w.message)],
        "dynamo warnings": [str(w.message) for w in caught if "torchtrace" not in str(w.message)],
    }
    torch._dynamo.reset()
    return result


def _forwards(run: Callable, inputs: list, captured) -> tuple[list, list, list]:
    outputs, names, spans = [], [], []
    with torch.no_grad():
        for x in inputs:
            outputs.append(run(x))
            if captured is not None:
                names.append(captured.names())
                spans.append(captured.spans())
                captured.clear()
    return outputs, names, spans


def block_outputs(make: Callable) -> list[list[torch.Tensor]]:
    """Each forward's block outputs, from the model run uncompiled and untraced (torch's hooks)."""
    model, blocks, inputs, run = make()
    seen: list[torch.Tensor] = []
    handles = [block.register_forward_hook(lambda _m, _a, output: seen.append(output)) for block in blocks]
    per_forward = []
    with torch.no_grad():
        for x in inputs:
            run(x)
            per_forward.append(list(seen))
            seen.clear()
    for handle in handles:
        handle.remove()
    return per_forward


@pytest.mark.parametrize(
    "traced", ["before", "after"], ids=["compiled-then-instrumented", "instrumented-then-compiled"]
)
@pytest.mark.parametrize("make", [net, gpt2], ids=["module-list", "gpt2"])
def test_blocks_compiled_one_by_one_compile_as_untraced_and_are_traced_a_span_per_block_call(make, traced):
    untraced = run_compiled_blocks(make, None)
    # the recipe compiles all identical blocks to one graph untraced: every block call runs compiled code
    assert untraced["graphs"] == 1 and untraced["graph breaks"] == 0
    assert untraced["compiled block calls"] == BLOCKS * 3
    result = run_compiled_blocks(make, traced)
    for figure in ("graphs", "graph breaks", "frames", "backend graphs", "compiled block calls"):
        assert result[figure] == untraced[figure], figure
    assert not any("recompile" in message or "torchtrace" in message for message in result["dynamo warnings"])
    for output, expected in zip(result["outputs"], untraced["outputs"]):
        assert torch.equal(output, expected)  # bitwise
    model, blocks, _, _ = make()
    paths = [name for name, module in model.named_modules() if module in set(blocks)]
    references = block_outputs(make)
    for names, spans, outputs in zip(result["names"], result["spans"], references):
        # the blocks' own spans, one per call; none for the modules inside a compiled block
        assert [name for name in names if name.startswith(paths[0].rpartition(".")[0] + ".")] == paths
        by_name = {span.name: span for span in spans}
        for path, output in zip(paths, outputs):
            attributes = by_name[path].attributes
            assert attributes["torchtrace.output.shape"] == tuple(output.shape)
            assert attributes["torchtrace.output.mean"] == pytest.approx(float(output.mean()), rel=1e-6, abs=1e-9)
            assert attributes["torchtrace.output.std"] == pytest.approx(float(output.std()), rel=1e-6)
            assert attributes["torchtrace.output.max"] == float(output.max())
            assert attributes["torchtrace.output.min"] == float(output.min())
    assert len(result["warnings"]) == 1 and "traced as a whole" in result["warnings"][0]


def test_a_block_compiled_with_torch_compile_in_its_place_is_traced_as_a_whole():
    """``model.blocks[i] = torch.compile(block)`` before instrument(): the OptimizedModule keeps torch's hooks (they
    run before its compiled code), spans named by the block's own path and class; nothing inside it is traced."""
    torch._dynamo.reset()
    counters.clear()
    model, reference = Net().eval(), Net().eval()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="eager")
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with capture_spans(model) as captured, torch.no_grad():
            for _ in range(3):
                output = model(x)
            names = captured.names()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with torch.no_grad():
        assert torch.allclose(output, reference(x))
    assert [name for name in names if name.startswith("blocks.")] == [f"blocks.{i}" for i in range(BLOCKS)] * 3
    assert {span.attributes["torchtrace.module.type"] for span in captured.spans_named("blocks.0")} == {"Block"}
    torch._dynamo.reset()


def test_remove_puts_back_the_compiled_call_and_copies_carry_none_of_ours():
    torch._dynamo.reset()
    model = Net().eval()
    compiled = {}
    for block in model.blocks:
        block.compile(backend="eager")
        compiled[block] = block._compiled_call_impl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with capture_spans(model) as captured:
            block = model.blocks[0]
            assert block._compiled_call_impl is not compiled[block]  # ours, around it
            state = block.__getstate__()  # torch's own leaves the compiled call out: copies are uncompiled
            assert state.get("_compiled_call_impl", compiled[block]) is compiled[block] and "compile" not in state
            assert "forward" not in block.__dict__ and "forward" not in block.up.__dict__  # nothing inside traced
            copy.deepcopy(model)
            with torch.no_grad():
                model(torch.randn(2, 5, 8))
            assert len(captured.names()) == 1 + 1 + BLOCKS + 1
    for block in model.blocks:
        assert block._compiled_call_impl is compiled[block] and "compile" not in block.__dict__
    torch._dynamo.reset()


def test_a_block_compiled_again_after_instrument_is_traced_around_its_new_compiled_call():
    torch._dynamo.reset()
    model = Net().eval()
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture_spans(model) as captured, torch.no_grad():
            model(x)
            assert "blocks.0.up" in captured.names()  # traced per module while uncompiled
            captured.clear()
            model.blocks[0].compile(backend="eager")
            model.blocks[0].compile(backend="eager")
            model(x)
            assert "blocks.0" in captured.names() and "blocks.0.up" not in captured.names()
            assert "blocks.1.up" in captured.names()  # the others are still traced per module
            assert captured.names().count("blocks.0") == 1
    assert len([w for w in caught if "compiled after instrument()" in str(w.message)]) == 1
    assert "compile" not in model.blocks[0].__dict__ and "forward" not in model.blocks[1].__dict__
    torch._dynamo.reset()
