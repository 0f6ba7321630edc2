"""torchtrace on real models on one CUDA device, beside torch.profiler: Hugging Face models built from their configs
(random weights, no download), bfloat16.

Cases: GPT-2 small forward (batch 8, seq 512), BERT-base forward (batch 32, seq 128), GPT-2 greedy generation (batch
1, 32 new tokens after 16), and a GPT-2 training step (batch 4, seq 256, AdamW, float32 weights under bfloat16
autocast, backward spans). Variants, each on its own copy of the model, timed round-robin (the starting variant
rotates every round): `none`; `torchtrace` (the defaults: a span per module call, every statistic, CUDA events, the
embedded file exporter); `torchtrace_batched` (the same with Stats(batch=8): eight tensors' statistics a launch,
which tensors with version counters allow: use --grad-mode no_grad, where forwards make them); `torchtrace_spans`
(stats=False); `torchtrace_sampled` (sample_every=10: one forward in ten traced); `torch_profiler` (CPU and CUDA
activities, every op recorded; its trace's processing when the profile closes is left out of the window,
torchtrace's flush is in it). One repetition = N calls of the case, the variant's flush, and
torch.cuda.synchronize().

Targets (issue 41): every statistic <= 1.15x untraced on the forwards, <= 1.35x on generate, <= 1.25x on the
training step; each less than half of torch.profiler's added cost.

Run: python benchmarks/gpu_models.py [--quick] [--repeats R] [--cases a,b] [--grad-mode no_grad] (forwards and
generation run under inference_mode by default). The last line printed is one JSON object (on a machine without
CUDA or transformers: {"gpu_models": {"skipped": "..."}}, exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import torchtrace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


TARGETS = {"gpt2_forward": 1.15, "bert_forward": 1.15, "gpt2_generate": 1.35, "gpt2_train_step": 1.25}
VARIANTS = ("none", "torchtrace", "torchtrace_batched", "torchtrace_spans", "torchtrace_sampled", "torch_profiler")
GRAD_MODE: Callable[[], Any] = torch.inference_mode  # of the forward and generation cases (--grad-mode)


@dataclass
class Case:
    name: str
    model: nn.Module
    run: Callable[[nn.Module, Any], Any]  # one call of the case on a model (its optimizer in `state`)
    make_state: Callable[[nn.Module], Any] = lambda model: None
    training: bool = False


def gpt2(device: torch.device, quick: bool, dtype: torch.dtype) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2 if quick else 12)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(device, dtype)


def bert(device: torch.device, quick: bool) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(num_hidden_layers=2 if quick else 12)).to(device, torch.bfloat16)


def cases(device: torch.device, quick: bool, names: Sequence[str]) -> list[Case]:
    scale = 4 if quick else 1
    made = []  # each case's inputs bound as it is made (default arguments: the names are reused)
    if "gpt2_forward" in names:
        ids = torch.randint(0, 50257, (8 // scale, 512 // scale), device=device)
        made.append(Case("gpt2_forward", gpt2(device, quick, torch.bfloat16).eval(), lambda m, s, i=ids: m(i).logits))
    if "bert_forward" in names:
        ids = torch.randint(0, 30522, (32 // scale, 128), device=device)
        made.append(Case("bert_forward", bert(device, quick).eval(), lambda m, s, i=ids: m(i).last_hidden_state))
    if "gpt2_generate" in names:
        prompt = torch.randint(0, 50257, (1, 16), device=device)
        new = 8 if quick else 32

        def generate(model: nn.Module, state: Any) -> Any:
            return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

        made.append(Case("gpt2_generate", gpt2(device, quick, torch.bfloat16).eval(), generate))
    if "gpt2_train_step" in names:
        ids = torch.randint(0, 50257, (4 // scale, 256 // scale), device=device)

        def step(model: nn.Module, optimizer: Any, ids: torch.Tensor = ids) -> Any:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        made.append(
            Case(
                "gpt2_train_step",
                gpt2(device, quick, torch.float32).train(),
                step,
                make_state=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-5),
                training=True,
            )
        )
    return made


@dataclass
class Variant:
    name: str
    model: nn.Module
    state: Any
    around: Callable[[], Any] = contextlib.nullcontext  # around a whole repetition (the profiler)
    flush: Callable[[], Any] = lambda: None
    close: Callable[[], Any] = lambda: None


def make_variants(case: Case, trace_dir: str) -> list[Variant]:
    variants = []
    for name in VARIANTS:
        model = copy.deepcopy(case.model)
        state = case.make_state(model)
        variant = Variant(name, model, state)
        if name == "torch_profiler":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            variant.around = lambda activities=activities: torch.profiler.profile(activities=activities)
        elif name.startswith("torchtrace"):
            options: dict[str, Any] = {
                "stats": torchtrace.Stats(batch=8) if name == "torchtrace_batched" else name != "torchtrace_spans",
                "sample_every": 10 if name == "torchtrace_sampled" else 1,
            }
            if case.training:
                options.update(backward=True, optimizer=state)
            handle = torchtrace.instrument(
                model,
                exporter="file",
                trace_file=os.path.join(trace_dir, f"{case.name}-{name}.jsonl"),
                **options,
            )
            variant.flush, variant.close = handle.flush, handle.remove
        variants.append(variant)
    return variants


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(case: Case, variant: Variant, calls: int) -> float:
    """Seconds per call for one repetition: the calls, the flush and the device's completion (the profiler's trace
    processing when it closes left out)."""
    grad = contextlib.nullcontext() if case.training else GRAD_MODE()
    with variant.around():
        synchronize()
        start = time.perf_counter()
        with grad:
            for _ in range(calls):
                case.run(variant.model, variant.state)
        variant.flush()
        synchronize()
        elapsed = time.perf_counter() - start
    return elapsed / calls


def measure(case: Case, calls: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as trace_dir:
        variants = make_variants(case, trace_dir)
        try:
            for variant in variants:  # warm-up: allocator, kernels, pools
                timed(case, variant, 2)
            samples: dict[str, list[float]] = {variant.name: [] for variant in variants}
            for round_number in range(repeats):
                shift = round_number % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    samples[variant.name].append(timed(case, variant, calls))
        finally:
            for variant in variants:
                variant.close()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    none = medians["none"]
    ratios = {name: round(value / none, 4) for name, value in medians.items()}
    added = {name: ratio - 1 for name, ratio in ratios.items()}
    target = TARGETS[case.name]
    return {
        "ms_per_call": {name: round(value * 1e3, 4) for name, value in medians.items()},
        "x_none": ratios,
        "iqr_pct": {name: round(_iqr(values) / statistics.median(values) * 100, 1) for name, values in samples.items()},
        "target": target,
        "met": ratios["torchtrace"] <= target and added["torchtrace"] < added["torch_profiler"] / 2,
    }


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 4:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models and few repetitions (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--calls", type=int, default=None, help="calls of the case per repetition")
    parser.add_argument("--cases", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    parser.add_argument("--grad-mode", choices=("inference", "no_grad"), default="inference")
    args = parser.parse_args(argv)
    global GRAD_MODE
    GRAD_MODE = torch.no_grad if args.grad_mode == "no_grad" else torch.inference_mode
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"gpu_models": {"skipped": "no CUDA device"}}))
        return 0
    if importlib.util.find_spec("transformers") is None:
        print(json.dumps({"gpu_models": {"skipped": "transformers is not installed"}}))
        return 0
    warnings.filterwarnings("ignore", module="transformers")
    device = torch.device(args.device)
    repeats = args.repeats or (2 if args.quick else 5)
    calls = args.calls or (1 if args.quick else 5)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "grad_mode": args.grad_mode,
        "cases": {},
    }
    for case in cases(device, args.quick, args.cases.split(",")):
        report["cases"][case.name] = result = measure(case, calls, repeats)
        print(json.dumps({case.name: result}), flush=True)
    print(json.dumps({"gpu_models": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
