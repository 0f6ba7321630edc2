"""The environment a subprocess gets to run this checkout's torchtrace as a user's process would."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout_env(**updates: str) -> dict[str, str]:
    """This process's environment without its ``OTEL_*`` and ``TORCHTRACE_*`` variables (each test sets the ones it
    means), the checkout first on ``PYTHONPATH``, then ``updates``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCHTRACE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(updates)
    return env
