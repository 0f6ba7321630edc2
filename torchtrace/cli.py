"""``torchtrace`` command line: ``demo``, ``run script.py [args]``, ``config``, and ``summary``, ``perfetto``,
``report`` of trace files (also ``python -m torchtrace``).

Argument parsing only; each subcommand's work lives in its own module, imported when the subcommand runs (so
``torchtrace --help`` does not import torch). Subcommands are registered in ``build_parser``: add ``run`` and
``config`` there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from torchtrace._core.options import Stats
from torchtrace.version import __version__

PROTOCOLS = ("grpc", "http/protobuf")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, with a clear message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _add_demo(subcommands: argparse._SubParsersAction) -> None:
    demo = subcommands.add_parser(
        "demo",
        help="trace a small transformer's inference and show where the spans went",
        description=(
            "Builds a small transformer (embedding, 4 encoder layers, linear head; fixed seed), instruments it with "
            "torchtrace.instrument() using the default options, runs inference under a 'demo.inference' span per "
            "batch (exported with the model's spans, their parent), then prints the per-layer summary and where "
            "the traces went. Without an OTLP endpoint (--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT) spans are "
            "appended as OTLP JSON lines to a file."
        ),
    )
    demo.add_argument("--batches", type=_positive_int, default=50, help="inference batches to run (default: 50)")
    demo.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send spans over OTLP to URL (sets OTEL_EXPORTER_OTLP_ENDPOINT; e.g. http://localhost:4318)",
    )
    demo.add_argument(
        "--protocol", choices=PROTOCOLS, help="OTLP protocol (sets OTEL_EXPORTER_OTLP_PROTOCOL; default: http/protobuf)"
    )
    demo.add_argument("--trace-file", metavar="PATH", help="OTLP JSON lines file used when no endpoint is set")
    demo.add_argument("--no-stats", action="store_true", help="spans only: no tensor statistics")
    demo.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from torchtrace._demo import run_demo

    return run_demo(
        batches=args.batches,
        otlp_endpoint=args.otlp_endpoint,
        protocol=args.protocol,
        trace_file=args.trace_file,
        stats=not args.no_stats,
    )


def _ratio(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    """instrument() options as flags: a flag is a keyword argument (it beats TORCHTRACE_* variables)."""
    group = parser.add_argument_group("torchtrace options (override TORCHTRACE_* variables)")
    group.add_argument("--exporter", choices=("auto", "otlp", "sdk", "file", "none"), help="where spans go")
    group.add_argument("--trace-file", metavar="PATH", help="OTLP JSON lines file of the file exporter")
    group.add_argument("--include", action="append", metavar="GLOB", help="module paths to trace (repeatable)")
    group.add_argument("--exclude", action="append", metavar="GLOB", help="module paths not to trace (repeatable)")
    group.add_argument("--max-depth", type=_non_negative_int, metavar="N", help="0: the model only, 1: children...")
    group.add_argument("--stats", metavar="NAMES", help="comma-separated statistics, 'all' or 'none'")
    group.add_argument("--stats-sample", type=_positive_int, metavar="N", help="larger tensors: N sampled elements")
    group.add_argument("--sample-every", type=_positive_int, metavar="N", help="trace every Nth outermost forward")
    group.add_argument("--sample-ratio", type=_ratio, metavar="R", help="trace this fraction of outermost forwards")


def _option_keywords(args: argparse.Namespace) -> dict:
    return {
        "exporter": args.exporter,
        "trace_file": args.trace_file,
        "include": tuple(args.include) if args.include else None,
        "exclude": tuple(args.exclude) if args.exclude else None,
        "max_depth": args.max_depth,
        "stats": Stats(names=args.stats, sample=args.stats_sample) if args.stats_sample else args.stats,
        "sample_every": args.sample_every,
        "sample_ratio": args.sample_ratio,
    }


def _add_run(subcommands: argparse._SubParsersAction) -> None:
    run = subcommands.add_parser(
        "run",
        help="run a Python script with every model it calls traced",
        description=(
            "Runs SCRIPT as __main__ with torchtrace's OpenTelemetry instrumentor active: every top-level model the "
            "script calls is instrumented on its first call (that call included). The script's own OTel spans "
            "(e.g. HTTP request spans) are exported too and parent the model spans. With OTEL_EXPORTER_OTLP_ENDPOINT "
            "set, spans go there over OTLP; else to the OTLP JSON trace file. At exit the per-layer summary of each "
            "model is printed to stderr. Options not given here come from TORCHTRACE_* variables."
        ),
    )
    _add_option_flags(run)
    run.add_argument("--no-summary", action="store_true", help="do not print the per-layer summary at exit")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=_run_script)


def _run_script(args: argparse.Namespace) -> int:
    from torchtrace._run import run_script

    return run_script(args.script, args.args, _option_keywords(args), summary=not args.no_summary)


def _add_config(subcommands: argparse._SubParsersAction) -> None:
    config = subcommands.add_parser(
        "config",
        help="print the effective configuration and where each value comes from",
        description=(
            "Prints every instrument() option with its effective value and its source (keyword: a flag given here; "
            "env: a TORCHTRACE_* variable; default), then the OTEL_* settings torchtrace honours. Exits 2 if an "
            "option or variable is invalid, with the error instrument() would raise."
        ),
    )
    _add_option_flags(config)
    config.add_argument("--json", action="store_true", help="one JSON list of {name, value, source}")
    config.set_defaults(handler=_print_config)


def _print_config(args: argparse.Namespace) -> int:
    from torchtrace._run import print_config

    print_config(_option_keywords(args), as_json=args.json)
    return 0


_TRACES_HELP = "trace files of the file exporter: files (rotated parts included), directories or globs"


def _add_trace_file_commands(subcommands: argparse._SubParsersAction) -> None:
    summary = subcommands.add_parser(
        "summary",
        help="print the per-layer table of trace files",
        description=(
            "Reads OTLP JSON lines trace files (as the file exporter writes them) and prints the per-layer table "
            "that handle.summary() prints: calls, total / mean / p95 time, share of the forward."
        ),
    )
    summary.add_argument("traces", nargs="+", metavar="TRACES", help=_TRACES_HELP)
    summary.add_argument("--limit", type=_positive_int, metavar="N", help="the N slowest layers only")
    summary.set_defaults(handler=_print_file_summary)
    perfetto = _writer(
        subcommands, "perfetto", "trace.json",
        help="convert trace files to Chrome trace-event JSON for ui.perfetto.dev",
        description=(
            "Writes the spans of OTLP JSON lines trace files as Chrome trace-event JSON: nested complete slices, "
            "a process per service and rank, a thread per trace, statistics and ids as slice args. Open it in "
            "https://ui.perfetto.dev or chrome://tracing."
        ),
    )  # fmt: skip
    perfetto.set_defaults(handler=_write_perfetto)
    report = _writer(
        subcommands, "report", "report.html",
        help="write one self-contained HTML report of trace files",
        description=(
            "Writes one HTML file that opens offline (every script inline): an overview, the per-layer table, a "
            "timeline of the slowest, a typical and every error / NaN trace, a layers x forwards heatmap of "
            "activation statistics, per-module line charts and NaN/Inf provenance."
        ),
    )  # fmt: skip
    report.add_argument(
        "--baseline",
        metavar="PATH",
        help="a drift baseline (torchtrace baseline): mark the layers of its model that drifted from it",
    )
    report.set_defaults(handler=_write_report)
    baseline = _writer(
        subcommands, "baseline", "baseline.json",
        help="write a drift baseline of a model from trace files",
        description=(
            "Reads OTLP JSON lines trace files of a model known to be good and writes its baseline: per layer and "
            "statistic (mean, std, abs_max, zero_fraction of each output), the distribution of the values, and the "
            "model's class and layers. instrument(model, baseline=PATH) scores later calls against it."
        ),
    )  # fmt: skip
    baseline.add_argument("--model", metavar="CLASS", help="the model's class name, where the files hold several")
    baseline.set_defaults(handler=_write_baseline)


def _writer(subcommands: argparse._SubParsersAction, name: str, output: str, **texts: str) -> argparse.ArgumentParser:
    """A command that reads trace files and writes one file (``-o``, default ``output``)."""
    parser = subcommands.add_parser(name, **texts)
    parser.add_argument("traces", nargs="+", metavar="TRACES", help=_TRACES_HELP)
    parser.add_argument("-o", "--output", default=output, metavar="PATH", help=f"default: {output}")
    return parser


def _print_file_summary(args: argparse.Namespace) -> int:
    from torchtrace._offline.reader import summary_command

    return summary_command(args.traces, args.limit)


def _write_perfetto(args: argparse.Namespace) -> int:
    from torchtrace._offline.perfetto import perfetto_command

    return perfetto_command(args.traces, args.output)


def _write_report(args: argparse.Namespace) -> int:
    from torchtrace._offline.report import report_command

    return report_command(args.traces, args.output, args.baseline)


def _write_baseline(args: argparse.Namespace) -> int:
    from torchtrace._offline.baseline import baseline_command

    return baseline_command(args.traces, args.output, args.model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchtrace", description="OpenTelemetry spans and tensor statistics for every PyTorch module call."
    )
    parser.add_argument("--version", action="version", version=f"torchtrace {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subcommands)
    _add_run(subcommands)
    _add_config(subcommands)
    _add_trace_file_commands(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchtrace`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("torchtrace: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError) as error:  # invalid configuration (options, TORCHTRACE_* / OTEL_* variables)
        print(f"torchtrace {args.command}: error: {error}", file=sys.stderr)
        return 2
