"""Layer drift against a baseline: what is scored, what is named first, and what is refused.

The model is a BERT encoder built from a small config (no download): 6 layers, token ids drawn from a Zipf law over
the vocabulary (as words are), padded to 32 with random lengths. The baseline is made from 200 such batches.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

import torchtrace
from tests.extras import require_modules
from torchtrace import Baseline, BaselineError, Drift, Records
from torchtrace._core.baseline import SKETCH_POINTS, BaselineBuilder
from torchtrace._sinks.drift import DriftScorer
from torchtrace.attributes import DRIFT_FIRST, DRIFT_SCORE, DRIFT_STATISTIC, OUTPUT_PREFIX

VOCAB, BATCH, LENGTH = 1000, 8, 32
ZIPF = 1 / torch.arange(1, VOCAB + 1, dtype=torch.float) ** 1.1


def encoder():
    require_modules("transformers")
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(config).eval()


class Batches:
    """In-distribution batches, or ``shifted`` ones: the words of another domain (the rarer half of the
    vocabulary, in the same Zipf law)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        weights = ZIPF[: VOCAB // 2] if shifted else ZIPF
        ids = torch.multinomial(weights, BATCH * LENGTH, replacement=True, generator=self.generator)
        ids = ids.view(BATCH, LENGTH) + (VOCAB // 2 if shifted else 0)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (BATCH,), generator=self.generator)
        return ids, (torch.arange(LENGTH)[None] < lengths[:, None]).long()


@pytest.fixture(scope="module")
def known_good():
    """The encoder and its baseline, from 200 in-distribution batches."""
    model = encoder()
    batches = Batches(seed=1)
    handle = torchtrace.instrument(model, exporter="none", records=Records(max_records=200 * 120))
    with torch.no_grad():
        for _ in range(200):
            model(*batches())
    baseline = handle.baseline()
    handle.remove()
    return model, baseline


def forwards(model, batches: Batches, count: int, shifted: bool = False) -> None:
    with torch.no_grad():
        for _ in range(count):
            model(*batches(shifted))


def test_the_baseline_knows_the_model_and_each_layer_s_distribution(known_good) -> None:
    model, baseline = known_good
    assert baseline.model == "BertModel" and baseline.forwards == 200
    assert baseline.parameters == sum(parameter.numel() for parameter in model.parameters())
    assert baseline.layers["encoder.layer.3.attention.self.query"] == "Linear"
    query = baseline.references[("encoder.layer.3.attention.self.query", "std")]
    assert query.count == 200 and len(query.quantiles) == SKETCH_POINTS
    assert list(query.quantiles) == sorted(query.quantiles)


def test_in_distribution_no_layer_alerts_and_a_scaled_layer_is_named_first_within_a_window(known_good) -> None:
    """1,000 more in-distribution batches: no call of any layer over the threshold (the false-alarm count is 0 of
    every layer statistic's 1,000 scores). Then encoder.layer.3's weights x3: within one window (32 calls) a module
    of that block is the first drifted layer, and no layer before it drifted."""
    model = copy.deepcopy(known_good[0])
    baseline = known_good[1]
    marked = []

    def drifted_calls(calls) -> None:
        marked.extend(call.path for call in calls if DRIFT_SCORE in call.attributes)

    batches = Batches(seed=2)
    handle = torchtrace.instrument(model, exporter="none", baseline=baseline, sinks=[drifted_calls])
    forwards(model, batches, 1000)
    status = handle.drift()
    assert marked == [] and status.drifted == () and status.first is None
    scored = {(layer.module, layer.statistic) for layer in status.layers}
    assert scored == set(baseline.references)
    print(f"in distribution, 1000 forwards: highest score {status.layers[0]}")

    with torch.no_grad():
        for parameter in model.encoder.layer[3].parameters():
            parameter.mul_(3)
    for count in range(1, 33):  # noqa: B007 - its value is printed
        forwards(model, batches, 1)
        first = handle.drift().first
        if first is not None:
            break
    handle.remove()
    assert first is not None, "no layer crossed 1.0 within a window of 32 calls"
    assert first.module.startswith("encoder.layer.3."), first
    print(f"scaled encoder.layer.3: {first} after {count} forwards")
    earlier = ("embeddings", "encoder.layer.0.", "encoder.layer.1.", "encoder.layer.2.")
    assert not [path for path in marked if path.startswith(earlier)]


def test_a_shifted_input_distribution_is_caught_at_the_embedding(known_good) -> None:
    model = copy.deepcopy(known_good[0])
    batches = Batches(seed=3)
    handle = torchtrace.instrument(model, exporter="none", baseline=known_good[1])
    forwards(model, batches, 40)
    assert handle.drift().first is None
    forwards(model, batches, 32, shifted=True)
    status = handle.drift()
    handle.remove()
    assert status.first is not None and status.first.module == "embeddings.word_embeddings", status.first
    assert status.first.score >= 1.0 and status.first.since is not None


def test_tracing_with_a_baseline_leaves_the_outputs_as_they_are(known_good) -> None:
    model = copy.deepcopy(known_good[0])
    inputs = Batches(seed=4)()
    with torch.no_grad():
        expected = model(*inputs).last_hidden_state
        with torchtrace.instrument(model, exporter="none", baseline=known_good[1]):
            traced = model(*inputs).last_hidden_state
    assert torch.equal(traced, expected)


def test_drifted_calls_carry_their_score_and_the_first_to_finish_is_marked(known_good) -> None:
    model = copy.deepcopy(known_good[0])
    batches = Batches(seed=5)
    with torch.no_grad():
        model.encoder.layer[4].output.dense.weight.mul_(3)
    handle = torchtrace.instrument(
        model, exporter="none", baseline=Drift(baseline=known_good[1], window=8, threshold=3.0)
    )
    forwards(model, batches, 12)
    last_forward = handle.records[-len(handle.monitored_layers) :]
    status = handle.drift()
    handle.remove()
    drifted = [call for call in last_forward if DRIFT_SCORE in call.attributes]
    assert drifted, "no call marked"
    assert all(call.attributes[DRIFT_SCORE] >= 1.0 for call in drifted)
    assert {call.attributes[DRIFT_STATISTIC] for call in drifted} <= {"mean", "std", "abs_max", "zero_fraction"}
    firsts = [call for call in drifted if call.attributes.get(DRIFT_FIRST)]
    assert len(firsts) == 1 and firsts[0] is min(drifted, key=lambda call: call.end_ns)
    assert firsts[0].path == status.first.module == "encoder.layer.4.output.dense"
    unmarked = [call for call in last_forward if call not in drifted]
    assert all(DRIFT_FIRST not in call.attributes for call in unmarked)


def test_the_drift_gauges_are_scraped_and_bounded_like_the_other_per_module_series(known_good) -> None:
    model = copy.deepcopy(known_good[0])
    batches = Batches(seed=6)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.mul_(3)
    registry = CollectorRegistry()
    sink = torchtrace.MetricsSink(registry=registry, max_module_labels=5)
    handle = torchtrace.instrument(
        model, exporter="none", sinks=[sink], baseline=Drift(baseline=known_good[1], window=8, threshold=3.0)
    )
    forwards(model, batches, 12)
    status = handle.drift()
    text = generate_latest(registry).decode()
    handle.remove()
    samples = [line for line in text.splitlines() if line.startswith("torchtrace_layer_drift{")]
    modules = {line.split('module="')[1].split('"')[0] for line in samples}
    assert len(modules) == 5  # the first 5 paths called, as for the output-statistic gauges
    scores = {(layer.module or "BertModel", layer.statistic): layer.score for layer in status.layers}
    for line in samples:
        labels, value = line.rsplit(" ", 1)
        module = labels.split('module="')[1].split('"')[0]
        statistic = labels.split('statistic="')[1].split('"')[0]
        assert math.isclose(float(value), scores[(module, statistic)], rel_tol=1e-9)
    first = [line for line in text.splitlines() if line.startswith("torchtrace_layer_drift_first_timestamp_seconds{")]
    assert len(first) == 1 and 'module="embeddings.word_embeddings"' in first[0]
    assert math.isclose(float(first[0].rsplit(" ", 1)[1]), status.first.since, rel_tol=1e-9)


def test_a_baseline_of_another_model_is_refused_at_instrument(known_good, tmp_path: Path) -> None:
    import transformers

    path = known_good[1].save(tmp_path / "baseline.json")
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(BaselineError, match=r"is of a BertModel, the model is a GPT2Model"):
        torchtrace.instrument(gpt2, baseline=path)
    smaller = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    ))  # fmt: skip
    with pytest.raises(BaselineError, match=r"parameters.*layers are not traced in the model \(encoder\.layer\.2"):
        torchtrace.instrument(smaller, baseline=str(path))
    assert torchtrace.handle_of(gpt2) is None and torchtrace.handle_of(smaller) is None
    assert not gpt2._forward_hooks and not smaller._forward_pre_hooks  # nothing left behind


