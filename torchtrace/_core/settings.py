"""Process-wide settings: SIGTERM handling, the summary printed at exit, how CUDA calls are timed and summarised.

``torchtrace.configure(...)``, else the ``TORCHTRACE_*`` variable, else the default; read when used (a handle made
after a change sees it), so a process decides these once, not per model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchtrace._core.options import boolean, option, parse_bool, resolve_fields


@dataclass(frozen=True)
class Settings:
    """What ``torchtrace.configure()`` sets; each field ``None`` until set there or by its variable."""

    handle_sigterm: bool | None = option(
        True, "on SIGTERM, deliver what was recorded, then end as the signal would have",
        env="TORCHTRACE_HANDLE_SIGTERM", parse=parse_bool, check=boolean,
    )  # fmt: skip
    print_summary: bool | None = option(
        None, "print the per-layer table at `remove()` / exit (`None`: with the embedded file default)",
        env="TORCHTRACE_PRINT_SUMMARY", parse=parse_bool, check=boolean,
    )  # fmt: skip
    cuda_events: bool | None = option(
        True, "CUDA module durations from events (device time); false: host clock (launch)",
        env="TORCHTRACE_CUDA_EVENTS", parse=parse_bool, check=boolean,
    )  # fmt: skip
    triton: bool | None = option(
        True, "false: CUDA statistics with torch ops, never the Triton kernel (read at the first CUDA statistics)",
        env="TORCHTRACE_TRITON", parse=parse_bool, check=boolean,
    )  # fmt: skip


_configured = Settings()


def configure(
    *,
    handle_sigterm: bool | None = None,
    print_summary: bool | None = None,
    cuda_events: bool | None = None,
    triton: bool | None = None,
) -> Settings:
    """Sets process-wide settings; an argument left ``None`` keeps its current source. Returns the settings now in
    effect. Invalid values raise here.

    Args:
        handle_sigterm: on SIGTERM, deliver what was recorded, then end as the signal would have (default True).
        print_summary: print the per-layer table at ``remove()`` / exit (default: only when traces go to the
            embedded default file).
        cuda_events: time CUDA module calls with events, i.e. device time (default True); False: the host clock.
        triton: summarise CUDA tensors with torchtrace's Triton kernel where it can (default True); False: torch
            ops. Read once, at the first CUDA statistics.
    """
    global _configured
    given = {"handle_sigterm": handle_sigterm, "print_summary": print_summary, "cuda_events": cuda_events,
             "triton": triton}  # fmt: skip
    candidate = replace(_configured, **{name: value for name, value in given.items() if value is not None})
    resolve_fields(candidate)  # raises before anything changes
    _configured = candidate
    return current()


def configured() -> Settings:
    """What ``configure()`` set (None where it set nothing)."""
    return _configured


def current() -> Settings:
    """The settings in effect: ``configure()``, else the variables, else the defaults."""
    return replace(_configured, **resolve_fields(_configured))
