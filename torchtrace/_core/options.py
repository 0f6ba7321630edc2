"""Options of ``torchtrace.instrument``: keyword argument, else ``TORCHTRACE_*`` environment variable, else default.

A few plain keywords, and small option objects where several knobs belong together (``Stats``, ``TraceFile``,
``Records``, ``Training``, ``Limits``), as httpx has ``Limits`` and ``Timeout``. Every option is declared once, as a
field with its variable, default and meaning (``option()``): resolution, ``torchtrace config`` and the generated
docs/configuration.md all read that declaration. Invalid values raise at ``instrument()`` time, never in a hook.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

import torch
from opentelemetry import trace

from torchtrace._core.baseline import Baseline, BaselineError
from torchtrace._core.schedule import every

EXPORTERS = ("auto", "otlp", "sdk", "file", "none")
STAT_NAMES = (  # what ``stats=`` may name (the capture computes them), in the order spans and tables show them
    "shape",
    "dtype",
    "device",
    "mean",
    "std",
    "min",
    "max",
    "abs_max",
    "norm",
    "nan_count",
    "inf_count",
    "zero_fraction",
)
# A user statistic (``Stats(extra=...)``): tensor -> number (a 1-element tensor is read with .item()).
StatFunction = Callable[[torch.Tensor], "float | int | bool | torch.Tensor"]
DEFAULT_TRACE_FILE = os.path.join("torchtrace-traces", "traces.jsonl")
# The longest export interval, a year: the worker waits with threading's timed wait (far longer overflows it).
MAX_EXPORT_INTERVAL_MS = 365 * 24 * 3600 * 1000
MAX_TRACE_FILE_BACKUPS = 1000  # each rotation renames every backup: 10**6 of them took 7.4 s on the model's thread
MAX_PENDING_CALLS = 10**9  # calls held for export (each a few hundred bytes): past this, a bound that bounds nothing
ENV_EXPORTER = "TORCHTRACE_EXPORTER"
ENV_TRACE_FILE = "TORCHTRACE_TRACE_FILE"
ENV_METRICS = "TORCHTRACE_METRICS"
ENV_METRICS_PORT = "TORCHTRACE_METRICS_PORT"  # asking for a scrape endpoint asks for metrics

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_text(name: str) -> str | None:
    """The variable's value, stripped; None when unset or blank."""
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def parse_bool(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected true or false")


def parse_int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None


def parse_float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number") from None


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# Checks: (label, value) -> the value as the option holds it; the label is the option's name, or the variable the
# value came from, so every error says where the bad value was set.


def boolean(label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{label} must be True or False, got {value!r}")
    return value


def number(low: float, high: float | None = None, *, integer: bool = True) -> Callable[[str, Any], Any]:
    """A number (an int where ``integer``; never a bool, NaN or infinity) in ``[low, high]``."""

    def check(label: str, value: Any) -> Any:
        kind = "an integer" if integer else "a number"
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
        if isinstance(value, bool) or not ok or value < low or (high is not None and value > high):
            raise ValueError(f"{label} must be {kind} {bounds}, got {value!r}")
        return value if integer else float(value)

    return check


def _callable_or_none(label: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{label} must be callable, got {value!r}")
    return value


def _globs(label: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = _split(value) if "," in value else (value,)
    if not isinstance(value, Sequence) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"{label} must be a glob string or a sequence of glob strings, got {value!r}")
    return tuple(value)


def _import_types(name: str, text: str) -> tuple[type, ...]:
    found = []
    for dotted in _split(text):
        module_name, _, attribute = dotted.rpartition(".")
        try:
            value = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError):
            raise ValueError(f"{name}: cannot import module type {dotted!r}") from None
        if not isinstance(value, type):
            raise ValueError(f"{name}: {dotted!r} is not a class")
        found.append(value)
    return tuple(found)


def _types(label: str, value: Any) -> tuple[type, ...]:
    if isinstance(value, type):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(item, type) for item in value):
        raise TypeError(f"{label} must be a module class or a tuple of module classes, got {value!r}")
    for item in value:
        if not issubclass(item, torch.nn.Module):
            raise TypeError(f"{label}: {item.__name__} is not a torch.nn.Module subclass")
    return tuple(value)


def _stat_names(label: str, value: Any) -> tuple[str, ...]:
    if value is True or value == "all":
        return STAT_NAMES
    if value is False or value == "none":
        return ()
    if isinstance(value, str):
        value = _split(value)
    if not isinstance(value, (tuple, list, set, frozenset)):
        raise TypeError(f"{label} must be True, False, 'all', 'none' or a sequence of names, got {value!r}")
    unknown = [name for name in value if name not in STAT_NAMES]
    if unknown:
        raise ValueError(
            f"unknown statistic(s) {unknown}; known: {', '.join(STAT_NAMES)} (add your own with Stats(extra=...))"
        )
    return tuple(name for name in STAT_NAMES if name in value)


def _extra_stats(label: str, value: Any) -> dict[str, StatFunction]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{label} must be a mapping of statistic names to functions, got {value!r}")
    for name, function in value.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"{label}: {name!r} is not a valid statistic name")
        if not callable(function):
            raise TypeError(f"{label}[{name!r}] must be callable, got {function!r}")
    return dict(value)


