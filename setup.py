"""Builds the optional C extension `pagedkv.core._native`; all package metadata lives in pyproject.toml.

`optional=True`: without a working C compiler the install still succeeds, and `pagedkv.core.hotpath` falls
back to its Python reference.
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pagedkv.core._native",
            ["src/pagedkv/core/_native.c"],
            optional=True,
            extra_compile_args=[] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall", "-Wextra"],
        )
    ]
)
