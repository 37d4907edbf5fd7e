"""The one place that picks an attention/write backend: "reference" (torch, any device) or "triton".

Order of precedence: the call's `backend=` argument, then the innermost `use_backend(...)` context, then
the environment variable `PAGEDKV_ATTENTION_BACKEND`, then the device: CUDA tensors go to Triton when it
imports, everything else to the reference path. Triton on CPU tensors works only under
`TRITON_INTERPRET=1` (tests do this); asking for it otherwise is an error, not a silent fallback.
fp8 (e4m3, e5m2) caches: the Triton attention kernel reads them (dequantizing with `k_scale`/`v_scale` or
the per-token-head `kv_scales`) on GPUs of compute capability 8.9 and up (Triton has no e4m3 type below), so
the default sends fp8 attention to Triton only there; int8 caches go to Triton on any CUDA device. Writes
into int8 caches with a per-token scale sidecar (`scaled=True`) go to the Triton kernel that quantizes; fp8
writes take the reference path (`op="write"`: Triton's interpreter rounds float32 to fp8 wrongly at binade
edges, so an fp8 write kernel could not be tested here), and so do writes into per-block scales
(`block_scales=True`: the Triton kernel keeps per-token scales only).
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


def choose_backend(
    device: torch.device,
    backend: str | None = None,
    *,
    cache_dtype: torch.dtype | None = None,
    op: str = "attention",
    scaled: bool = False,
    block_scales: bool = False,
) -> str:
    """The backend a call (`op` "attention" or "write") on `device` runs with; raises if it cannot run there.
    `scaled`: a write into a quantized cache with its scale sidecar (`kv_scales`); `block_scales`: one scale
    per block and KV head in that sidecar."""
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    triton_quantizes = scaled and cache_dtype == torch.int8 and not block_scales
    fp8_write = op == "write" and (fp8 or cache_dtype == torch.int8) and not triton_quantizes
    chosen = backend or _override.get() or os.environ.get(ENV_VAR) or None
    if chosen is None:
        if device.type == "cuda" and triton_available() and not fp8_write and (not fp8 or _has_fp8(device)):
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
        if fp8_write:
            if backend == "triton":
                raise InvalidArgumentError(
                    "the Triton write kernel quantizes only to int8 with per-token kv_scales; use backend='reference'"
                )
            return "reference"
    return chosen


def _has_fp8(device: torch.device) -> bool:
    return torch.cuda.is_available() and _capability(device.index or 0) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown attention backend {name!r}; choose one of {BACKENDS} or None")
    return name
