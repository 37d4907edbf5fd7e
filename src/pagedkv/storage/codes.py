"""Quantization codes: the one-byte code dtypes, their largest codes, their rounding, and a byte view.

A quantized value is `code * scale`; `encode_codes` turns values already divided by their scale into codes.
The scale layouts that use them: per token (`pagedkv.storage.slots`) and per block
(`pagedkv.storage.block_scales`).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The largest code of each quantized dtype: a row's (or a block's) absmax maps to it.
QUANT_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A view that moves bytes exactly and that every indexing op supports (fp8 lacks some CPU kernels)."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def encode_codes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale, as codes of `dtype`: int8 rounds to nearest (halves to
    even) and clamps to +-127; fp8 clamps to +-QMAX and rounds to nearest. `y` may be overwritten."""
    if dtype == torch.int8:
        return y.round_().clamp_(-127.0, 127.0).to(torch.int8)
    return y.clamp_(-QUANT_MAX[dtype], QUANT_MAX[dtype]).to(dtype)
