"""Every numeric option is checked against what the hot path and the export path can take, at instrument() time:
bools, NaN, infinity, fractions where integers are meant and values past a bound are refused, naming the keyword
or the environment variable they came from."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from instrumented import traced_modules
from torch import nn

import torchtrace
from torchtrace._core.options import (
    GROUPS,
    MAX_EXPORT_INTERVAL_MS,
    MAX_PENDING_CALLS,
    MAX_TRACE_FILE_BACKUPS,
    resolve_options,
)

# option (a keyword, or an option object's field as errors name it), its environment variable (None: keyword only),
# the smallest valid value, the largest (None: unbounded), whether it is an integer
NUMERIC_OPTIONS = [
    ("max_depth", "TORCHTRACE_MAX_DEPTH", 0, None, True),
    ("Stats.max_tensors", "TORCHTRACE_MAX_TENSORS", 1, None, True),
    ("Stats.sample", "TORCHTRACE_STATS_SAMPLE", 1, None, True),
    ("sample_every", "TORCHTRACE_SAMPLE_EVERY", 1, None, True),
    ("sample_ratio", "TORCHTRACE_SAMPLE_RATIO", 0, 1, False),
    ("Records.max_records", "TORCHTRACE_MAX_RECORDS", 1, None, True),
    ("Limits.export_interval_ms", "TORCHTRACE_EXPORT_INTERVAL_MS", 1, MAX_EXPORT_INTERVAL_MS, True),
    ("Limits.max_pending_calls", "TORCHTRACE_MAX_PENDING_CALLS", 1, MAX_PENDING_CALLS, True),
    ("Records.capture_max_bytes", None, 1, None, True),
    ("TraceFile.max_mb", "TORCHTRACE_TRACE_FILE_MAX_MB", 0, None, False),
    ("TraceFile.backups", "TORCHTRACE_TRACE_FILE_BACKUPS", 0, MAX_TRACE_FILE_BACKUPS, True),
]
KEYWORD_OF = {kind.__name__: keyword for keyword, kind in GROUPS.items()}


def _given(name: str, value: object) -> dict:
    """``instrument()``'s keywords setting option ``name`` (``Stats.sample``: ``stats=Stats(sample=value)``)."""
    group, _, field = name.rpartition(".")
    return {KEYWORD_OF[group]: GROUPS[KEYWORD_OF[group]](**{field: value})} if group else {name: value}


def _effective(options: object, name: str) -> object:
    group, _, field = name.rpartition(".")
    return getattr(getattr(options, KEYWORD_OF[group]), field) if group else getattr(options, name)


def _bad_keyword_values(low, high, integer):
    bad = [True, False, math.nan, math.inf, -math.inf, "5", low - 1]
    if integer:
        bad += [float(low), low + 0.5]
    if high is not None:
        bad.append(high + 1)
    return bad


def _bad_env_values(low, high, integer):
    bad = ["inf", "nan", "-inf", "true", str(low - 1)]
    if integer:
        bad += ["1.5", "1e3"]
    if high is not None:
        bad.append(str(high + 1))
    return bad


@pytest.mark.parametrize(
    ("name", "env", "low", "high", "integer"), NUMERIC_OPTIONS, ids=[o[0] for o in NUMERIC_OPTIONS]
)
def test_every_numeric_option_refuses_what_the_export_path_cannot_take(monkeypatch, name, env, low, high, integer):
    for value in _bad_keyword_values(low, high, integer):
        with pytest.raises(ValueError, match=name):
            resolve_options(**_given(name, value))
    for value in (low, high) if high is not None else (low, low + 7):
        assert _effective(resolve_options(**_given(name, value)), name) == value
    if env is None:
        return
    for text in _bad_env_values(low, high, integer):
        monkeypatch.setenv(env, text)
        with pytest.raises(ValueError, match=env):
            resolve_options()
    monkeypatch.setenv(env, str(high if high is not None else low))
    assert _effective(resolve_options(), name) == (high if high is not None else low)
    monkeypatch.setenv(env, "not a number")
    assert _effective(resolve_options(**_given(name, low)), name) == low  # the keyword wins; the variable is not read


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "0", "3601", "1e9"])
def test_an_otlp_timeout_deadlines_cannot_use_is_refused_at_instrument_time(monkeypatch, text):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", text)
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        torchtrace.instrument(model, exporter="otlp")
    assert traced_modules(model) == []


