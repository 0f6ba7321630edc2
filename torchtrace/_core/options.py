"""Options of ``torchtrace.instrument``: keyword argument, else ``TORCHTRACE_*`` environment variable, else default.

Every environment variable is a constant here, documented once. Invalid values raise at ``instrument()`` time,
never inside a hook.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry import trace

ENV_EXPORTER = "TORCHTRACE_EXPORTER"  # auto | otlp | sdk | file | none
ENV_TRACE_FILE = "TORCHTRACE_TRACE_FILE"  # path of the OTLP JSON file written by the "file" exporter
ENV_INCLUDE = "TORCHTRACE_INCLUDE"  # comma-separated globs over module paths
ENV_EXCLUDE = "TORCHTRACE_EXCLUDE"  # comma-separated globs over module paths
ENV_TYPES = "TORCHTRACE_TYPES"  # comma-separated dotted class names, e.g. torch.nn.Linear
ENV_MAX_DEPTH = "TORCHTRACE_MAX_DEPTH"  # deepest module path traced; 0 is the model itself
ENV_STATS = "TORCHTRACE_STATS"  # comma-separated statistic names, "all" or "none"
ENV_INPUTS = "TORCHTRACE_INPUTS"  # true: also summarise module inputs
ENV_SAMPLE_EVERY = "TORCHTRACE_SAMPLE_EVERY"  # trace every Nth outermost forward
ENV_SAMPLE_RATIO = "TORCHTRACE_SAMPLE_RATIO"  # trace this fraction of outermost forwards
ENV_MAX_RECORDS = "TORCHTRACE_MAX_RECORDS"  # in-memory records kept (oldest dropped first)
ENV_MAX_TENSORS = "TORCHTRACE_MAX_TENSORS"  # tensors summarised per module output (and per input)
ENV_STATS_SAMPLE = "TORCHTRACE_STATS_SAMPLE"  # summarise larger tensors from an evenly spaced sample of this many
ENV_EXPORT_INTERVAL = "TORCHTRACE_EXPORT_INTERVAL_MS"  # how often the background worker drains the buffer
ENV_MAX_PENDING = "TORCHTRACE_MAX_PENDING_CALLS"  # calls buffered before whole forwards are dropped (counted)
ENV_METRICS = "TORCHTRACE_METRICS"  # true: aggregate Prometheus metrics (set by TORCHTRACE_METRICS_PORT too)
ENV_BACKWARD = "TORCHTRACE_BACKWARD"  # true: a span per module backward, with gradient statistics
ENV_STEP_EVERY = "TORCHTRACE_STEP_EVERY"  # trace every Nth training step (schedule=every(N))
ENV_PARAM_STATS = "TORCHTRACE_PARAM_STATS"  # true: parameter and parameter-gradient norms on backward spans
ENV_CUDA_EVENTS = "TORCHTRACE_CUDA_EVENTS"  # true (default): CUDA module durations from events, not the host clock
ENV_TRITON = "TORCHTRACE_TRITON"  # false: CUDA statistics with torch ops, never the Triton kernel (process-wide)
ENV_PRINT_SUMMARY = "TORCHTRACE_PRINT_SUMMARY"  # print the per-layer table at remove()/exit (default: file exporter)
ENV_TRACE_FILE_MAX_MB = "TORCHTRACE_TRACE_FILE_MAX_MB"  # the trace file is rotated past this size; 0: never
ENV_TRACE_FILE_BACKUPS = "TORCHTRACE_TRACE_FILE_BACKUPS"  # rotated trace files kept (traces.jsonl.1 ... .N)
ENV_HANDLE_SIGTERM = "TORCHTRACE_HANDLE_SIGTERM"  # false: install no SIGTERM handler (no flush on a stop)

EXPORTERS = ("auto", "otlp", "sdk", "file", "none")
STAT_NAMES = (  # what ``stats=`` may name (``_stats`` computes them), in the order spans and tables show them
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
# A user statistic (``extra_stats=``): tensor -> number (a 1-element tensor is read with .item()).
StatFunction = Callable[[torch.Tensor], "float | int | bool | torch.Tensor"]
DEFAULT_TRACE_FILE = os.path.join("torchtrace-traces", "traces.jsonl")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Options:
    """The effective configuration of one ``instrument()`` call."""

    exporter: str = "auto"
    tracer_provider: Any = None
    trace_file: str = DEFAULT_TRACE_FILE
    trace_file_max_mb: float = 100.0  # rotate the trace file past this many MiB; 0: never
    trace_file_backups: int = 5  # rotated files kept: trace_file.1 (newest) ... trace_file.5
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    types: tuple[type, ...] = ()
    max_depth: int | None = None
    stats: tuple[str, ...] = STAT_NAMES
    extra_stats: Mapping[str, StatFunction] = field(default_factory=dict)
    inputs: bool = False
    max_tensors: int = 8
    stats_sample: int | None = None  # None: every element; else at most about this many per tensor (strided)
    sample_every: int = 1
    sample_ratio: float = 1.0
    max_records: int = 10_000
    function_on_output: Callable[[Any], Any] | None = None
    function_on_input: Callable[[Any], Any] | None = None
    module_attributes: tuple[str, ...] = ()
    function_on_attribute: Callable[[Any], Any] | None = None  # applied to each module attribute's value
    attributes_before_forward: bool = False  # read module attributes in the pre-hook (spikingjelly's pre_forward)
    function_on_grad_output: Callable[[Any], Any] | None = None  # kept in a backward record's output_value
    function_on_grad_input: Callable[[Any], Any] | None = None  # kept in a backward record's input_value
    capture_tensors: bool = False
    capture_max_bytes: int = 64 * 1024 * 1024
    capture_compress: bool = False
    export_interval_ms: int = 1000
    max_pending_calls: int = 200_000
    sinks: tuple[Callable, ...] = ()
    print_summary: bool | None = None  # None: only when traces go to the embedded default file
    metrics: Any = None  # False/None, True (a MetricsSink on the global registry) or a MetricsSink
    backward: bool = False
    schedule: Callable[[int], bool] | None = None  # step -> traced?; None traces every step
    optimizer: Any = None  # a torch.optim.Optimizer whose step() closes each training step
    param_stats: bool = False
    on_nonfinite: Any = None  # None, "raise" or callable(NonFiniteError)
    comm_hook: Any = None  # (hook, state): a DDP comm hook of the user's, timed instead of the default all-reduce
    cuda_events: bool = True  # time CUDA forwards with events (execution) rather than the host clock (launch)
    handle_sigterm: bool = True  # on SIGTERM: deliver what was recorded, then end as the signal would have


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected true or false")


def triton_allowed() -> bool:
    """Whether CUDA statistics may use the Triton kernel: ``TORCHTRACE_TRITON``, read when the first CUDA tensor
    is summarised (process-wide, like the kernel's compile cache)."""
    text = os.environ.get(ENV_TRITON)
    return text is None or _parse_bool(ENV_TRITON, text)


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None


def _parse_float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number") from None


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _import_type(dotted: str) -> type:
    module_name, _, attribute = dotted.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"{ENV_TYPES}: cannot import module type {dotted!r}") from None
    if not isinstance(found, type):
        raise ValueError(f"{ENV_TYPES}: {dotted!r} is not a class")
    return found


