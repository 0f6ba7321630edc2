"""Configuration: keyword argument > TORCHTRACE_* environment variable > default; sampling decides per outermost
forward; every invalid option fails at instrument() time with a message that says what to fix."""

from __future__ import annotations

import random

import pytest
import torch
from instrumented import traced_modules
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from torch import nn

import torchtrace
from torchtrace.testing import capture_spans


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU())


PATHS = ["", "0", "1"]


def instrument(module: nn.Module | None = None, **options) -> torchtrace.TraceHandle:
    options.setdefault("exporter", "none")
    return torchtrace.instrument(module if module is not None else model(), **options)


# -- keyword > environment > default ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "env", "env_value", "keyword", "expected_env", "expected_keyword", "default"),
    [
        ("sample_every", "TORCHTRACE_SAMPLE_EVERY", "4", 2, 4, 2, 1),
        ("sample_ratio", "TORCHTRACE_SAMPLE_RATIO", "0.25", 0.5, 0.25, 0.5, 1.0),
        ("stats.names", "TORCHTRACE_STATS", "max, mean", ("std",), ("mean", "max"), ("std",), torchtrace.STAT_NAMES),
        ("stats.inputs", "TORCHTRACE_INPUTS", "yes", False, True, False, False),
        ("max_depth", "TORCHTRACE_MAX_DEPTH", "0", 1, 0, 1, None),
        ("include", "TORCHTRACE_INCLUDE", "0,1", "1", ("0", "1"), ("1",), ("*",)),
        ("exclude", "TORCHTRACE_EXCLUDE", "1", "0", ("1",), ("0",), ()),
        ("records.max_records", "TORCHTRACE_MAX_RECORDS", "3", 5, 3, 5, 10_000),
        ("stats.max_tensors", "TORCHTRACE_MAX_TENSORS", "2", 3, 2, 3, 8),
        ("stats.sample", "TORCHTRACE_STATS_SAMPLE", "4096", 100, 4096, 100, None),
        ("training.param_stats", "TORCHTRACE_PARAM_STATS", "on", False, True, False, False),
        ("limits.export_interval_ms", "TORCHTRACE_EXPORT_INTERVAL_MS", "250", 500, 250, 500, 1000),
        ("trace_file.max_mb", "TORCHTRACE_TRACE_FILE_MAX_MB", "0.5", 2, 0.5, 2.0, 100.0),
        ("types", "TORCHTRACE_TYPES", "torch.nn.ReLU", (nn.Linear,), (nn.ReLU,), (nn.Linear,), ()),
    ],
)
def test_keyword_beats_environment_beats_default(
    monkeypatch, tmp_path, option, env, env_value, keyword, expected_env, expected_keyword, default
):
    """``stats.inputs`` is ``Stats(inputs=...)`` given as ``stats=``; its variable and default are its own."""
    keyword_name, _, field = option.partition(".")

    def effective(handle: torchtrace.TraceHandle) -> object:
        value = getattr(handle.options, keyword_name)
        return getattr(value, field) if field else value

    def given(value: object) -> dict:
        if not field:
            return {keyword_name: value}
        kind = {"stats": torchtrace.Stats, "records": torchtrace.Records, "training": torchtrace.Training,
                "limits": torchtrace.Limits, "trace_file": torchtrace.TraceFile}[keyword_name]  # fmt: skip
        return {keyword_name: kind(**{field: value})}

    with instrument() as handle:
        assert effective(handle) == default
    monkeypatch.setenv(env, env_value)
    with instrument() as handle:
        assert effective(handle) == expected_env
    with instrument(**given(keyword)) as handle:
        assert effective(handle) == expected_keyword


def test_a_field_left_unset_in_an_option_object_still_reads_its_variable(monkeypatch):
    monkeypatch.setenv("TORCHTRACE_MAX_TENSORS", "2")
    monkeypatch.setenv("TORCHTRACE_STATS", "mean")
    with instrument(stats=torchtrace.Stats(inputs=True)) as handle:
        assert handle.options.stats == torchtrace.Stats(
            names=("mean",),
            extra={},
            inputs=True,
            max_tensors=2,
            sample=None,
            batch=1,
            batch_mb=64.0,
            on_nonfinite=None,
        )
    with instrument(stats=["max"]) as handle:  # a plain value is the object's names
        assert handle.options.stats.names == ("max",) and handle.options.stats.max_tensors == 2


def test_process_wide_settings_come_from_configure_else_the_environment(monkeypatch):
    m = model()
    monkeypatch.setenv("TORCHTRACE_HANDLE_SIGTERM", "false")
    assert torchtrace.configure() == torchtrace.Settings(
        handle_sigterm=False, print_summary=None, cuda_events=True, triton=True
    )
    assert torchtrace.configure(cuda_events=False, handle_sigterm=True).cuda_events is False
    with instrument(m) as handle:
        assert handle._recorder.cuda_events is False  # fixed when the handle is made
    with pytest.raises(TypeError, match="cuda_events must be True or False, got 'no'"):
        torchtrace.configure(cuda_events="no")
    assert torchtrace.configure().cuda_events is False  # a refused value changes nothing


