"""Process-wide settings: SIGTERM handling, the summary printed at exit, how CUDA calls are timed and summarised.

``torchtrace.configure(...)``, else the ``TORCHTRACE_*`` variable, else the default; read when used (a handle made
after a change sees it), so a process decides these once, not per model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchtrace._core.options import resolve_fields, switch


@dataclass(frozen=True)
class Settings:
    """What ``torchtrace.configure()`` sets; each field ``None`` until set there or by its variable."""

    handle_sigterm: bool | None = switch(
        True, "on SIGTERM, deliver what was recorded, then end as the signal would have", "TORCHTRACE_HANDLE_SIGTERM"
    )
    print_summary: bool | None = switch(
        None,
        "print the per-layer table at `remove()` / exit (`None`: with the embedded file default)",
        "TORCHTRACE_PRINT_SUMMARY",
    )
    cuda_events: bool | None = switch(
        True, "CUDA module durations from events (device time); false: host clock (launch)", "TORCHTRACE_CUDA_EVENTS"
    )
    triton: bool | None = switch(
        True,
        "false: CUDA statistics with torch ops, never the Triton kernel (read at the first CUDA statistics)",
        "TORCHTRACE_TRITON",
    )


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
