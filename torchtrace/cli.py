"""``torchtrace`` command line: ``torchtrace demo`` (also ``python -m torchtrace demo``).

Argument parsing only; each subcommand's work lives in its own module, imported when the subcommand runs (so
``torchtrace --help`` does not import torch). Subcommands are registered in ``build_parser``: add ``run`` and
``config`` there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchtrace.version import __version__

PROTOCOLS = ("grpc", "http/protobuf")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_demo(subcommands: argparse._SubParsersAction) -> None:
    demo = subcommands.add_parser(
        "demo",
        help="trace a small transformer's inference and show where the spans went",
        description=(
            "Builds a small transformer (embedding, 4 encoder layers, linear head; fixed seed), instruments it with "
            "torchtrace.instrument() using the default options, runs inference under a 'demo.inference' span per "
            "batch, then prints the per-layer summary and where the traces went. Without an OTLP endpoint "
            "(--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT) spans are appended as OTLP JSON lines to a file."
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchtrace", description="OpenTelemetry spans and tensor statistics for every PyTorch module call."
    )
    parser.add_argument("--version", action="version", version=f"torchtrace {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subcommands)
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
    except ValueError as error:  # invalid configuration (options, TORCHTRACE_* / OTEL_* variables)
        print(f"torchtrace {args.command}: error: {error}", file=sys.stderr)
        return 2
