"""``torchtrace run script.py [args]`` and ``torchtrace config``.

``run``: the script runs as ``__main__`` (runpy) with ``TorchInstrumentor`` active, so every model it calls is
traced, with no change to the script and no opentelemetry-distro. Unless the script's process already has an SDK
``TracerProvider``, one is installed globally (resource from ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``)
so the script's own spans (an HTTP server's request spans...) are exported too and become the model spans'
parents:

- with ``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT`` set, the script's spans go through the SDK's OTLP exporter and the
  model spans through torchtrace's fast OTLP path (``exporter="otlp"``), to the same endpoint;
- without, both go through that provider (``exporter="sdk"``) to the OTLP JSON trace file.

At exit (normal, exception or ``sys.exit``) every model's per-layer summary is printed to stderr, pending spans are
delivered, and the script's exit status is returned.

``config``: every option of ``instrument()`` with its effective value and where it came from (keyword, i.e. a
command-line flag; env; default), plus the standard ``OTEL_*`` settings torchtrace honours.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, TextIO

from torchtrace._core import options as _config
from torchtrace._core import settings as _settings
from torchtrace._core import signals as _signals

# standard variables torchtrace's exporters read (through opentelemetry-exporter-otlp / the SDK)
OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)
_SECRET_VARIABLES = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")


def _env_set(name: str) -> bool:
    return os.environ.get(name, "").strip() != ""


def _format(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (tuple, list)):
        return ",".join(_format(item) for item in value) if value else "(none)"
    if isinstance(value, Mapping):
        return ",".join(str(key) for key in value) if value else "(none)"
    if value is None:
        return "(unset)"
    if callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__  # a schedule, a comm hook...: every(5), not <function ... at 0x...>
    return str(value)


def _source(env: str | None, given: bool, setter: str = "keyword") -> str:
    if given:
        return setter
    return f"env {env}" if env is not None and _env_set(env) else "default"


def effective_config(keywords: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
    """One row per option (``name``, ``value``, ``source``): the plain keywords, each option object's fields
    (``Stats.inputs``), the process-wide settings, then the OTel settings. Raises ValueError/TypeError for an invalid
    option or variable, exactly as ``instrument()`` would."""
    keywords = {key: value for key, value in (keywords or {}).items() if value is not None}
    options = _config.resolve_options(**keywords)
    given = _config.keyword_set(keywords)
    rows = []
    for keyword, name, item in _config.option_rows():
        value = getattr(options, name) if keyword is None else getattr(getattr(options, keyword), item.name)
        text = _format(value)
        if name == "exporter" and value == "auto":
            text = f"auto ({_auto_exporter()})"
        rows.append({"name": name, "value": text, "source": _source(item.metadata["env"], name in given)})
    configured = _settings.configured()
    for item in fields(_settings.Settings):
        value = getattr(_settings.current(), item.name)
        source = _source(item.metadata["env"], getattr(configured, item.name) is not None, "configure()")
        rows.append({"name": f"configure.{item.name}", "value": _format(value), "source": source})
    from torchtrace._otlp import exporters as _exporters

    for name in OTEL_VARIABLES:
        if _env_set(name):
            shown = "(set, hidden)" if name in _SECRET_VARIABLES else _exporters.redact(os.environ[name])
            rows.append({"name": name, "value": shown, "source": "env"})
    defaults = {
        "otlp protocol": (_exporters.resolve_protocol(), "OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL"),
        "otlp timeout s": (str(_exporters.export_timeout_s()), "OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT"),
        "service.name": (str(_exporters.default_resource().attributes.get("service.name")), "OTEL_SERVICE_NAME"),
    }
    for name, (value, variable) in defaults.items():
        rows.append({"name": name, "value": value, "source": f"from {variable} or default"})
    return rows


def _auto_exporter() -> str:
    from opentelemetry import trace

    from torchtrace._otlp import exporters as _exporters

    if hasattr(trace.get_tracer_provider(), "add_span_processor"):
        return "sdk: a TracerProvider is installed"
    if _exporters.otlp_endpoint_configured():
        return "otlp: an endpoint is set"
    return "file: no endpoint set"


def print_config(
    keywords: Mapping[str, Any] | None = None, *, as_json: bool = False, out: TextIO | None = None
) -> None:
    out = out or sys.stdout  # looked up at call time: redirections made after import are honoured
    rows = effective_config(keywords)
    if as_json:
        import json

        print(json.dumps(rows), file=out)
        return
    width = max(len(row["name"]) for row in rows)
    value_width = min(50, max(len(row["value"]) for row in rows))
    print(f"{'option':<{width}}  {'value':<{value_width}}  source", file=out)
    for row in rows:
        print(f"{row['name']:<{width}}  {row['value']:<{value_width}}  {row['source']}", file=out)


# --- run ------------------------------------------------------------------------------------------------------


def _install_tracer_provider(trace_file: str | None = None) -> tuple[Any, bool]:
    """The global SDK TracerProvider: the one already installed, else a new one exporting like torchtrace."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from torchtrace._otlp import exporters as _exporters

    current = trace.get_tracer_provider()
    if hasattr(current, "add_span_processor"):
        return current, False
    provider = TracerProvider(resource=_exporters.default_resource(), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporters.create_sdk_span_exporter(trace_file)))
    trace.set_tracer_provider(provider)
    return provider, True


