"""Writing K/V at slots: validation and the reference scatter (one `index_copy_` per cache).

A slot is `block_id * block_size + offset`; the cache `[num_blocks, block_size, num_kv_heads, head_dim]`
viewed as `[num_blocks * block_size, num_kv_heads, head_dim]` is indexed by slot directly. Prefill chunks
and decode tokens of many sequences go in one call: `key[i]` lands at `slot_mapping[i]`.

Contract:
- slots are in `[0, num_blocks * block_size)` and distinct within one call (with duplicates, which write
  wins is unspecified); every slot no write targets keeps its bytes.
- Quantized caches with a scale sidecar (`kv_scales` float32, K then V: int8, fp8 e4m3 and fp8 e5m2, the layout
  `KVStorage` keeps) come in two scale schemes, told apart by the sidecar's shape:
  - per token, `[2, num_blocks, block_size, num_kv_heads]`: each token's KV head stores the scale
    `s = absmax(row) / QMAX` (1.0 for an all-zero row) beside the codes `round(x / s)` (int8: to nearest,
    clamped to +-127; fp8: to nearest e4m3/e5m2, within +-QMAX by construction); a reader computes
    `code * s`. Codes and scales are computed from the new rows in one pass.
  - per block, `[2, num_blocks, 1, num_kv_heads]` (with block_size > 1): one scale per block and KV head,
    grown as tokens arrive and reset when a write covers offset 0 (`pagedkv.storage.block_scales` has the
    rule); a reader computes `code * s[block]`. With block_size 1 the two shapes and rules coincide.
  No full-precision copy is kept.
- fp8 (e4m3) caches without a sidecar (the ops-level API) store `round_to_e4m3(clamp(x / scale, -448, 448))`
  with one per-tensor `scale`; readers multiply by `scale`.
- Writes are exact for every other dtype (`key` is cast to the cache dtype; a same-dtype write is a copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage.codes import FP8_DTYPE, FP8_MAX, QUANT_MAX, encode_codes, raw_bytes

if TYPE_CHECKING:
    from pagedkv.storage.block_scales import BlockWrites

def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., D]` as (codes `[..., D]` of `dtype`, float32 scales `[...]`): one scale per row (a token's
    KV head), `absmax / QMAX`, 1.0 for an all-zero row; see the module docstring."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / QUANT_MAX[dtype], torch.ones_like(absmax))
    return encode_codes(xf / scales.unsqueeze(-1), dtype), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 `codes * scales[..., None]`: what every read path computes (the oracle for tests)."""
    return codes.float() * scales.float().unsqueeze(-1)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x / scale`, clamped to e4m3's finite range and rounded to nearest e4m3 (no NaN from overflow)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches are `[num_blocks, block_size, num_kv_heads, head_dim]`, same shape, dtype and device."""
    if key_cache.dim() != 4:
        raise InvalidArgumentError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise InvalidArgumentError(
            f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match key_cache "
            f"{tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if value_cache.device != key_cache.device:
        raise InvalidArgumentError(f"caches on different devices: {key_cache.device} vs {value_cache.device}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise InvalidArgumentError("key_cache and value_cache must be contiguous")


def check_scales(key_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """`kv_scales`, when given, is the float32 `[2, num_blocks, block_size or 1, num_kv_heads]` sidecar (per-token
    or per-block scales) of a quantized (int8 / fp8) cache on its device; an int8 cache must have one."""
    if kv_scales is None:
        if key_cache.dtype == torch.int8:
            raise InvalidArgumentError("an int8 cache needs its scales: pass kv_scales [2, num_blocks, block_size, Hkv]")
        return
    if key_cache.dtype not in QUANT_MAX:
        raise InvalidArgumentError(f"kv_scales are for int8/fp8 caches, not {key_cache.dtype}")
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    shapes = {(2, num_blocks, block_size, num_kv_heads), (2, num_blocks, 1, num_kv_heads)}
    if tuple(kv_scales.shape) not in shapes or kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous():
        raise InvalidArgumentError(
            f"kv_scales must be contiguous float32 [2, {num_blocks}, {block_size} (per token) or 1 (per block), "
            f"{num_kv_heads}] (K then V), got {kv_scales.dtype} {tuple(kv_scales.shape)}"
        )
    if kv_scales.device != key_cache.device:
        raise InvalidArgumentError(f"kv_scales are on {kv_scales.device} but the cache is on {key_cache.device}")


def check_write_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_range: bool = True,
) -> None:
    """Shapes, dtypes, devices, and (if `check_range`, which syncs on CUDA) that every slot is in range."""
    check_cache_pair(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise InvalidArgumentError(
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise InvalidArgumentError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise InvalidArgumentError(
            f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise InvalidArgumentError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens; give one slot per token"
        )
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != key_cache.device:
            raise InvalidArgumentError(f"{name} is on {t.device} but the cache is on {key_cache.device}")
    if check_range and slot_mapping.numel() > 0:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        num_slots = num_blocks * block_size
        if lo < 0 or hi >= num_slots:
            raise InvalidArgumentError(
                f"slot_mapping holds slots in [{lo}, {hi}] but the cache has {num_slots} slots "
                f"({num_blocks} blocks x {block_size}); a slot is block_id * block_size + offset"
            )


def block_scaled(key_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> bool:
    """Whether `kv_scales` holds one scale per block and KV head (`[2, num_blocks, 1, Hkv]`, block_size > 1)."""
    return kv_scales is not None and kv_scales.shape[2] == 1 < key_cache.shape[1]


def scatter_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,
    writes: BlockWrites | None = None,
) -> None:
    """Reference write: `cache.view(-1, H, D)[slot_mapping[i]] = key[i]`, in place; quantized into codes and
    `kv_scales` when that sidecar is given. Call `check_write_args` (and `check_scales`) first. Per-block
    scales take `writes`, the slot mapping's `block_writes`, when the caller made it once for many layers."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    if kv_scales is not None and block_scaled(key_cache, kv_scales):
        from pagedkv.storage.block_scales import block_writes, scatter_block_codes

        if writes is None:
            writes = block_writes(slot_mapping, key_cache.shape[1])
        scatter_block_codes(key_cache, value_cache, kv_scales, key, value, slot_mapping, writes)
        return
    if kv_scales is not None:
        flat_scales = kv_scales.view(2, -1, num_kv_heads)
        for i, (cache, new) in enumerate(((key_cache, key), (value_cache, value))):
            codes, scales = quantize_rows(new, cache.dtype)
            raw_bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw_bytes(codes))
            flat_scales[i].index_copy_(0, slot_mapping, scales)
        return
    if key_cache.dtype == torch.int8:
        raise InvalidArgumentError("an int8 cache needs its scales: pass kv_scales [2, num_blocks, block_size, Hkv]")
    for cache, new, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        src = quantize_fp8(new, scale) if cache.dtype == FP8_DTYPE else new.to(cache.dtype)
        flat = raw_bytes(cache).view(-1, num_kv_heads, head_dim)  # fp8 -> uint8 keeps the shape
        flat.index_copy_(0, slot_mapping, raw_bytes(src))
