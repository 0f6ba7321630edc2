"""The one compiled part: the hot path's helpers (torchtrace/_native.c: a traced call recorded without a Python
frame, one pass over a large CPU tensor, a copy without ctypes). Optional: where it cannot be built (no C compiler),
calls take the Python body and statistics numpy's and torch's passes and ctypes.memmove instead, the same records
and values, slower. Everything else is configured in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("torchtrace._native", ["torchtrace/_native.c"], extra_compile_args=["-O3"], optional=True)]
)
