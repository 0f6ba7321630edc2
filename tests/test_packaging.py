"""What `pip install torchtrace` gets: the wheel built from this checkout holds the package, its data files and the
compiled modules (the hot path's helpers, the trace file's text writer) where a C compiler is; the build keeps going
without one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from extras import has_c_compiler

ROOT = Path(__file__).resolve().parent.parent


def wheel_files(work: Path, **environment: str) -> list[str]:
    """The files of the wheel that pip builds from the checkout's tracked files, copied to ``work`` (as a clone or
    an sdist has them: no build directory, no module built in place); no build isolation (the test extra's
    setuptools)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    source = work / "source"
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(work), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **environment},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = work.glob("torchtrace-*.whl")
    return zipfile.ZipFile(wheel).namelist()


COMPILED = ("torchtrace/_native.", "torchtrace/_otlp/_json_text.")


def compiled_modules(names: list[str]) -> set[str]:
    built = [name for name in names if name.endswith((".so", ".pyd"))]
    return {prefix for prefix in COMPILED for name in built if name.startswith(prefix)}


def test_the_wheel_holds_the_package_its_data_and_the_compiled_pass(tmp_path):
    if not has_c_compiler():
        pytest.skip("no C compiler: the wheel is pure Python, statistics take numpy's passes")
    names = wheel_files(tmp_path)
    assert compiled_modules(names) == set(COMPILED), names
    for expected in ("torchtrace/__init__.py", "torchtrace/_capture/stats.py", "torchtrace/_offline/report_page.html"):
        assert expected in names
    assert not any(name.startswith("tests/") for name in names)


def test_without_a_c_compiler_the_wheel_still_builds_without_the_compiled_modules(tmp_path):
    """The compiled modules are optional: a machine that cannot build them installs torchtrace all the same (its
    statistics then take numpy's passes, its trace file Python's ``%``: tested with the modules switched off in
    test_statistics.py and test_otlp_json.py)."""
    names = wheel_files(tmp_path, CC="false", LDSHARED="false")
    assert "torchtrace/_capture/stats.py" in names
    assert not compiled_modules(names), names