def _globs(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = _split(value) if "," in value else (value,)
    if not isinstance(value, Sequence) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"{name} must be a glob string or a sequence of glob strings, got {value!r}")
    return tuple(value)


def _types(value: Any) -> tuple[type, ...]:
    if value is None:
        return ()
    if isinstance(value, type):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(item, type) for item in value):
        raise TypeError(f"types must be a module class or a tuple of module classes, got {value!r}")
    for item in value:
        if not issubclass(item, torch.nn.Module):
            raise TypeError(f"types: {item.__name__} is not a torch.nn.Module subclass")
    return tuple(value)


def _stats(value: Any) -> tuple[str, ...]:
    if value is True or value == "all":
        return STAT_NAMES
    if value is False or value is None or value == "none":
        return ()
    if isinstance(value, str):
        value = _split(value)
    if not isinstance(value, (tuple, list, set, frozenset)):
        raise TypeError(f"stats must be True, False, 'all', 'none' or a sequence of names, got {value!r}")
    unknown = [name for name in value if name not in STAT_NAMES]
    if unknown:
        raise ValueError(
            f"unknown statistic(s) {unknown}; known: {', '.join(STAT_NAMES)} (add your own with extra_stats)"
        )
    return tuple(name for name in STAT_NAMES if name in value)


def _bool_option(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _metrics_option(value: Any) -> Any:
    if value is None:
        if _env(ENV_METRICS) is not None:
            return _parse_bool(ENV_METRICS, _env(ENV_METRICS))
        return _env("TORCHTRACE_METRICS_PORT") is not None  # asking for an endpoint asks for metrics
    if isinstance(value, bool) or callable(value):
        return value
    raise TypeError(f"metrics must be True, False or a MetricsSink, got {value!r}")


def _schedule_option(value: Any) -> Callable[[int], bool] | None:
    if value is None:
        text = _env(ENV_STEP_EVERY)
        if text is None:
            return None
        from torchtrace._core.schedule import every

        n = _parse_int(ENV_STEP_EVERY, text)
        _check_number(ENV_STEP_EVERY, n, True, 1, None)
        return every(n)
    if not callable(value):
        raise TypeError(f"schedule must be a callable step -> bool (e.g. torchtrace.schedule(...)), got {value!r}")
    return value


def _optimizer_option(value: Any) -> Any:
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
    raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper of one), got {type(value).__name__}")