def test_unreadable_baselines_are_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(BaselineError, match=r"Drift\.baseline: cannot read the baseline .*missing\.json"):
        torchtrace.instrument(model, baseline=tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(BaselineError, match="is not JSON"):
        torchtrace.instrument(model, baseline=tmp_path / "text.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(BaselineError, match="is not a torchtrace baseline"):
        torchtrace.instrument(model, baseline=tmp_path / "other.json")
    monkeypatch.setenv("TORCHTRACE_BASELINE", str(tmp_path / "text.json"))
    with pytest.raises(BaselineError, match="TORCHTRACE_BASELINE: the baseline .* is not JSON"):
        torchtrace.instrument(model)
    monkeypatch.delenv("TORCHTRACE_BASELINE")
    with pytest.raises(TypeError, match="Drift.baseline must be a path or a torchtrace.Baseline"):
        torchtrace.instrument(model, baseline=42)
    with pytest.raises(ValueError, match="Drift.window must be an integer between 2"):
        torchtrace.instrument(model, baseline=Drift(window=1))


def _linear_baseline(model: torch.nn.Module) -> Baseline:
    handle = torchtrace.instrument(model, exporter="none")
    for _ in range(30):
        model(torch.randn(8, 4))
    baseline = handle.baseline()
    handle.remove()
    return baseline


def test_the_baseline_is_read_from_the_environment_and_needs_the_statistics_it_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    path = _linear_baseline(model).save(tmp_path / "baseline.json")
    with pytest.raises(ValueError, match="stats= turns all of them off"):
        torchtrace.instrument(model, baseline=path, stats=["shape", "norm"])
    monkeypatch.setenv("TORCHTRACE_BASELINE", str(path))
    monkeypatch.setenv("TORCHTRACE_DRIFT_WINDOW", "4")
    with torchtrace.instrument(model, exporter="none") as handle:
        model(torch.randn(8, 4))
        status = handle.drift()
    assert status.window == 4 and {layer.module for layer in status.layers} == {"", "0", "1"}
    monkeypatch.delenv("TORCHTRACE_BASELINE")
    with torchtrace.instrument(model, exporter="none") as handle, pytest.raises(ValueError, match="needs a baseline"):
        handle.drift()


def _reference(values: list[float], count: int = 200) -> Baseline:
    builder = BaselineBuilder()
    for value in values:
        builder.add("", "Model", {f"{OUTPUT_PREFIX}.mean": value, f"{OUTPUT_PREFIX}.std": 1.0})
    return builder.build()


def test_a_window_entirely_outside_the_baseline_crosses_1_after_22_of_32_calls() -> None:
    """As docs/drift.md says: 200 baseline values, a window of 32, threshold 6."""
    baseline = _reference([i / 199 for i in range(200)])
    scorer = DriftScorer(baseline)
    for value in (0.5, 0.25, 0.75, 0.4, 0.6) * 20:  # in distribution
        assert scorer.observe("", {f"{OUTPUT_PREFIX}.mean": value}, 0)["mean"] < 1.0
    for _ in range(32):  # the median: a window whose mean rank is exactly 0.5, where the count starts
        scorer.observe("", {f"{OUTPUT_PREFIX}.mean": 0.5}, 0)
    crossed = None
    for call in range(1, 33):
        score = scorer.observe("", {f"{OUTPUT_PREFIX}.mean": 5.0}, call * 10**9)["mean"]
        if crossed is None and score >= 1.0:
            crossed = call
    assert crossed == 22
    assert math.isclose(score, 0.5 / math.sqrt(233 / (12 * 200 * 32)) / 6, rel_tol=1e-9)  # 1.51, the most there is
    assert scorer.status().first.since == 22.0


def test_differences_below_the_tolerance_are_not_drift() -> None:
    """A LayerNorm's mean is 0 up to rounding: a build that rounds differently is not a shift."""
    noise = [(-1) ** i * (i % 7) * 1e-9 for i in range(200)]
    scorer = DriftScorer(_reference(noise))
    for _ in range(64):
        scores = scorer.observe("", {f"{OUTPUT_PREFIX}.mean": 5e-8}, 0)
    assert scores["mean"] < 0.2
    for _ in range(64):
        scores = scorer.observe("", {f"{OUTPUT_PREFIX}.mean": 0.01}, 0)  # 1% of the output's std: drift
    assert scores["mean"] >= 1.0


def test_torchtrace_baseline_makes_the_same_baseline_from_trace_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    other = torch.nn.Linear(4, 4)  # another model in the same file: its spans are kept apart
    handle = torchtrace.instrument(model, exporter="file", trace_file=tmp_path / "traces.jsonl")
    other_handle = torchtrace.instrument(other, exporter="file", trace_file=tmp_path / "traces.jsonl")
    for _ in range(30):
        model(torch.randn(8, 4))
        other(torch.randn(8, 4))
    live = handle.baseline()
    handle.remove()
    other_handle.remove()
    run = [sys.executable, "-m", "torchtrace", "baseline", str(tmp_path), "-o", str(tmp_path / "b.json")]
    refused = subprocess.run(run, capture_output=True, text=True)
    assert refused.returncode == 1
    assert "forwards of several models: Linear (30 forwards), Sequential (30 forwards)" in refused.stderr
    done = subprocess.run([*run, "--model", "Sequential"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "baseline of Sequential written" in done.stdout
    from_files = Baseline.load(tmp_path / "b.json")
    assert from_files.references == live.references and from_files.layers == live.layers
    assert from_files.parameters is None and live.parameters == 30  # trace files do not carry it
    assert from_files.fingerprint == live.fingerprint


def test_zero_code_tracing_scores_the_model_the_baseline_is_of_and_logs_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As docs/drift.md says: TORCHTRACE_BASELINE applies to every model the process runs."""
    from torchtrace.instrumentation import TorchInstrumentor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    monkeypatch.setenv("TORCHTRACE_BASELINE", str(_linear_baseline(model).save(tmp_path / "baseline.json")))
    other = torch.nn.Sequential(torch.nn.Linear(4, 2))
    instrumentor = TorchInstrumentor()
    instrumentor.instrument(exporter="none")
    try:
        model(torch.randn(8, 4))
        outputs = [other(torch.ones(1, 4)) for _ in range(3)]  # refused once, then runs untraced
        (handle,) = instrumentor.handles
        assert handle.model is model and handle.drift().layers
        assert instrumentor.errors == 1
        with torch.no_grad():
            assert torch.equal(outputs[-1], other[0](torch.ones(1, 4)))
        assert "could not instrument Sequential" in caplog.text and "is not of this model" in caplog.text
    finally:
        instrumentor.uninstrument()