def test_the_environment_changes_what_is_traced(monkeypatch):
    monkeypatch.setenv("TORCHTRACE_INCLUDE", "1")
    monkeypatch.setenv("TORCHTRACE_STATS", "max")
    monkeypatch.setenv("TORCHTRACE_INPUTS", "true")
    m = model()
    with capture_spans(m) as captured:
        m(torch.tensor([[-1.0, 2.0]]))
        attributes = captured.span("1").attributes
        assert captured.tree() == {"1": {}}
    stats = {
        key: value for key, value in attributes.items() if key.startswith(("torchtrace.output", "torchtrace.input"))
    }
    assert set(stats) == {"torchtrace.output.max", "torchtrace.input.0.max"}


def test_the_exporter_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHTRACE_EXPORTER", "none")
    with torchtrace.instrument(model()) as handle:
        assert handle.exporter == "none"
    with torchtrace.instrument(model(), tracer_provider=TracerProvider(), exporter="sdk") as handle:
        assert handle.exporter == "sdk"


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("TORCHTRACE_SAMPLE_EVERY", "often"),
        ("TORCHTRACE_SAMPLE_RATIO", "half"),
        ("TORCHTRACE_INPUTS", "maybe"),
        ("TORCHTRACE_MAX_DEPTH", "deep"),
        ("TORCHTRACE_STATS", "mean,median"),
        ("TORCHTRACE_TYPES", "torch.nn.NoSuchLayer"),
        ("TORCHTRACE_EXPORTER", "carrier-pigeon"),
        ("TORCHTRACE_SAMPLE_EVERY", "0"),
        ("TORCHTRACE_TRITON", "sometimes"),
        ("TORCHTRACE_PRINT_SUMMARY", "loudly"),
        ("TORCHTRACE_CUDA_EVENTS", "eventually"),
    ],
)
def test_a_bad_environment_value_fails_at_instrument_time(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    m = model()
    with pytest.raises(ValueError) as error:
        instrument(m, exporter=None)
    assert value.split(",")[-1].split(".")[-1] in str(error.value) or env in str(error.value)
    assert traced_modules(m) == []  # nothing was half-installed


# -- sampling -------------------------------------------------------------------------------------------------------


def test_sample_every_traces_every_nth_forward():
    m = model()
    with capture_spans(m, sample_every=3, stats=("mean",)) as captured:
        for step in range(9):
            m(torch.full((1, 2), float(step)))
        roots = captured.spans_named("Sequential")
        assert len(roots) == 3
        assert len(captured.spans()) == 3 * len(PATHS)
        # the 1st, 4th and 7th forwards: Linear's input was 0, 3, 6
        assert [span.attributes["torchtrace.module.path"] for span in captured.spans_named("0")] == ["0"] * 3
        assert len(captured.handle.records) == 9


def test_sample_every_picks_whole_forwards():
    m = nn.Sequential(nn.Identity())
    with torchtrace.instrument(m, exporter="none", sample_every=2, stats=("mean",)) as handle:
        for step in range(6):
            m(torch.tensor([float(step)]))
        assert [call.attributes["torchtrace.output.mean"] for call in handle["0"]] == [0.0, 2.0, 4.0]
        assert [call.path for call in handle.records] == ["", "0"] * 3


def test_sample_ratio_zero_traces_nothing_and_records_nothing():
    m = model()
    with capture_spans(m, sample_ratio=0) as captured:
        for _ in range(5):
            m(torch.ones(1, 2))
        assert captured.spans() == []
        assert captured.handle.records == []
        assert len(captured.handle.buffer) == 0
        assert captured.handle.dropped_calls == 0


def test_sample_ratio_traces_about_that_fraction_of_forwards():
    random.seed(1234)
    m = nn.Identity()
    with torchtrace.instrument(m, exporter="none", sample_ratio=0.5, stats=False) as handle:
        for _ in range(400):
            m(torch.ones(1))
        traced = len(handle.records)
    assert 140 <= traced <= 260


def test_an_unsampled_caller_span_means_no_spans():
    m = model()
    not_sampled = TracerProvider(sampler=ALWAYS_OFF).get_tracer("caller")
    with capture_spans(m) as captured:
        with not_sampled.start_as_current_span("request") as request:
            assert request.get_span_context().is_valid and not request.get_span_context().trace_flags.sampled
            m(torch.ones(1, 2))
        assert captured.spans() == []
        assert captured.handle.records == []
        m(torch.ones(1, 2))  # without that caller span the next forward is traced
        assert captured.tree() == {"Sequential": {"0": {}, "1": {}}}


def test_a_disabled_handle_and_sampling_compose():
    m = model()
    with torchtrace.instrument(m, exporter="none", sample_every=2) as handle:
        handle.disable()
        for _ in range(3):
            m(torch.ones(1, 2))
        handle.enable()
        for _ in range(4):
            m(torch.ones(1, 2))
        assert len(handle[""]) == 2  # disabled forwards do not count towards sample_every


# -- invalid options fail at instrument() time -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"stats": ("mean", "median")}, ValueError, "median"),
        ({"stats": "mean,p50"}, ValueError, "p50"),
        ({"stats": 5}, TypeError, "Stats.names"),
        ({"records": {"max_records": 3}}, TypeError, "records must be a torchtrace.Records"),
        ({"sample_every": 0}, ValueError, "sample_every"),
        ({"sample_every": -2}, ValueError, "sample_every"),
        ({"sample_every": 1.5}, ValueError, "sample_every"),
        ({"sample_ratio": 1.5}, ValueError, "sample_ratio"),
        ({"sample_ratio": -0.1}, ValueError, "sample_ratio"),
        ({"sample_ratio": "half"}, ValueError, "sample_ratio"),
        ({"max_depth": -1}, ValueError, "max_depth"),
        ({"stats": torchtrace.Stats(max_tensors=0)}, ValueError, "Stats.max_tensors"),
        ({"stats": torchtrace.Stats(sample=0)}, ValueError, "Stats.sample"),
        ({"stats": torchtrace.Stats(sample=2.5)}, ValueError, "Stats.sample"),
        ({"stats": torchtrace.Stats(sample=True)}, ValueError, "Stats.sample"),
        ({"records": torchtrace.Records(max_records="many")}, ValueError, "Records.max_records"),
        ({"records": torchtrace.Records(capture_max_bytes=-1)}, ValueError, "Records.capture_max_bytes"),
        ({"records": torchtrace.Records(capture_max_bytes=0)}, ValueError, "Records.capture_max_bytes"),
        ({"limits": torchtrace.Limits(export_interval_ms=0)}, ValueError, "Limits.export_interval_ms"),
        ({"include": 5}, TypeError, "include"),
        ({"exclude": [1, 2]}, TypeError, "exclude"),
        ({"types": int}, TypeError, "int"),
        ({"types": "Linear"}, TypeError, "types"),
        ({"stats": torchtrace.Stats(extra={"p99": 3})}, TypeError, "p99"),
        ({"stats": torchtrace.Stats(extra={"not a name": len})}, ValueError, "not a name"),
        ({"records": torchtrace.Records(function_on_output="mean")}, TypeError, "Records.function_on_output"),
        ({"records": torchtrace.Records(function_on_input=1)}, TypeError, "Records.function_on_input"),
        ({"records": torchtrace.Records(module_attributes=[1])}, TypeError, "Records.module_attributes"),
        ({"sinks": [42]}, TypeError, "sinks"),
        ({"exporter": "carrier-pigeon"}, ValueError, "exporter"),
        ({"exporter": "none", "tracer_provider": TracerProvider()}, ValueError, "tracer_provider"),
        ({"stats": torchtrace.Stats(inputs="false")}, TypeError, "Stats.inputs"),
        ({"include": "nothing_here*"}, ValueError, "nothing_here"),
        ({"exclude": "*"}, ValueError, "no module"),
        ({"types": nn.Conv2d}, ValueError, "Conv2d"),
    ],
    ids=lambda value: "-".join(f"{k}={v!r}" for k, v in value.items()) if isinstance(value, dict) else None,
)
def test_invalid_options_fail_at_instrument_time_with_a_helpful_message(options, error, message):
    m = model()
    options = {"exporter": "none", **options}
    with pytest.raises(error, match=message):
        torchtrace.instrument(m, **options).remove()  # remove() only runs if the options were wrongly accepted
    assert traced_modules(m) == []
    with torchtrace.instrument(m, exporter="none"):  # a failed instrument() leaves the model instrumentable
        pass