def _nonfinite_option(value: Any) -> Any:
    if value is None or value == "raise" or callable(value):
        return value
    raise ValueError(f"on_nonfinite must be None, 'raise' or a callable, got {value!r}")


def _comm_hook_option(value: Any) -> Any:
    if value is not None and not (isinstance(value, tuple) and len(value) == 2 and callable(value[0])):
        raise TypeError(f"comm_hook must be a (hook, state) pair as for DDP.register_comm_hook, got {value!r}")
    return value


# The longest export interval, a year: the worker waits with threading's timed wait (far longer overflows it).
MAX_EXPORT_INTERVAL_MS = 365 * 24 * 3600 * 1000
MAX_TRACE_FILE_BACKUPS = 1000  # each rotation renames every backup: 10**6 of them took 7.4 s on the model's thread
MAX_PENDING_CALLS = 10**9  # calls held for export (each a few hundred bytes): past this, a bound that bounds nothing


def _check_number(label: str, value: Any, integer: bool, low: float, high: float | None) -> None:
    """``value`` is a number (an int where ``integer``; never a bool, NaN or infinity) in ``[low, high]``; the error
    names ``label``: the keyword, or the environment variable the value came from."""
    kind = "an integer" if integer else "a number"
    bounds = f">= {low}" if high is None else f"between {low} and {high}"
    number = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not number or value < low or (high is not None and value > high):
        raise ValueError(f"{label} must be {kind} {bounds}, got {value!r}")


