"""The one compiled part: a single pass over a large CPU tensor for its statistics (torchtrace/_reduce.c).

Optional: where it cannot be built (no C compiler), statistics take numpy's and torch's passes instead, the same
values a few times slower. Everything else is configured in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("torchtrace._reduce", ["torchtrace/_reduce.c"], extra_compile_args=["-O3"], optional=True)]
)
