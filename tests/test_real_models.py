"""Real models (HuggingFace GPT-2 and BERT built from small configs, no download; an LSTM with several outputs):
traces well formed (tests/conftest.py checks every captured trace), backward spans nested like the forward,
gradient statistics per output equal to the gradients an untraced twin receives."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
from torch import nn

from torchtrace._capture.stats import find_tensors
from torchtrace.testing import capture_spans, check_traces


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(config)


def bert_classifier() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def gradients_reaching_outputs(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """(module path, output name) -> the gradient reaching that output in the next backward, by torch's own tensor
    hooks on an untraced model (a bare tensor output is named "0", as torchtrace names it)."""
    grads: dict[tuple[str, str], torch.Tensor] = {}

    def keep(key: tuple[str, str], grad: torch.Tensor | None) -> None:
        if grad is not None:  # an output that got no gradient
            grads.setdefault(key, grad)

    def watch(path: str):
        def hook(module: nn.Module, inputs: object, output: object) -> None:
            for name, tensor in find_tensors(output, limit=64)[0]:
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(keep, (path, name or "0")))

        return hook

    for path, module in model.named_modules():
        module.register_forward_hook(watch(path))
    return grads


def grad_output_norms(spans) -> dict[tuple[str, str], float]:
    """(module path, output name) -> torchtrace.grad_output.<name>.norm of the backward spans."""
    norms = {}
    for span in spans:
        if span.name.endswith(" backward"):
            path = span.attributes["torchtrace.module.path"]
            for key, value in span.attributes.items():
                if key.startswith("torchtrace.grad_output.") and key.endswith(".norm"):
                    norms[(path, key.removeprefix("torchtrace.grad_output.").removesuffix(".norm"))] = value
    return norms


def output_names(span, prefix: str) -> set[str]:
    """The tensor names of the span's ``<prefix><name>.norm`` attributes."""
    return {
        key.removeprefix(prefix).removesuffix(".norm")
        for key in span.attributes
        if key.startswith(prefix) and key.endswith(".norm")
    }


def assert_grad_outputs_equal_the_twins(spans, twin_grads: dict) -> None:
    traced = grad_output_norms(spans)
    assert set(traced) == set(twin_grads)  # every output that got a gradient, and no other
    for key, grad in twin_grads.items():
        assert traced[key] == pytest.approx(float(torch.linalg.vector_norm(grad.float())), rel=1e-4, abs=1e-7), key


def assert_backward_nests_like_the_forward(spans) -> None:
    """Each module's backward span sits under its nearest traced ancestor's backward span and within its time."""
    check_traces(spans)
    backward = {span.attributes["torchtrace.module.path"]: span for span in spans if span.name.endswith(" backward")}
    for path, span in backward.items():
        if not path:
            continue
        parts = path.split(".")
        ancestors = [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]
        parent = next(backward[a] for a in ancestors if a in backward)
        assert span.parent.span_id == parent.context.span_id, path
        assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time, path


@pytest.mark.parametrize("make, batch", [(gpt2, "lm"), (bert_classifier, "classify")])
def test_training_a_transformer_traces_backward_nested_and_gradients_equal_torchs(make, batch):
    model = make()
    twin = copy.deepcopy(model)
    twin_grads = gradients_reaching_outputs(twin)
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 8))
    labels = ids if batch == "lm" else torch.tensor([0, 2])
    twin(input_ids=ids, labels=labels).loss.backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with capture_spans(model, backward=True, optimizer=optimizer) as captured:
        for step in range(2):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                spans = captured.spans()
                assert_backward_nests_like_the_forward(spans)
                assert_grad_outputs_equal_the_twins(spans, twin_grads)
        spans = captured.spans()
    root = type(model).__name__
    step_roots = captured.spans_named("train_step")
    assert len(step_roots) == 2
    for step_root in step_roots:  # the step holds its backward, which holds every module's backward
        trace = [span for span in spans if span.context.trace_id == step_root.context.trace_id]
        backward = next(span for span in trace if span.name == "backward")
        model_backward = next(span for span in trace if span.name == f"{root} backward")
        assert backward.parent.span_id == step_root.context.span_id
        assert model_backward.parent.span_id == backward.context.span_id
        assert_backward_nests_like_the_forward(trace)


def test_generate_traces_each_decoding_step_and_leaves_the_tokens_unchanged():
    model = gpt2().eval()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    expected = twin.generate(ids, **options)
    with capture_spans(model) as captured:
        tokens = model.generate(ids, **options)
        spans = captured.spans()
    assert torch.equal(tokens, expected)
    check_traces(spans)
    model_calls = captured.spans_named("GPT2LMHeadModel")
    assert len(model_calls) == 4  # one forward per new token
    assert all(span.parent is None for span in model_calls)
    for call in model_calls:  # each decoding step is its own trace holding the whole forward
        trace = [span for span in spans if span.context.trace_id == call.context.trace_id]
        assert len(trace) == len(spans) // 4
        assert {span.attributes["torchtrace.module.path"] for span in trace} >= {"", "transformer", "lm_head"}


@pytest.mark.parametrize(
    "loss_of, got_gradients",
    [
        (lambda out, h_n, c_n: out.sum() + h_n.sum(), {"0", "1.0"}),
        (lambda out, h_n, c_n: h_n.pow(2).sum(), {"1.0"}),
        (lambda out, h_n, c_n: (out * 2).sum() + c_n.sum() * 3, {"0", "1.1"}),
    ],
)
def test_an_lstm_reports_the_gradient_of_each_output_it_got_under_its_forward_name(loss_of, got_gradients):
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3, num_layers=2)
    twin = copy.deepcopy(lstm)
    twin_grads = gradients_reaching_outputs(twin)
    x = torch.randn(5, 2, 4)
    out, (h_n, c_n) = twin(x)
    loss_of(out, h_n, c_n).backward()
    with capture_spans(lstm, backward=True) as captured:
        out, (h_n, c_n) = lstm(x)
        loss_of(out, h_n, c_n).backward()
        captured.handle.step()
        backward = captured.span("LSTM backward")
    assert (
        output_names(backward, "torchtrace.grad_output.") == got_gradients
    )  # an output that got no gradient is absent
    assert {name for _, name in twin_grads} == got_gradients
    assert_grad_outputs_equal_the_twins([backward], twin_grads)
    forward_names = output_names(captured.span("LSTM"), "torchtrace.output.")
    assert got_gradients <= forward_names == {"0", "1.0", "1.1"}  # the forward's names for the same outputs