def _model_options(keywords: dict[str, Any], provider: Any) -> dict[str, Any]:
    from torchtrace._otlp import exporters as _exporters

    options = dict(keywords)
    if options.get("exporter") is None and not _env_set(_config.ENV_EXPORTER):
        options["exporter"] = "otlp" if _exporters.otlp_endpoint_configured() else "sdk"
    exporter = str(options.get("exporter") or os.environ.get(_config.ENV_EXPORTER, "auto")).strip().lower()
    if exporter in ("sdk", "auto"):
        options["tracer_provider"] = provider
    return options


def run_script(
    script: str,
    args: Sequence[str],
    keywords: Mapping[str, Any] | None = None,
    *,
    summary: bool = True,
    err: TextIO | None = None,
) -> int:
    """Runs ``script`` as ``__main__`` with every model traced; returns its exit status."""
    err = err or sys.stderr
    keywords = {key: value for key, value in (keywords or {}).items() if value is not None}
    _config.resolve_options(**keywords)  # invalid options: fail before the script starts
    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script}")
    from torchtrace.instrumentation import TorchInstrumentor

    provider, owned = _install_tracer_provider(keywords.get("trace_file"))  # --trace-file: the app's spans too
    instrumentor = TorchInstrumentor()
    instrumentor.instrument(**_model_options(keywords, provider))
    # installed before the first model runs: the script's own spans are delivered too
    if _settings.current().handle_sigterm:
        _signals.hold(provider, lambda seconds: provider.force_flush(int(seconds * 1000)))
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [script, *args]
    if sys.path:
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exited:
        code = exited.code
        if code is None:
            status = 0
        elif isinstance(code, int):
            status = code
        else:
            print(code, file=err)
            status = 1
    except Exception:  # the script's own error: reported as python reports it, not as a configuration error
        traceback.print_exc(file=err)
        status = 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        handles = instrumentor.traced_handles  # models already gone (a main() returned) included
        instrumentor.uninstrument()  # removes the hooks, delivers every pending span
        _signals.release(provider)
        if summary:
            _print_summaries(handles, err)
        if owned:
            provider.shutdown()
    return status


def _print_summaries(handles: Sequence[Any], err: TextIO) -> None:
    if not handles:
        print("torchtrace: no model was called", file=err)
        return
    for handle in handles:
        dropped = f", {handle.dropped_calls} calls dropped" if handle.dropped_calls else ""
        failed = f", {handle.failed_spans} spans failed to export" if handle.failed_spans else ""
        print(f"\ntorchtrace: {handle.model_name} ({handle.exporter} exporter{dropped}{failed})", file=err)
        print(handle.summary(limit=30), file=err)
    err.flush()