@pytest.mark.parametrize(
    ("env", "text"),
    [
        ("TORCHTRACE_STEP_EVERY", "true"),
        ("TORCHTRACE_STEP_EVERY", "0"),
        ("TORCHTRACE_METRICS_PORT", "99999"),
        ("TORCHTRACE_METRICS_PORT", "-5"),
    ],
)
def test_step_and_port_variables_are_checked_too(monkeypatch, env, text):
    monkeypatch.setenv(env, text)
    with pytest.raises(ValueError, match=env):
        torchtrace.instrument(nn.Sequential(nn.Linear(2, 2)), exporter="none")


def test_schedules_refuse_booleans():
    with pytest.raises(ValueError, match="every"):
        torchtrace.every(True)
    with pytest.raises(ValueError, match="active"):
        torchtrace.schedule(active=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"trace_file": 123}, "TraceFile.path"),
        ({"trace_file": ""}, "TraceFile.path"),
        ({"tracer_provider": 5}, "tracer_provider"),
        ({"exporter": 5}, "exporter"),
        ({"trace_file": torchtrace.TraceFile(path=5)}, "TraceFile.path"),
        ({"records": torchtrace.Records(module_attributes=5)}, "Records.module_attributes"),
        ({"limits": 5}, "limits must be a torchtrace.Limits"),
        ({"sinks": 5}, "sinks"),
        ({"sinks": print}, "sinks"),  # one callable, not a sequence of them
        ({"sinks": [print, 5]}, "sinks"),
    ],
)
def test_options_of_the_wrong_type_raise_type_error(options, message):
    with pytest.raises(TypeError, match=message):
        resolve_options(**options)


def test_the_longest_export_interval_runs_and_delivers(tmp_path):
    """An interval the worker's timed wait can take: the worker lives, and flush() delivers at once."""
    model = nn.Sequential(nn.Linear(2, 2))
    with torchtrace.instrument(
        model, exporter="none", limits=torchtrace.Limits(export_interval_ms=MAX_EXPORT_INTERVAL_MS)
    ) as handle:
        model(torch.ones(1, 2))
        assert any(t.name == "torchtrace-dispatch" for t in threading.enumerate())
        assert len(handle.records) == 2


@pytest.mark.parametrize(
    ("env", "text", "message"),
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://my host:4318", "not an endpoint"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "bogus", "OTEL_EXPORTER_OTLP_COMPRESSION='bogus': expected one of"),
        ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer s3cret,oops", "item 2 of 2 is not a header"),
        ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "s3cret", "OTEL_EXPORTER_OTLP_TRACES_HEADERS: item 1 of 1"),
    ],
)
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_settings_the_exporter_would_fail_on_or_log_are_refused_at_instrument(
    monkeypatch, caplog, env, text, message, protocol
):
    """Named in the error, with header values never shown (the SDK logs a malformed item's text: a token)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv(env, text)
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=message) as raised:
        torchtrace.instrument(model, exporter="otlp")
    assert "s3cret" not in str(raised.value) and all("s3cret" not in r.getMessage() for r in caplog.records)
    assert traced_modules(model) == []


@pytest.mark.parametrize("headers", ["authorization=Bearer%20abc", "a=1, b=2", "x-api-key = plain value", "", "k=v,"])
def test_well_formed_otlp_headers_pass(monkeypatch, headers):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", headers)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    with torchtrace.instrument(nn.Sequential(nn.Linear(2, 2)), exporter="otlp"):
        pass
