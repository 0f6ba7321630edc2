"""The compiled parts, both optional: where they cannot be built (no C compiler), torchtrace takes the Python bodies
instead, the same records, values and text, slower.

- torchtrace._native (torchtrace/_native.c): the hot path's helpers: a traced call recorded without a Python frame,
  one pass over a large CPU tensor, a copy without ctypes.
- torchtrace._otlp._json_text (torchtrace/_otlp/_json_text.c): the OTLP/JSON trace file's span text, its floats
  written with Ryu (third_party/ryu) rather than CPython's dtoa.

Everything else is configured in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("torchtrace._native", ["torchtrace/_native.c"], extra_compile_args=["-O3"], optional=True),
        Extension(
            "torchtrace._otlp._json_text",
            ["torchtrace/_otlp/_json_text.c"],
            include_dirs=["third_party"],
            depends=[
                f"third_party/ryu/{name}"
                for name in ("d2s.c", "ryu.h", "common.h", "digit_table.h", "d2s_intrinsics.h", "d2s_full_table.h")
            ],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