def _optional_bool(name: str, value: Any) -> bool | None:
    return None if value is None else _bool_option(name, value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def resolve_options(**kwargs: Any) -> Options:
    """Merges keyword arguments over environment variables over defaults, validating everything."""
    unknown = set(kwargs) - {f.name for f in Options.__dataclass_fields__.values()}
    if unknown:
        raise TypeError(f"instrument() got unknown option(s): {', '.join(sorted(unknown))}")

    def pick(name: str, env_name: str | None, parse: Callable[[str, str], Any] | None = None) -> Any:
        if kwargs.get(name) is not None:
            return kwargs[name]
        text = _env(env_name) if env_name else None
        if text is not None:
            return parse(env_name, text) if parse else text
        return Options.__dataclass_fields__[name].default

    def number(name: str, env_name: str | None, low: float, high: float | None = None, integer: bool = True) -> Any:
        """A numeric option, checked against what the hot path and the export path can take."""
        value, label = kwargs.get(name), name
        if value is None and env_name is not None and _env(env_name) is not None:
            value, label = (_parse_int if integer else _parse_float)(env_name, _env(env_name)), env_name
        if value is None:
            return Options.__dataclass_fields__[name].default
        _check_number(label, value, integer, low, high)
        return value

    exporter = pick("exporter", ENV_EXPORTER)
    if not isinstance(exporter, str):
        raise TypeError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    exporter = exporter.lower()
    _require(exporter in EXPORTERS, f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    types_value = kwargs.get("types")
    if types_value is None and _env(ENV_TYPES):
        types_value = tuple(_import_type(name) for name in _split(_env(ENV_TYPES)))
    max_depth = number("max_depth", ENV_MAX_DEPTH, 0)
    sample_every = number("sample_every", ENV_SAMPLE_EVERY, 1)
    sample_ratio = number("sample_ratio", ENV_SAMPLE_RATIO, 0, 1, integer=False)
    trace_file = pick("trace_file", ENV_TRACE_FILE)
    if not isinstance(trace_file, (str, os.PathLike)) or not str(trace_file):
        raise TypeError(f"trace_file must be a path (str or os.PathLike), got {trace_file!r}")
    provider = kwargs.get("tracer_provider")
    if provider is not None and not isinstance(provider, trace.TracerProvider):
        raise TypeError(f"tracer_provider must be an opentelemetry TracerProvider, got {type(provider).__name__}")
    extra_stats = dict(kwargs.get("extra_stats") or {})
    for name, function in extra_stats.items():
        _require(isinstance(name, str) and name.isidentifier(), f"extra_stats: {name!r} is not a valid statistic name")
        if not callable(function):
            raise TypeError(f"extra_stats[{name!r}] must be callable, got {function!r}")
    for name in (
        "function_on_output",
        "function_on_input",
        "function_on_attribute",
        "function_on_grad_output",
        "function_on_grad_input",
    ):
        if kwargs.get(name) is not None and not callable(kwargs[name]):
            raise TypeError(f"{name} must be callable, got {kwargs[name]!r}")
    module_attributes = kwargs.get("module_attributes") or ()
    if isinstance(module_attributes, str):
        module_attributes = (module_attributes,)
    if not isinstance(module_attributes, Iterable) or not all(isinstance(name, str) for name in module_attributes):
        raise TypeError(f"module_attributes must be attribute names, got {module_attributes!r}")
    sinks = kwargs.get("sinks") or ()
    if callable(sinks) or not isinstance(sinks, Iterable) or not all(callable(sink) for sink in sinks):
        raise TypeError(f"sinks must be a sequence of callables taking a sequence of ModuleCall, got {sinks!r}")
    sinks = tuple(sinks)

    options = Options(
        exporter=exporter,
        tracer_provider=provider,
        trace_file=os.fspath(trace_file),
        trace_file_max_mb=number("trace_file_max_mb", ENV_TRACE_FILE_MAX_MB, 0, integer=False),
        trace_file_backups=number("trace_file_backups", ENV_TRACE_FILE_BACKUPS, 0, MAX_TRACE_FILE_BACKUPS),
        include=_globs("include", pick("include", ENV_INCLUDE)),
        exclude=_globs("exclude", pick("exclude", ENV_EXCLUDE)),
        types=_types(types_value),
        max_depth=max_depth,
        stats=_stats(pick("stats", ENV_STATS)),
        extra_stats=extra_stats,
        inputs=_bool_option("inputs", pick("inputs", ENV_INPUTS, _parse_bool)),
        max_tensors=number("max_tensors", ENV_MAX_TENSORS, 1),
        stats_sample=number("stats_sample", ENV_STATS_SAMPLE, 1),
        sample_every=sample_every,
        sample_ratio=float(sample_ratio),
        max_records=number("max_records", ENV_MAX_RECORDS, 1),
        function_on_output=kwargs.get("function_on_output"),
        function_on_input=kwargs.get("function_on_input"),
        module_attributes=tuple(module_attributes),
        function_on_attribute=kwargs.get("function_on_attribute"),
        attributes_before_forward=_bool_option(
            "attributes_before_forward", kwargs.get("attributes_before_forward", False)
        ),
        function_on_grad_output=kwargs.get("function_on_grad_output"),
        function_on_grad_input=kwargs.get("function_on_grad_input"),
        capture_tensors=_bool_option("capture_tensors", kwargs.get("capture_tensors", False)),
        capture_max_bytes=number("capture_max_bytes", None, 1),
        capture_compress=_bool_option("capture_compress", kwargs.get("capture_compress", False)),
        export_interval_ms=number("export_interval_ms", ENV_EXPORT_INTERVAL, 1, MAX_EXPORT_INTERVAL_MS),
        max_pending_calls=number("max_pending_calls", ENV_MAX_PENDING, 1, MAX_PENDING_CALLS),
        sinks=sinks,
        print_summary=_optional_bool("print_summary", pick("print_summary", ENV_PRINT_SUMMARY, _parse_bool)),
        metrics=_metrics_option(kwargs.get("metrics")),
        backward=_bool_option("backward", pick("backward", ENV_BACKWARD, _parse_bool)),
        schedule=_schedule_option(kwargs.get("schedule")),
        optimizer=_optimizer_option(kwargs.get("optimizer")),
        param_stats=_bool_option("param_stats", pick("param_stats", ENV_PARAM_STATS, _parse_bool)),
        on_nonfinite=_nonfinite_option(kwargs.get("on_nonfinite")),
        comm_hook=_comm_hook_option(kwargs.get("comm_hook")),
        cuda_events=_bool_option("cuda_events", pick("cuda_events", ENV_CUDA_EVENTS, _parse_bool)),
        handle_sigterm=_bool_option("handle_sigterm", pick("handle_sigterm", ENV_HANDLE_SIGTERM, _parse_bool)),
    )
    triton_allowed()  # a malformed TORCHTRACE_TRITON raises here, not in a hook
    if options.tracer_provider is not None and exporter not in ("auto", "sdk"):
        raise ValueError(f"tracer_provider is used by the 'sdk' exporter; exporter={exporter!r} would ignore it")
    return options


# The documentation of each option, one row each, grouped: docs/configuration.md is generated from this table, the
# names, environment variables and defaults above (docs/hooks/config_tables.py), and the docs build fails when an
# option has no row here. (group, what it does)
OPTION_DOCS: dict[str, tuple[str, str]] = {
    "exporter": ("Export", "where spans go: `auto`, `otlp`, `sdk`, `file` or `none` (see Getting started, Export)"),
    "tracer_provider": ("Export", "the SDK `TracerProvider` of the `sdk` exporter (`None`: the global one)"),
    "trace_file": (
        "Export",
        "path of the OTLP JSON lines written by the `file` exporter; its directory is made at `instrument()` "
        "(a `ValueError` where it cannot be)",
    ),
    "trace_file_max_mb": ("Export", "rotate the trace file past this many MiB (a number; 0: never)"),
    "trace_file_backups": ("Export", "rotated files kept: `traces.jsonl.1` (newest) ... `.5` (at most 1000)"),
    "export_interval_ms": ("Export", "how often the worker sends OTLP / file batches"),
    "max_pending_calls": (
        "Export",
        "calls waiting for the worker or the exporter before whole forwards are dropped (counted, logged; at most "
        "10**9)",
    ),
    "print_summary": (
        "Export",
        "print the per-layer table at `remove()` / exit (`None`: with the embedded file default)",
    ),
    "handle_sigterm": ("Export", "on SIGTERM, deliver what was recorded, then end as the signal would have"),
    "include": ("Selection", "globs over module paths (comma-separated in env)"),
    "exclude": ("Selection", "globs over module paths"),
    "types": ("Selection", "a module class or tuple of classes (env: dotted names); empty: all"),
    "max_depth": ("Selection", "`None`: unlimited; 0 = the model only, 1 = its children, ..."),
    "stats": ("Statistics", "`True`/`False`, or statistic names (env: comma-separated, `all`, `none`)"),
    "extra_stats": ("Statistics", '`{"name": fn(tensor) -> number}`: statistics of your own'),
    "inputs": ("Statistics", "statistics of inputs too"),
    "max_tensors": ("Statistics", "tensors summarised per output / input"),
    "stats_sample": ("Statistics", "`None`: every element; else summarise larger tensors from about this many"),
    "sample_every": ("Sampling", "trace every Nth outermost forward (in training: every Nth step)"),
    "sample_ratio": (
        "Sampling",
        "trace this fraction of outermost forwards (in training: of steps, the same on every rank)",
    ),
    "max_records": ("Records API", "in-memory records kept (oldest dropped first, counted)"),
    "function_on_output": ("Records API", "`f(output)` kept in `record.output_value`"),
    "function_on_input": ("Records API", "`f(input)` kept in `record.input_value`"),
    "module_attributes": ("Records API", "module attributes read after each call, in `record.module_attributes`"),
    "function_on_attribute": ("Records API", "`f(value)` kept for each module attribute instead of a copy"),
    "attributes_before_forward": ("Records API", "read module attributes before the call instead"),
    "function_on_grad_output": ("Records API", "with `backward=True`: `f(grad_output)` in the backward record"),
    "function_on_grad_input": ("Records API", "with `backward=True`: `f(grad_input)` in the backward record"),
    "capture_tensors": ("Records API", "full output tensors copied to CPU, in `record.tensors`"),
    "capture_max_bytes": ("Records API", "byte budget of captured tensors (calls past it are skipped, counted)"),
    "capture_compress": ("Records API", "zlib-compress captured tensors"),
    "sinks": ("Records API", "extra callables receiving each batch of calls off the hot path (within ~5-100 ms)"),
    "backward": ("Training", "module backward spans with gradient statistics"),
    "schedule": ("Training", "`step -> bool`: which steps are traced (`None`: every step; env: every Nth)"),
    "optimizer": ("Training", "its `step()` is timed and closes each training step"),
    "param_stats": ("Training", "parameter / parameter-gradient norms on backward spans"),
    "on_nonfinite": ("Training", '`None` (mark the span only), `"raise"` or a callable(`NonFiniteError`)'),
    "comm_hook": (
        "Devices and DDP",
        "`(hook, state)`: your DDP comm hook, timed per bucket (`None`: DDP's all-reduce)",
    ),
    "cuda_events": ("Devices and DDP", "CUDA module durations from events (device time); false: host clock (launch)"),
    "metrics": (
        "Metrics",
        "a `MetricsSink`, or `True`: one on the global registry; `TORCHTRACE_METRICS_PORT` turns it on",
    ),
}

# Variables read outside instrument()'s options, documented next to them.
ENV_ONLY_DOCS: dict[str, str] = {
    ENV_TRITON: "false: CUDA statistics with torch ops, never the Triton kernel (process-wide, read at the first "
    "CUDA statistics)",
}
