"""The one place that picks an attention/write backend: "reference" (torch, any device) or "triton".

Order of precedence: the call's `backend=` argument, then the innermost `use_backend(...)` context, then
the environment variable `PAGEDKV_ATTENTION_BACKEND`, then the device: CUDA tensors go to Triton when it
imports (and the cache dtype is not fp8), everything else to the reference path. Triton on CPU tensors
works only under `TRITON_INTERPRET=1` (tests do this); asking for it otherwise is an error, not a silent
fallback.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from pagedkv.core.errors import InvalidArgumentError

BACKENDS = ("reference", "triton")
ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"

_override: ContextVar[str | None] = ContextVar("pagedkv_attention_backend", default=None)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """Within the block, calls without an explicit `backend=` use this one (None: choose by device)."""
    token = _override.set(_check_name(backend) if backend is not None else None)
    try:
        yield
    finally:
        _override.reset(token)


def choose_backend(device: torch.device, backend: str | None = None, *, cache_dtype: torch.dtype | None = None) -> str:
    """The backend a call on `device` runs with; raises if the requested one cannot run there."""
    chosen = backend or _override.get() or os.environ.get(ENV_VAR) or None
    if chosen is None:
        if device.type == "cuda" and triton_available() and cache_dtype != torch.float8_e4m3fn:
            return "triton"
        return "reference"
    chosen = _check_name(chosen)
    if chosen == "triton":
        if not triton_available():
            raise InvalidArgumentError("backend 'triton' requested but triton does not import; use 'reference'")
        if device.type != "cuda" and not triton_interpreting():
            raise InvalidArgumentError(
                f"backend 'triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before import"
            )
        if cache_dtype == torch.float8_e4m3fn:
            raise InvalidArgumentError("the Triton kernels do not read fp8 caches yet; use backend='reference'")
    return chosen


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown attention backend {name!r}; choose one of {BACKENDS} or None")
    return name
