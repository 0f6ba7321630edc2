"""Smoke tests of benchmarks/: each script runs, and its last line is its JSON report. Numbers are not asserted
(they are measured by running the scripts; see benchmarks/results/)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from checkout import checkout_env
from extras import load_simulated_cuda

ROOT = Path(__file__).resolve().parent.parent
BASE_VARIANTS = {
    "none",
    "empty_hooks",
    "naive_otel",
    "naive_otel_stats",
    "torch_profiler",
    "torchtrace_spans",
    "torchtrace_stats",
    "torchtrace_spans_file",
    "torchtrace_stats_file",
}
OTLP_VARIANTS = {"torchtrace_spans_otlp", "torchtrace_stats_otlp"}
DRIFT_VARIANTS = {
    "torchtrace_stats_otlp_baseline",
    "torchtrace_stats_otlp_metrics",
    "torchtrace_stats_otlp_metrics_baseline",
}


def run_benchmark(script: str, *args: str, timeout: int = 240) -> tuple[dict, str]:
    """(the JSON report on the script's last line, its whole stdout), in a clean environment."""
    env = checkout_env()
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


def test_overhead_quick_prints_a_json_report_last() -> None:
    report, stdout = run_benchmark("overhead.py", "--quick", "--models", "cheap", "--threads", "1")
    assert set(report) == {"cheap"}
    variants = report["cheap"]["variants"]
    expected = BASE_VARIANTS | OTLP_VARIANTS | DRIFT_VARIANTS
    assert set(variants) == expected, stdout
    for name, values in variants.items():
        assert set(values) == {"us_per_call", "x_floor", "x_none"}, name
        for key in ("us_per_call", "x_none"):
            assert isinstance(values[key], (int, float)) and math.isfinite(values[key]), (name, key, values)
        # x_floor is null only when noise made empty hooks measure no slower than no hooks (the script says so)
        assert values["x_floor"] is None or math.isfinite(values["x_floor"]), (name, values)
    assert variants["none"]["x_none"] == 1.0
    assert report["cheap"]["calls_per_forward"] == 129
    assert "cheap: 129 module calls per forward" in stdout
    assert "torch.get_num_threads() = 1 (set by --threads)" in stdout
    # the baseline variants scored every forward they ran (the script exits 1 otherwise), on the worker at least in
    # part (a flush inside the timed window may score the last forwards on the model's thread)
    drift = report["cheap"]["drift"]
    assert drift["baseline_forwards"] == 30
    assert set(drift["variants"]) == {"torchtrace_stats_otlp_baseline", "torchtrace_stats_otlp_metrics_baseline"}
    for name, check in drift["variants"].items():
        assert check["forwards"] == 1 + 5 * 10 and check["scored_forwards"] == check["forwards"], (name, check)
        assert 0 < check["scored_on_worker"] <= check["scored_forwards"], (name, check)
        assert check["drifted"] == 0, (name, check)  # the timed forwards are the baseline's own inputs
    assert {name: pair["without"] for name, pair in drift["pairs"].items()} == {
        "torchtrace_stats_otlp_baseline": "torchtrace_stats_otlp",
        "torchtrace_stats_otlp_metrics_baseline": "torchtrace_stats_otlp_metrics",
    }
    for name, pair in drift["pairs"].items():
        assert len(pair["round_ratios"]) == 5 and math.isfinite(pair["ratio"]) and pair["ratio"] > 0, (name, pair)


def test_encoding_times_each_encoder_on_the_spans_of_real_forwards() -> None:
    report, stdout = run_benchmark("encoding.py", "--spans", "300", "--reps", "1", "--forwards", "2")
    assert "258 spans of 2 forwards (columns), every statistic, one input shape" in stdout  # 129 calls a forward
    assert "258 spans of 2 forwards (columns), every statistic, a new input shape every forward" in stdout
    expected = {"protobuf_us_per_span", "json_python_text_us_per_span"}
    if importlib.util.find_spec("torchtrace._otlp._json_text") is not None:
        expected.add("json_us_per_span")
    for case in ("forwards", "forwards_new_shapes"):
        timed = report["encoding"][case]
        assert set(timed) == expected and all(value > 0 for value in timed.values()), case


def test_overhead_variants_option_keeps_the_named_variants_and_the_references() -> None:
    report, stdout = run_benchmark(
        "overhead.py", "--quick", "--models", "cheap", "--threads", "1", "--variants", "torchtrace_stats_otlp"
    )
    assert set(report["cheap"]["variants"]) == {"none", "empty_hooks", "torchtrace_stats_otlp"}, stdout
    assert "drift" not in report["cheap"] and "baseline of" not in stdout  # no baseline variant: none made


def test_drift_scoring_benchmark_times_the_scorer_on_real_forwards() -> None:
    """drift.py --quick (a 2-layer BertModel): the scorer timed alone and in the pipeline, mostly on the worker."""
    pytest.importorskip("transformers")
    report, stdout = run_benchmark("drift.py", "--quick")
    result = report["drift_scoring"]["bert2"]
    assert result["calls_per_forward"] == 45 and result["series"] > 0 and result["forwards"] == 8, stdout
    for key in ("in_distribution_us", "drifted_us", "in_pipeline_us"):
        assert result[key]["median"] > 0, (key, result)
    assert result["in_pipeline_us"]["scored"] == 16 and result["in_pipeline_us"]["scored_on_worker"] > 0


GPU_VARIANTS = [
    "none",
    "none_fastpath",
    "empty_hooks",
    "torchtrace",
    "torchtrace_spans",
    "torchtrace_spans_host_clock",
    "torchtrace_torch_ops",
    "torchtrace_sampled",
    "torchtrace_batched",
]


def test_gpu_benchmark_variants_are_set_up_as_named_on_any_device(tmp_path, monkeypatch) -> None:
    """gpu.py's variants, built on a small CPU model (the GPU run has minutes, not time to find a typo): each
    computes what the model does, the statistics variants record statistics and the spans variants do not."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu)  # its dataclass looks its module up there
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts benchmarks/ on the path
    spec.loader.exec_module(gpu)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    expected = base(x)
    variants = gpu.make_variants(base, str(tmp_path))
    fastpath = torch.backends.mha.get_fastpath_enabled()  # none_fastpath's before / after set it for the process
    try:
        assert [variant.name for variant in variants] == GPU_VARIANTS
        for variant in variants:
            variant.before()
            try:
                with torch.inference_mode():
                    assert torch.equal(variant.model(x), expected), variant.name
                variant.flush()
            finally:
                variant.after()
        assert len(variants[2].model._forward_hooks) == 1 and len(variants[2].model[0]._forward_pre_hooks) == 1
    finally:
        for variant in variants:
            variant.close()
        torch.backends.mha.set_fastpath_enabled(fastpath)
    attributes = {}
    for name in GPU_VARIANTS[3:]:
        (line,) = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        spans = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
        attributes[name] = {attribute["key"] for span in spans for attribute in span["attributes"]}
    for name in ("torchtrace", "torchtrace_torch_ops", "torchtrace_sampled", "torchtrace_batched"):
        assert "torchtrace.output.mean" in attributes[name], name
    for name in ("torchtrace_spans", "torchtrace_spans_host_clock"):
        assert "torchtrace.output.mean" not in attributes[name], name


def test_gpu_benchmark_split_variants_stub_the_driver_only_around_their_repetitions(tmp_path, monkeypatch) -> None:
    """gpu.py --split: three more variants (the worker held off, the driver stubbed, both), each computing what the
    model does. A driver-stubbed repetition sends every event record and statistics launch to its own C stubs and
    puts the real entry points back after it; run here on the simulated CUDA device (its stubs play the driver)."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec.loader.exec_module(gpu)
    import simulated_cuda  # gpu.py put benchmarks/ on the path

    if simulated_cuda.available() is not None:
        pytest.skip(simulated_cuda.available())
    driver = simulated_cuda.install(monkeypatch.setattr, str(tmp_path))
    monkeypatch.setattr(gpu, "SPLIT", True)
    timer = next(iter(gpu._device._timers.values()))
    monkeypatch.setattr(gpu, "driver", lambda: timer._free[0]._driver)  # the simulated events' driver entry points
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    expected = base(x)
    variants = {variant.name: variant for variant in gpu.make_variants(base, str(tmp_path))}
    try:
        split = [
            "torchtrace_worker_at_flush",
            "torchtrace_driver_stubbed",
            "torchtrace_driver_stubbed_worker_at_flush",
            "torchtrace_events_read_in_line",
        ]
        assert list(variants)[-4:] == split
        in_line = variants["torchtrace_events_read_in_line"]
        forward = types.SimpleNamespace(start_events={0: timer._free[0]}, end_events={0: timer._free[1]})
        assert gpu.device_times.applies(forward)  # the simulated driver's events: read off the model's thread
        in_line.before()
        assert not gpu.device_times.applies(forward)  # read where resolved, during the variant's repetitions only
        in_line.after()
        assert gpu.device_times.applies(forward)
        for name in ["torchtrace", *split]:  # the first forwards launch through the driver: kinds seen before
            variant = variants[name]
            with torch.inference_mode():
                variant.model(x)
            variant.flush()
        stubbed = variants["torchtrace_driver_stubbed"]
        before = driver.counts()
        stubbed.before()
        try:
            with torch.inference_mode():
                assert torch.equal(stubbed.model(x), expected)
            stubbed.flush()
        finally:
            stubbed.after()
        assert driver.counts() == before  # nothing reached the entry points the stubs stand in for
        assert timer.marking[1] == driver.address("record")
        with torch.inference_mode():
            variants["torchtrace"].model(x)
        variants["torchtrace"].flush()
        after = driver.counts()
        # three calls, two events each; an inference tensor has no version counter: the root's output (its last
        # child's) is summarised again, a third launch
        assert after["records"] == before["records"] + 6 and after["launches"] == before["launches"] + 3
    finally:
        for variant in variants.values():
            variant.close()


def test_gpu_benchmark_peak_memory_compares_the_traced_forward_with_the_untraced_one(monkeypatch) -> None:
    """gpu.py's peak-memory question, wired on the CPU with the device's counters stood in for (every forward
    "allocates" 10 MiB above the input, the traced one 3 MiB more): the added peak is the difference, checked
    against the bound."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec.loader.exec_module(gpu)
    from torchtrace import _handle

    base = torch.nn.Sequential(torch.nn.Linear(768, 768)).to(torch.bfloat16).eval()
    peaks = []
    traced_now = []

    def allocated() -> int:  # 40 MiB of the benchmark's earlier garbage collected by the traced phase
        return (60 if _handle._live_handles else 100) * 2**20

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peaks[-1])

    def reset() -> None:  # the peak the next forward reaches: 3 MiB more while a handle traces
        traced = bool(_handle._live_handles)
        peaks.append(allocated() + (13 if traced else 10) * 2**20)
        traced_now.append(traced)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    for options in ({}, {"stats_batch": 8, "grad_mode": torch.no_grad}):  # every statistic; batched (no_grad)
        traced_now.clear()
        report = gpu.peak_memory(base, batch=2, seq=4, device="cpu", **options)
        assert traced_now == [False, True]
        assert report == {"untraced_mib": 10.0, "traced_mib": 13.0, "added_mib": 3.0, "target_mib": 64, "met": True}


def test_gpu_benchmark_reports_json_last_and_skips_cleanly_without_cuda() -> None:
    report = run_benchmark("gpu.py", "--quick", timeout=600)[0]["gpu"]
    if not torch.cuda.is_available():
        assert report == {"skipped": "no CUDA device"}
        return
    assert [(config["batch"], config["seq"]) for config in report["configs"]] == [(16, 512), (1, 128)]
    for config in report["configs"]:
        assert set(config["x_none"]) == set(config["x_empty_hooks"]) == set(GPU_VARIANTS)
    assert (
        set(report["timing_with_stats"]["modules"])
        == set(report["timing"]["modules"])
        == {
            "layers.0.linear1",
            "layers.0.self_attn",
            "layers.0.norm1",
            "layers.5",
            "layers.11.linear2",
        }
    )
    assert report["host_syncs"]["added"] == 0
    assert report["peak_memory"]["target_mib"] == 64 and isinstance(report["peak_memory"]["added_mib"], float)


def test_gpu_models_benchmark_runs_each_variant_on_a_real_model() -> None:
    """gpu_models.py on the CPU (--device cpu: the script's smoke test; the GPU run has minutes, not time to find
    a typo): every variant of a real Hugging Face model is timed, and the report says whether the target was met."""
    pytest.importorskip("transformers")
    report = run_benchmark("gpu_models.py", "--quick", "--device", "cpu", "--cases", "bert_forward", timeout=600)[0]
    case = report["gpu_models"]["cases"]["bert_forward"]
    assert set(case["x_none"]) == {
        "none",
        "torchtrace",
        "torchtrace_batched",
        "torchtrace_spans",
        "torchtrace_sampled",
        "torch_profiler",
    }
    assert case["x_none"]["none"] == 1.0 and case["target"] == 1.15 and isinstance(case["met"], bool)


@pytest.mark.parametrize(
    ("script", "argument"),
    [("gpu_models.py", "--quick"), ("gpu_host_costs.py", "--loops=10"), ("gpu_host_profile.py", "--forwards=2")],
)
def test_gpu_only_benchmarks_skip_cleanly_without_cuda(script: str, argument: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: scripts/gpu-check runs these")
    (report,) = run_benchmark(script, argument)[0].values()
    assert report == {"skipped": "no CUDA device"}


def test_longrun_smoke_reports_rss_and_loses_nothing() -> None:
    report, _ = run_benchmark("longrun.py", "--calls", "2000", "--sample-every", "20")
    assert report["calls"] == 2000
    assert report["exported_spans"] == 2000 and report["dropped_calls"] == 0 and report["failed_spans"] == 0
    assert report["rss_samples"] == 11
    assert isinstance(report["rss_growth_mib_after_warmup"], float)
    assert report["trace_file_mib"] > 0


def test_latency_quick_reports_percentiles_and_full_collections_per_variant() -> None:
    report, stdout = run_benchmark("latency.py", "--quick", "--models", "linear8")
    assert set(report) == {"linear8", "duration_s"}
    variants = report["linear8"]["variants"]
    assert set(variants) == {"untraced", "empty_hooks", "traced", "traced_gc_freeze"}
    for name, values in variants.items():
        assert values["forwards"] > 0, name
        assert 0 < values["p50_ms"] <= values["p99_ms"] <= values["max_ms"], (name, values)
        assert isinstance(values["gen2"], int) and values["gen2_total_ms"] >= values["gen2_max_ms"] >= 0, name
    for ratio in ("p99_ratio", "floor_p99_ratio", "p99_over_floor", "tail_shape_ratio"):
        assert math.isfinite(report["linear8"][ratio]), ratio
    assert "extra full collections per minute" in stdout


def test_latency_runs_a_real_transformers_model() -> None:
    """The "bert" model (a BertModel from a small config, transformers being a test dependency: tuples and model
    outputs at most of its calls) runs in every variant and is reported like the others."""
    report, stdout = run_benchmark("latency.py", "--quick", "--models", "bert")
    variants = report["bert"]["variants"]
    assert set(variants) == {"untraced", "empty_hooks", "traced", "traced_gc_freeze"}
    assert all(values["forwards"] > 0 for values in variants.values()), variants
    assert math.isfinite(report["bert"]["p99_over_floor"]) and "bert     p99 traced" in stdout


def test_serving_quick_reports_rates_and_memory() -> None:
    report, stdout = run_benchmark("serving.py", "--quick", timeout=300)
    rate, memory = report["rate"], report["memory"]
    assert set(rate["forwards_per_s"]) == {"untraced", "background", "flushed"}, stdout
    assert all(value > 0 for value in rate["forwards_per_s"].values())
    assert rate["x_none"]["untraced"] == 1.0
    assert all(count > 0 for count in rate["exported_spans"].values())  # both traced variants really exported
    assert memory["calls"] >= 159_000 and memory["exported_spans"] >= memory["calls"]
    assert memory["rss_at_end_mib"] > 0
    assert len(memory["readings_mib"]) == 11 and memory["readings_mib"][-1] == memory["rss_at_end_mib"]
    assert isinstance(memory["trend_mib_per_million_calls"], float)


def test_ddp_exports_every_rank_to_a_receiver_and_reports_json_last() -> None:
    """Two gloo ranks under torchrun, the traced model exporting OTLP to the benchmark's discard receiver (the
    issue's condition): nothing failed to export, spans were counted, every model timed, the breakdown's too."""
    report, stdout = run_benchmark("ddp.py", "--steps", "3", "--breakdown", timeout=300)
    ddp = report["ddp"]
    assert (ddp["world_size"], ddp["steps"], ddp["exporter"], ddp["failed_spans"]) == (2, 3, "otlp", 0), stdout
    assert ddp["spans_per_step"] > 16 and ddp["plain_ms"] > 0 and ddp["traced_ms"] > 0
    assert list(ddp["variants"]) == ["plain", "traced", "python_comm_hook", "forward_spans", "forward_stats",
                                     "backward_spans"]  # fmt: skip
    assert ddp["variants"]["plain"] == 1.0 and ddp["variants"]["traced"] == ddp["x_plain"]
    assert all(ratio > 0 for ratio in ddp["variants"].values())


def test_ranks_sends_fewer_spans_per_rank_with_rank_detail_auto() -> None:
    """Four gloo ranks, each policy: under "auto" the median rank sends its step and phase spans only, rank 0 all of
    them; under "all" every rank sends every module span. Series, from each rank's scrape: under "auto" rank 0
    exports every module's, every other rank (the straggler and the NaN's rank among them) its model-level ones."""
    report, stdout = run_benchmark("ranks.py", "--ranks", "4", "--steps", "6", timeout=400)
    rows = {row["policy"]: row for row in report["ranks"]}
    assert rows["auto"]["spans_per_rank_step"] < rows["all"]["spans_per_rank_step"] / 3, stdout
    assert rows["auto"]["max_spans_per_rank_step"] == rows["all"]["max_spans_per_rank_step"]  # rank 0: everything
    assert report["projection"]["1000"]["auto"] < report["projection"]["1000"]["all"] / 3
    every, auto = rows["all"], rows["auto"]
    assert every["series_rank0"] == every["series_per_other_rank"] == every["max_series_other_rank"] > 300, stdout
    assert auto["series_rank0"] == every["series_rank0"] + 4  # + its rank detail steps, by reason
    assert auto["series_per_other_rank"] == auto["max_series_other_rank"] == 44, stdout  # model-level only
    assert report["series_projection"]["1000"]["auto"] < report["series_projection"]["1000"]["all"] / 5


def skip_without_the_simulated_device() -> None:
    """Skips where benchmarks/simulated_cuda.py cannot run (no C compiler, Triton or compiled module), saying why."""
    reason = load_simulated_cuda().available()
    if reason is not None:
        pytest.skip(reason)


def test_worker_contention_times_the_traced_forward_with_the_worker_live_and_held_off() -> None:
    skip_without_the_simulated_device()
    report, stdout = run_benchmark(
        "worker_contention.py", "--repeats", "3", "--forwards", "2", "--layers", "4", "--elapsed-us", "3"
    )
    assert report["model"] == "4 x (Linear(32) + ReLU), batch 4, no_grad, 9 calls" and report["repeats"] == 3
    variants = report["variants"]
    assert list(variants) == ["untraced", "traced", "traced_worker_held", "traced_events_in_line"]
    assert all(values["us_per_forward"] > 0 for values in variants.values()), variants
    assert variants["traced_worker_held"]["x_held"] == 1.0 and variants["traced"]["x_held"] > 0
    assert variants["traced"]["us_per_call_added"] == pytest.approx(
        (variants["traced"]["us_per_forward"] - variants["untraced"]["us_per_forward"]) / 9, abs=0.02
    )
    assert "x held" in stdout


def test_instructions_counts_what_tracing_adds_per_module_call(tmp_path) -> None:
    """instructions.py under callgrind (three variants, 1 and 2 counted forwards: 60-90 s on 2 cores): every variant
    costs instructions, tracing with spans costs more than the untraced model, and the simulated CUDA host path
    with statistics more than spans on the CPU, each thread counted on its own (the dispatch thread reads each run's
    last forward, the model's thread the ones before it); here every forward under torch.inference_mode()."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        pytest.skip("valgrind (callgrind) is not installed")
    skip_without_the_simulated_device()
    out = tmp_path / "instructions.json"
    script = ROOT / "benchmarks" / "instructions.py"
    args = ["--variants", "untraced,spans,cuda_stats", "--calls", "1,2", "--json", str(out), "--grad-mode", "inference"]
    result = subprocess.run(
        [sys.executable, str(script), *args], cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["calls_per_forward"] == 129 and report["forwards"] == [1, 2]
    assert report["grad_mode"] == "inference" and "grad mode inference" in result.stdout
    variants = report["variants"]
    assert set(variants) == {"untraced", "spans", "cuda_stats"}
    assert all(values["per_call"] > 0 for values in variants.values()), variants
    assert variants["cuda_stats"]["per_call"] > variants["spans"]["per_call"] > variants["untraced"]["per_call"]
    assert variants["spans"]["added_per_call"] > 0 and "spans" in result.stdout
    cuda = variants["cuda_stats"]
    assert cuda["model_thread_added_per_call"] > 0, cuda
    assert all(model < total for model, total in zip(cuda["model_thread_totals"], cuda["totals"])), cuda
    assert "model thread added" in result.stdout


def test_instructions_hot_path_counts_the_compiled_call_alone_the_same_in_every_run(tmp_path) -> None:
    """--hot-path: only what runs inside the compiled traced call (the module's forward and the tracing around it),
    the dispatch thread held: the same count twice within 0.2% (two runs of 1 and 2 counted forwards, ~50 s on 2
    cores; what is left of the threads' timing is the GIL handed over when another thread wakes)."""
    from torchtrace._capture import traced_forward

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        pytest.skip("valgrind (callgrind) is not installed")
    if traced_forward.native_traced_call() is None:
        pytest.skip("torchtrace._native is not built here")
    script = ROOT / "benchmarks" / "instructions.py"
    counts = []
    for run in range(2):
        out = tmp_path / f"hot-{run}.json"
        args = ["--variants", "stats", "--calls", "1,2", "--json", str(out), "--hot-path"]
        result = subprocess.run(
            [sys.executable, str(script), *args], cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        report = json.loads(out.read_text())
        assert report["hot_path"] and "inside the compiled traced call" in result.stdout
        counts.append(report["variants"]["stats"]["per_call"])
    assert counts[0] > 0 and abs(counts[0] - counts[1]) <= 0.002 * counts[0], counts
    refused = subprocess.run(
        [sys.executable, str(script), "--variants", "untraced", "--hot-path"], cwd=ROOT, env=checkout_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "traced variants only" in refused.stderr
