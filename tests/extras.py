"""Test-extra packages some tests need (mkdocs, fastapi...), checked the way the Prometheus tests check theirs; and
whether this machine can build the compiled module."""

from __future__ import annotations

import importlib.util
import os
import shutil
import types
from pathlib import Path

import pytest


def require_modules(*names: str) -> None:
    """Missing, the test fails on CI (CI=true) and is skipped elsewhere, so an environment installed before these
    packages joined the test extra still runs the rest of the suite."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        message = f"needs {', '.join(missing)} (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


def has_c_compiler() -> bool:
    """Whether a C compiler is on PATH (then installing torchtrace builds ``torchtrace._native``)."""
    return any(shutil.which(name) for name in ("cc", "gcc", "clang"))


def load_simulated_cuda() -> types.ModuleType:
    """benchmarks/simulated_cuda.py, loaded from this checkout (benchmarks/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "simulated_cuda.py"
    spec = importlib.util.spec_from_file_location("simulated_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
