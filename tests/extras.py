"""Test-extra packages some tests need (mkdocs, fastapi...), checked the way the Prometheus tests check theirs; and
whether this machine can build the compiled module."""

from __future__ import annotations

import importlib.util
import os
import shutil

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
