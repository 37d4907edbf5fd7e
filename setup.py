"""Builds the optional C extensions `pagedkv.core._native`, `pagedkv.ops._cpu_decode` and
`pagedkv.hf._cpu_layer`; all package metadata lives in pyproject.toml.

`optional=True`: without a working C compiler the install still succeeds, `pagedkv.core.hotpath` falls back
to its Python reference and `pagedkv.hf.sdpa` to torch SDPA.
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall", "-Wextra"]
# The decode kernel splits a batch over OpenMP threads on Linux, linking libgomp.so.1 by name: torch's own
# copy once torch is imported (pagedkv.ops.cpu_decode imports it first), so one team serves both.
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension("pagedkv.core._native", ["src/pagedkv/core/_native.c"], optional=True, extra_compile_args=FLAGS),
        # paged float32 decode attention on a CPU (pagedkv.ops.cpu_decode); the hf integration falls back to
        # its SDPA path without it
        Extension(
            "pagedkv.ops._cpu_decode",
            ["src/pagedkv/ops/_cpu_decode.c"],
            optional=True,
            extra_compile_args=FLAGS + OPENMP,
            extra_link_args=OPENMP,
        ),
        # the element-wise parts of a Llama layer (pagedkv.hf.layer_ops); the fused forward runs torch's
        # operations without it
        Extension(
            "pagedkv.hf._cpu_layer",
            ["src/pagedkv/hf/_cpu_layer.c"],
            optional=True,
            extra_compile_args=FLAGS + OPENMP,
            extra_link_args=OPENMP,
        ),
    ]
)
