"""Files torchtrace writes whole (reports, baselines): replaced only once complete."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_when_complete(output: str | os.PathLike[str]) -> Iterator[Path]:
    """A path beside ``output`` to write to; it replaces ``output`` only when the block completes, so a reader never
    sees a half-written file (and a failed write leaves the old one)."""
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    try:
        yield partial
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
