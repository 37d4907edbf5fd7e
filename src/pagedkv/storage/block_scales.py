"""Block scales: one float32 scale per (block, KV head) of a quantized cache, and the write rule that keeps it.

The "block" scale scheme (`KVCacheSpec.kv_scale_scheme`, docs/quantized-kv.md) keeps a sidecar `[2,
num_blocks, 1, num_kv_heads]` (K then V) beside the codes; a reader computes `code * scale[block, head]`
where the token scheme's reader computes `code * scale[slot, head]`.

The write rule, per (block, K/V, KV head), for one call that writes a run of tokens into the block starting
at offset k (the lowest offset the call writes there):

    prev = 0        if k == 0: the block starts afresh (its old scale belonged to a previous owner: blocks
                    come back from the free pool without storage being told)
         = 0        if the scale is 1 and every code at offsets < k is 0 (1 is the all-zero block's scale)
         = scale    otherwise
    new  = max(prev, absmax of the call's rows in the block / QMAX), or 1 where that is 0
    codes at offsets < k, where new > prev > 0:   quantize(code * prev / new)   (rescaled in place)
    the call's rows:                              quantize(x / new)

So the scale is the largest absmax / QMAX of the tokens written since the block last started at offset 0
(QMAX 127 int8, 448 e4m3, 57344 e5m2), and every code the block holds is relative to it. Tokens of a block
are written in order; a rollback (speculative decoding) rewrites from some k > 0 and the scale stays as
large as the rolled-back tokens made it: a loss of precision, never of correctness. Offsets past the
call's run keep their bytes. One pass over the new rows; old codes are read only for blocks whose scale
grows (or is 1), and no full-precision copy is kept. `quantize` is `pagedkv.storage.codes.encode_codes`
(int8: to nearest even, clamped to +-127; fp8: to nearest, within +-QMAX).

    offsets   0 ........ k-1 | k ......... k+n-1 | k+n ...... bs-1
    codes     kept (rescaled | the call's rows   | untouched
              when new>prev) |  at scale new     |
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv.storage.codes import QUANT_MAX, encode_codes, raw_bytes


class BlockWrites(NamedTuple):
    """Where one write call's tokens land, by block: made once per slot mapping (`block_writes`) and shared by
    every layer that writes through it."""

    blocks: torch.Tensor  # [U] int64: the distinct blocks written, ascending
    token_block: torch.Tensor  # [T] int64: each token's block, as an index into `blocks`
    first: torch.Tensor  # [U] int64: the lowest offset the call writes in each block


def block_writes(slot_mapping: torch.Tensor, block_size: int) -> BlockWrites:
    """The blocks a slot mapping writes into, and the first offset of each."""
    blocks, token_block = torch.unique(slot_mapping // block_size, return_inverse=True)
    first = torch.full(blocks.shape, block_size, dtype=torch.int64, device=slot_mapping.device)
    first.scatter_reduce_(0, token_block, slot_mapping % block_size, reduce="amin")
    return BlockWrites(blocks, token_block, first)


def scatter_block_codes(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    writes: BlockWrites,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` at `slot_mapping` into the codes `key_cache`/`value_cache`
    `[num_blocks, block_size, Hkv, D]` and their block scales `kv_scales` `[2, num_blocks, 1, Hkv]` (K then V),
    by the module's rule; K and V go through every step together, as one `[2, ...]` tensor."""
    caches = (key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    dtype, blocks, first = key_cache.dtype, writes.blocks, writes.first
    flat_scales = kv_scales.view(2, num_blocks, num_kv_heads)
    x = torch.stack((key, value)).float()  # [2, T, Hkv, D]
    wanted = torch.zeros((2, blocks.numel(), num_kv_heads), device=x.device)
    index = writes.token_block[None, :, None].expand(2, -1, num_kv_heads)
    wanted.scatter_reduce_(1, index, x.abs().amax(dim=-1), "amax").div_(QUANT_MAX[dtype])
    old = flat_scales.index_select(1, blocks)
    kept = (first > 0)[None, :, None]
    prev = torch.where(kept, old, 0.0)
    # The blocks whose old codes matter: kept ones whose scale grows, or whose scale 1 may mean "all zero".
    looked = (kept & ((wanted > old) | (old == 1.0))).any(dim=2).any(dim=0).nonzero().squeeze(1)
    if looked.numel():
        ids = blocks.index_select(0, looked)
        old_raw = torch.stack([raw_bytes(cache).index_select(0, ids) for cache in caches])  # [2, R, bs, Hkv, D]
        old_codes = old_raw.view(dtype).float()
        below = torch.arange(block_size, device=x.device)[None, :] < first.index_select(0, looked)[:, None]
        below = below[None, :, :, None, None]
        nonzero = ((old_codes != 0) & below).any(dim=4).any(dim=2)
        looked_prev = prev.index_select(1, looked)
        looked_prev = torch.where((looked_prev == 1.0) & ~nonzero, 0.0, looked_prev)
        prev.index_copy_(1, looked, looked_prev)
    scale = torch.maximum(prev, wanted)
    scale = torch.where(scale > 0, scale, 1.0)
    if looked.numel():
        p, s = looked_prev[:, :, None, :, None], scale.index_select(1, looked)[:, :, None, :, None]
        grown = (s > p) & (p > 0) & below
        if bool(grown.any()):
            rescaled = torch.where(grown, raw_bytes(encode_codes(old_codes * p / s, dtype)), old_raw)
            for cache, rows in zip(caches, rescaled, strict=True):
                raw_bytes(cache).index_copy_(0, ids, rows)
    flat_scales.index_copy_(1, blocks, scale)
    codes = raw_bytes(encode_codes(x / scale.index_select(1, writes.token_block)[..., None], dtype))
    for cache, rows in zip(caches, codes, strict=True):
        raw_bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rows)


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks `x` `[..., block_size, Hkv, D]` as (codes of `dtype`, float32 scales `[..., 1, Hkv]`): what
    writing each block from offset 0 in one call stores."""
    absmax = x.float().abs().amax(dim=-1).amax(dim=-2, keepdim=True)
    scales = torch.where(absmax > 0, absmax / QUANT_MAX[dtype], torch.ones_like(absmax))
    return encode_codes(x.float() / scales.unsqueeze(-1), dtype), scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 `codes * scales` of pages `[..., block_size, Hkv, D]` and their block scales `[..., 1, Hkv]`
    (the oracle for tests)."""
    return codes.float() * scales.float().unsqueeze(-1)
