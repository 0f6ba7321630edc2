"""What `pip install torchtrace` gets: the wheel built from this checkout holds the package, its data files and the
compiled one-pass statistics module (where a C compiler is; the build keeps going without one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_the_package_its_data_and_the_compiled_pass(tmp_path):
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler: the wheel is pure Python, statistics take numpy's passes")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("torchtrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.startswith("torchtrace/_native.") and name.endswith((".so", ".pyd")) for name in names), names
    for expected in ("torchtrace/__init__.py", "torchtrace/_stats.py", "torchtrace/_report_page.html"):
        assert expected in names
    assert not any(name.startswith("tests/") for name in names)