def _nonfinite(label: str, value: Any) -> Any:
    if value is None or value == "raise" or callable(value):
        return value
    raise ValueError(f"{label} must be None, 'raise' or a callable, got {value!r}")


def _path(label: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"{label} must be a path (str or os.PathLike), got {value!r}")
    return os.fspath(value)


def _attribute_names(label: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or not all(isinstance(name, str) for name in value):
        raise TypeError(f"{label} must be attribute names, got {value!r}")
    return tuple(value)


def _every_nth_step(name: str, text: str) -> Callable[[int], bool]:
    return every(number(1)(name, parse_int(name, text)))


def _schedule(label: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{label} must be a callable step -> bool (e.g. torchtrace.schedule(...)), got {value!r}")
    return value


def _comm_hook(label: str, value: Any) -> Any:
    if value is not None and not (isinstance(value, tuple) and len(value) == 2 and callable(value[0])):
        raise TypeError(f"{label} must be a (hook, state) pair as for DDP.register_comm_hook, got {value!r}")
    return value


RANK_DETAIL_POLICIES = ("all", "auto")


def _rank_detail(label: str, value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in RANK_DETAIL_POLICIES:
        raise ValueError(f"{label} must be one of {', '.join(RANK_DETAIL_POLICIES)}, got {value!r}")
    return value.lower()


def _rank_numbers(label: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str):
        try:
            value = tuple(int(part) for part in _split(value))
        except ValueError:
            raise ValueError(f"{label}={value!r}: expected comma-separated rank numbers") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Iterable) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                  for r in value):  # fmt: skip
        raise TypeError(f"{label} must be rank numbers (ints >= 0), got {value!r}")
    return tuple(sorted(set(value)))


def _baseline(label: str, value: Any) -> Baseline:
    """A ``Baseline``, or the path of one (read now: a bad file raises at ``instrument()``)."""
    if isinstance(value, Baseline):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{label} must be a path or a torchtrace.Baseline, got {value!r}")
    try:
        return Baseline.load(value)
    except BaselineError as error:
        raise BaselineError(f"{label}: {error}") from None


def _exporter(label: str, value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in EXPORTERS:
        raise (ValueError if isinstance(value, str) else TypeError)(
            f"{label} must be one of {', '.join(EXPORTERS)}, got {value!r}"
        )
    return value.lower()


def _tracer_provider(label: str, value: Any) -> Any:
    if value is not None and not isinstance(value, trace.TracerProvider):
        raise TypeError(f"{label} must be an opentelemetry TracerProvider, got {type(value).__name__}")
    return value


def _optimizer(label: str, value: Any) -> Any:
    """The optimizer whose step() closes a step: ``value``, or the one a wrapper steps (accelerate's
    ``AcceleratedOptimizer``, which HF's Trainer uses, and Lightning's ``LightningOptimizer`` hold it as
    ``.optimizer`` / ``._optimizer``; the first has no step hooks of its own)."""
    if value is None:
        return None
    found = value
    for _ in range(4):
        if isinstance(found, torch.optim.Optimizer) and hasattr(found, "_optimizer_step_pre_hooks"):
            return found
        found = getattr(found, "optimizer", None) or getattr(found, "_optimizer", None)
    raise TypeError(f"{label} must be a torch.optim.Optimizer (or a wrapper of one), got {type(value).__name__}")


def _metrics(label: str, value: Any) -> Any:
    if isinstance(value, bool) or callable(value):
        return value
    raise TypeError(f"{label} must be True, False or a MetricsSink, got {value!r}")


def _sinks(label: str, value: Any) -> tuple[Callable, ...]:
    if callable(value) or not isinstance(value, Iterable) or not all(callable(sink) for sink in value):
        raise TypeError(f"{label} must be a sequence of callables taking a sequence of ModuleCall, got {value!r}")
    return tuple(value)


def option(
    default: Any,
    doc: str,
    *,
    env: str | None = None,
    parse: Callable[[str, str], Any] | None = None,
    check: Callable[[str, Any], Any] | None = None,
    shown: str | None = None,
) -> Any:
    """One option: unset (None) until resolved to the keyword, else ``env`` (read by ``parse``), else ``default``;
    ``check`` validates what was given or read. ``shown`` is the default as the docs print it, where the value
    itself would not say (a default decided later, a long tuple)."""
    return field(
        default=None,
        metadata={"default": default, "doc": doc, "env": env, "parse": parse, "check": check, "shown": shown},
    )


def switch(default: bool | None, doc: str, env: str) -> Any:
    """An on/off option with its variable (``true`` / ``false``, ``1`` / ``0``, ``yes`` / ``no``, ``on`` / ``off``)."""
    return option(default, doc, env=env, parse=parse_bool, check=boolean)


def resolve_fields(owner: Any, prefix: str = "") -> dict[str, Any]:
    """Each option field of the dataclass instance ``owner``: its keyword value, else its variable, else its
    default; checked. Errors name ``prefix + field`` (``Stats.max_tensors``) or the variable."""
    values = {}
    for item in fields(owner):
        meta = item.metadata
        if "doc" not in meta:
            continue
        value, label = getattr(owner, item.name), prefix + item.name
        if value is None and meta["env"] is not None and env_text(meta["env"]) is not None:
            label, text = meta["env"], env_text(meta["env"])
            value = meta["parse"](label, text) if meta["parse"] else text
        if value is None:
            value = meta["default"]
        elif meta["check"] is not None:
            value = meta["check"](label, value)
        values[item.name] = value
    return values


class _Group:
    """A value object of related options: build it with the options you set; the rest are resolved (keyword >
    variable > default) when ``instrument()`` takes it."""

    def resolved(self) -> Any:
        return replace(self, **resolve_fields(self, f"{type(self).__name__}."))

    def given(self) -> dict[str, Any]:
        """The options set on this object (not None)."""
        return {item.name: getattr(self, item.name) for item in fields(self) if getattr(self, item.name) is not None}


@dataclass(frozen=True)
class Stats(_Group):
    """Which statistics each span carries, of which tensors: ``stats=Stats(...)`` where names alone are not enough.

    Args:
        names: ``True`` / ``"all"``, ``False`` / ``"none"``, or statistic names from ``STAT_NAMES``.
        extra: ``{"name": fn(tensor) -> number}``: statistics of your own, on every summarised tensor.
        inputs: summarise module inputs too.
        max_tensors: tensors summarised per output (and per input).
        sample: summarise a larger tensor from an evenly spaced sample of about this many elements.
        batch: on a GPU, reduce the statistics of up to this many output tensors with one kernel launch (1: each at
            once). Tensors wait, referenced, until then; see docs/gpus.md.
        batch_mb: MiB of waiting tensors that launch their batch early (the memory batching may hold per thread).
        on_nonfinite: on a NaN/Inf output: ``None`` (mark the span), ``"raise"``, or a callable(``NonFiniteError``).
    """

    names: bool | str | Iterable[str] | None = option(
        STAT_NAMES, "`True`/`False`, or statistic names (env: comma-separated, `all`, `none`)",
        env="TORCHTRACE_STATS", parse=_stat_names, check=_stat_names, shown="`all`",
    )  # fmt: skip
    extra: Mapping[str, StatFunction] | None = option(
        MappingProxyType({}), '`{"name": fn(tensor) -> number}`: statistics of your own', check=_extra_stats
    )
    inputs: bool | None = switch(False, "statistics of inputs too", "TORCHTRACE_INPUTS")
    max_tensors: int | None = option(
        8, "tensors summarised per output / input", env="TORCHTRACE_MAX_TENSORS", parse=parse_int, check=number(1)
    )
    sample: int | None = option(
        None, "`None`: every element; else summarise larger tensors from about this many",
        env="TORCHTRACE_STATS_SAMPLE", parse=parse_int, check=number(1),
    )  # fmt: skip
    batch: int | None = option(
        1, "on a GPU: output tensors whose statistics one kernel launch reduces (1: each at once; at most 8)",
        env="TORCHTRACE_STATS_BATCH", parse=parse_int, check=number(1, 8),
    )  # fmt: skip
    batch_mb: float | None = option(
        64.0, "MiB of tensors waiting for a batched launch that launch it early",
        env="TORCHTRACE_STATS_BATCH_MB", parse=parse_float, check=number(0, integer=False),
    )  # fmt: skip
    on_nonfinite: str | Callable[[Any], Any] | None = option(
        None, '`None` (mark the span only), `"raise"` or a callable(`NonFiniteError`)', check=_nonfinite
    )


@dataclass(frozen=True)
class TraceFile(_Group):
    """The ``file`` exporter's OTLP JSON lines file and its rotation: ``trace_file=TraceFile(...)`` where a path
    alone is not enough.

    Args:
        path: the file; its directory is made at ``instrument()``.
        max_mb: rotate past this many MiB (0: never).
        backups: rotated files kept: ``traces.jsonl.1`` (newest) ... ``.5`` (at most 1000).
    """

    path: str | os.PathLike | None = option(
        DEFAULT_TRACE_FILE,
        "path of the OTLP JSON lines written by the `file` exporter; its directory is made at `instrument()` "
        "(a `ValueError` where it cannot be)",
        env=ENV_TRACE_FILE, check=_path,
    )  # fmt: skip
    max_mb: float | None = option(
        100.0, "rotate the trace file past this many MiB (a number; 0: never)",
        env="TORCHTRACE_TRACE_FILE_MAX_MB", parse=parse_float, check=number(0, integer=False),
    )  # fmt: skip
    backups: int | None = option(
        5, "rotated files kept: `traces.jsonl.1` (newest) ... `.5` (at most 1000)",
        env="TORCHTRACE_TRACE_FILE_BACKUPS", parse=parse_int, check=number(0, MAX_TRACE_FILE_BACKUPS),
    )  # fmt: skip


@dataclass(frozen=True)
class Records(_Group):
    """The in-memory records (``handle.records``), in the style of spikingjelly's monitors.

    Args:
        max_records: records kept (oldest dropped first, counted).
        function_on_output / function_on_input: ``f(output)`` / ``f(input)`` kept in ``record.output_value`` /
            ``record.input_value``.
        module_attributes: module attributes read after each call, in ``record.module_attributes``;
            ``function_on_attribute`` maps each value, ``attributes_before_forward`` reads them before the call.
        function_on_grad_output / function_on_grad_input: with ``backward=True``, kept in the backward record.
        capture_tensors: full output tensors copied to CPU, in ``record.tensors``, within ``capture_max_bytes``
            (calls past it are skipped, counted); ``capture_compress``: zlib-compressed.
    """

    max_records: int | None = option(
        10_000, "in-memory records kept (oldest dropped first, counted)",
        env="TORCHTRACE_MAX_RECORDS", parse=parse_int, check=number(1),
    )  # fmt: skip
    function_on_output: Callable[[Any], Any] | None = option(
        None, "`f(output)` kept in `record.output_value`", check=_callable_or_none
    )
    function_on_input: Callable[[Any], Any] | None = option(
        None, "`f(input)` kept in `record.input_value`", check=_callable_or_none
    )
    module_attributes: str | Iterable[str] | None = option(
        (), "module attributes read after each call, in `record.module_attributes`", check=_attribute_names
    )
    function_on_attribute: Callable[[Any], Any] | None = option(
        None, "`f(value)` kept for each module attribute instead of a copy", check=_callable_or_none
    )
    attributes_before_forward: bool | None = option(
        False, "read module attributes before the call instead", check=boolean
    )
    function_on_grad_output: Callable[[Any], Any] | None = option(
        None, "with `backward=True`: `f(grad_output)` in the backward record", check=_callable_or_none
    )
    function_on_grad_input: Callable[[Any], Any] | None = option(
        None, "with `backward=True`: `f(grad_input)` in the backward record", check=_callable_or_none
    )
    capture_tensors: bool | None = option(
        False, "full output tensors copied to CPU, in `record.tensors`", check=boolean
    )
    capture_max_bytes: int | None = option(
        64 * 1024 * 1024, "byte budget of captured tensors (calls past it are skipped, counted)", check=number(1)
    )
    capture_compress: bool | None = option(False, "zlib-compress captured tensors", check=boolean)


@dataclass(frozen=True)
class Training(_Group):
    """Training details beyond ``backward=`` and ``optimizer=``.

    Args:
        schedule: ``step -> bool``: which steps are traced (``torchtrace.schedule(...)``, ``every(n)``).
        param_stats: parameter and parameter-gradient norms on backward spans.
        comm_hook: ``(hook, state)``: your DDP comm hook, timed per bucket (default: DDP's all-reduce).
        rank_detail: in a distributed job, which ranks send module spans: ``"all"``, or ``"auto"``: every rank sends
            its step and phase spans, module spans come only from ``detail_ranks``, the step's straggler, the rank
            where a NaN/Inf started and a rank whose forward raised (default: ``"auto"`` from 64 ranks, where every
            rank's module spans would make a step's trace too large to draw or ingest; else ``"all"``).
        detail_ranks: the ranks that always send module spans under ``"auto"`` (default: rank 0).
        rotating_detail: under ``"auto"``, this many more ranks send their module spans each traced step, in turn,
            so that every rank is seen in detail now and then (default: 0, none).
    """

    schedule: Callable[[int], bool] | None = option(
        None, "`step -> bool`: which steps are traced (`None`: every step; env: every Nth)",
        env="TORCHTRACE_STEP_EVERY", parse=_every_nth_step, check=_schedule,
    )  # fmt: skip
    param_stats: bool | None = switch(
        False, "parameter / parameter-gradient norms on backward spans", "TORCHTRACE_PARAM_STATS"
    )
    comm_hook: tuple[Callable, Any] | None = option(
        None, "`(hook, state)`: your DDP comm hook, timed per bucket (`None`: DDP's all-reduce)", check=_comm_hook
    )
    rank_detail: str | None = option(
        None, "`all`, or `auto`: module spans only from `detail_ranks`, a step's straggler, the rank where a NaN/Inf "
        "started, a rank that raised (see DDP); default `auto` from 64 ranks, else `all`",
        env="TORCHTRACE_RANK_DETAIL", parse=_rank_detail, check=_rank_detail, shown="`all` below 64 ranks",
    )  # fmt: skip
    detail_ranks: Iterable[int] | None = option(
        (0,), "the ranks that always send module spans under `rank_detail=\"auto\"` (env: comma-separated)",
        env="TORCHTRACE_DETAIL_RANKS", parse=_rank_numbers, check=_rank_numbers,
    )  # fmt: skip
    rotating_detail: int | None = option(
        0, "under `rank_detail=\"auto\"`: this many more ranks send module spans each traced step, in turn (every "
        "rank once every world size / this many traced steps)",
        env="TORCHTRACE_ROTATING_DETAIL", parse=parse_int, check=number(0),
    )  # fmt: skip


@dataclass(frozen=True)
class Limits(_Group):
    """How much waits for export, and how long.

    Args:
        export_interval_ms: how often the worker sends OTLP / file batches.
        max_pending_calls: calls waiting for the worker or the exporter before whole forwards are dropped
            (counted, logged).
    """

    export_interval_ms: int | None = option(
        1000, "how often the worker sends OTLP / file batches",
        env="TORCHTRACE_EXPORT_INTERVAL_MS", parse=parse_int, check=number(1, MAX_EXPORT_INTERVAL_MS),
    )  # fmt: skip
    max_pending_calls: int | None = option(
        200_000,
        "calls waiting for the worker or the exporter before whole forwards are dropped (counted, logged; at most "
        "10**9)",
        env="TORCHTRACE_MAX_PENDING_CALLS", parse=parse_int, check=number(1, MAX_PENDING_CALLS),
    )  # fmt: skip


@dataclass(frozen=True)
class Drift(_Group):
    """Layer drift against a baseline: ``baseline=Drift(...)`` where a path alone is not enough.

    Args:
        baseline: a ``Baseline`` or the path of one (``torchtrace baseline``, ``handle.baseline()``); it must be of
            this model (its class, parameter count and layers), else ``instrument()`` raises.
        window: the calls of a layer each score is over.
        threshold: the score's unit, in standard deviations of the window's mean rank: a score of 1.0 (the alert)
            is ``threshold`` of them away from the baseline.
    """

    baseline: str | os.PathLike | Baseline | None = option(
        None, "a `Baseline` or its path: each traced layer's statistics are scored against it (`None`: no drift)",
        env="TORCHTRACE_BASELINE", parse=_baseline, check=_baseline,
    )  # fmt: skip
    window: int | None = option(
        32, "the calls of a layer each drift score is over",
        env="TORCHTRACE_DRIFT_WINDOW", parse=parse_int, check=number(2, 100_000),
    )  # fmt: skip
    threshold: float | None = option(
        6.0, "standard deviations of a window's mean rank that make a drift score of 1.0 (the alert)",
        env="TORCHTRACE_DRIFT_THRESHOLD", parse=parse_float, check=number(0.5, 1000, integer=False),
    )  # fmt: skip


GROUPS: dict[str, type[_Group]] = {  # keyword -> its option object
    "stats": Stats,
    "trace_file": TraceFile,
    "records": Records,
    "training": Training,
    "limits": Limits,
    "baseline": Drift,
}
# What a plain value of a grouped keyword means: stats=True is Stats(names=True), trace_file="t.jsonl" a path.
_PLAIN_FIELD = {"stats": "names", "trace_file": "path", "baseline": "baseline"}
PLAIN_VALUES = {
    "stats": "`True`/`False` or statistic names (its `names`)",
    "trace_file": "a path (its `path`)",
    "baseline": "a path or a `Baseline` (its `baseline`)",
}


@dataclass(frozen=True)
class Options:
    """The effective configuration of one ``instrument()`` call: the plain keywords, and each option object with
    every field resolved."""

    exporter: str | None = option(
        "auto", "where spans go: `auto`, `otlp`, `sdk`, `file` or `none` (see Getting started, Export)",
        env=ENV_EXPORTER, check=_exporter, parse=_exporter,
    )  # fmt: skip
    tracer_provider: Any = option(
        None, "the SDK `TracerProvider` of the `sdk` exporter (`None`: the global one)", check=_tracer_provider
    )
    trace_file: TraceFile = field(default_factory=TraceFile)
    include: tuple[str, ...] | None = option(
        ("*",), "globs over module paths (comma-separated in env)", env="TORCHTRACE_INCLUDE", parse=_globs, check=_globs
    )
    exclude: tuple[str, ...] | None = option(
        (), "globs over module paths", env="TORCHTRACE_EXCLUDE", parse=_globs, check=_globs
    )
    types: tuple[type, ...] | None = option(
        (), "a module class or tuple of classes (env: dotted names); empty: all",
        env="TORCHTRACE_TYPES", parse=_import_types, check=_types,
    )  # fmt: skip
    max_depth: int | None = option(
        None, "`None`: unlimited; 0 = the model only, 1 = its children, ...",
        env="TORCHTRACE_MAX_DEPTH", parse=parse_int, check=number(0),
    )  # fmt: skip
    stats: Stats = field(default_factory=Stats)
    sample_every: int | None = option(
        1, "trace every Nth outermost forward (in training: every Nth step)",
        env="TORCHTRACE_SAMPLE_EVERY", parse=parse_int, check=number(1),
    )  # fmt: skip
    sample_ratio: float | None = option(
        1.0, "trace this fraction of outermost forwards (in training: of steps, the same on every rank)",
        env="TORCHTRACE_SAMPLE_RATIO", parse=parse_float, check=number(0, 1, integer=False),
    )  # fmt: skip
    backward: bool | None = switch(False, "module backward spans with gradient statistics", "TORCHTRACE_BACKWARD")
    optimizer: Any = option(None, "its `step()` is timed and closes each training step", check=_optimizer)
    training: Training = field(default_factory=Training)
    metrics: Any = option(
        False, "a `MetricsSink`, or `True`: one on the global registry; `TORCHTRACE_METRICS_PORT` turns it on",
        env=ENV_METRICS, parse=parse_bool, check=_metrics,
    )  # fmt: skip
    sinks: tuple[Callable, ...] | None = option(
        (), "extra callables receiving each batch of calls off the hot path (within ~5-100 ms)", check=_sinks
    )
    records: Records = field(default_factory=Records)
    limits: Limits = field(default_factory=Limits)
    baseline: Drift = field(default_factory=Drift)


def keyword_set(kwargs: Mapping[str, Any]) -> set[str]:
    """The options (as ``option_rows`` names them) that keyword arguments set: ``stats=True`` sets ``Stats.names``,
    ``stats=Stats(inputs=True)`` sets ``Stats.inputs``."""
    found = set()
    for keyword, value in kwargs.items():
        kind = GROUPS.get(keyword)
        if value is None:
            continue
        if kind is None:
            found.add(keyword)
        elif isinstance(value, kind):
            found |= {f"{kind.__name__}.{name}" for name in value.given()}
        elif keyword in _PLAIN_FIELD:
            found.add(f"{kind.__name__}.{_PLAIN_FIELD[keyword]}")
    return found


def _group(keyword: str, value: Any) -> _Group:
    kind = GROUPS[keyword]
    if value is None:
        value = kind()
    elif not isinstance(value, kind):
        if keyword not in _PLAIN_FIELD:
            raise TypeError(f"{keyword} must be a torchtrace.{kind.__name__}, got {value!r}")
        value = kind(**{_PLAIN_FIELD[keyword]: value})
    return value.resolved()


def resolve_options(**kwargs: Any) -> Options:
    """Merges keyword arguments over environment variables over defaults, validating everything."""
    known = {item.name for item in fields(Options)}
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(f"instrument() got unknown option(s): {', '.join(sorted(unknown))}")
    plain = Options(**{name: value for name, value in kwargs.items() if name not in GROUPS})
    values = resolve_fields(plain)
    if values["metrics"] is False and kwargs.get("metrics") is None and env_text(ENV_METRICS) is None:
        values["metrics"] = env_text(ENV_METRICS_PORT) is not None
    options = Options(**values, **{name: _group(name, kwargs.get(name)) for name in GROUPS})
    if options.tracer_provider is not None and options.exporter not in ("auto", "sdk"):
        raise ValueError(
            f"tracer_provider is used by the 'sdk' exporter; exporter={options.exporter!r} would ignore it"
        )
    return options


def option_rows() -> list[tuple[str | None, str, Any]]:
    """(its keyword's option object, or None for a plain keyword; name; field) of every option, in the order
    ``instrument()`` lists them: a grouped one is named ``Group.field``."""
    rows = []
    for item in fields(Options):
        if item.name in GROUPS:
            kind = GROUPS[item.name]
            rows += [(item.name, f"{kind.__name__}.{inner.name}", inner) for inner in fields(kind)]
        else:
            rows.append((None, item.name, item))
    return rows