def test_an_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="sample_evry"):
        torchtrace.instrument(model(), exporter="none", sample_evry=2)


@pytest.mark.parametrize("not_a_module", [lambda x: x, "model", torch.ones(2), nn.Linear])
def test_only_modules_can_be_instrumented(not_a_module):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        torchtrace.instrument(not_a_module, exporter="none")


def test_instrumenting_the_same_model_twice_fails_until_the_first_handle_is_removed():
    m = model()
    first = instrument(m)
    with pytest.raises(ValueError, match="already instrumented"):
        instrument(m)
    assert traced_modules(m) == PATHS  # the failed second call added nothing
    assert len(m._forward_hooks) == 1
    first.remove()
    with instrument(m) as second:
        m(torch.ones(1, 2))
        assert [call.path for call in second.records] == PATHS


def test_globs_match_whole_paths_and_star_crosses_dots():
    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model.add_module("head", nn.Linear(2, 2))

    def selected(**globs: str) -> list[str]:
        with instrument(model, exporter="none", **globs) as handle:
            return handle.monitored_layers

    assert selected(include="encoder.*") == ["encoder.0", "encoder.1"]  # every module under encoder, not itself
    assert selected(exclude="encoder") == ["", "encoder.0", "encoder.1", "head"]  # that one module only
    assert selected(exclude="encoder*") == ["", "head"]  # the subtree
    assert selected(include="*[01]") == ["encoder.0", "encoder.1"]  # a character class
