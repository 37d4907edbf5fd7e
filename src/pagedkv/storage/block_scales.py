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
    cache: torch.Tensor,
    scales: torch.Tensor,
    new: torch.Tensor,
    slot_mapping: torch.Tensor,
    writes: BlockWrites,
) -> None:
    """Write `new` `[T, Hkv, D]` at `slot_mapping` into the codes `cache` `[num_blocks, block_size, Hkv, D]`
    with its block scales `scales` `[num_blocks, 1, Hkv]` (one of K or V), by the module's rule."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    qmax = QUANT_MAX[cache.dtype]
    flat_scales = scales.view(num_blocks, num_kv_heads)
    x = new.float()
    wanted = torch.zeros((writes.blocks.numel(), num_kv_heads), device=x.device)
    token_block = writes.token_block[:, None].expand(-1, num_kv_heads)
    wanted.scatter_reduce_(0, token_block, x.abs().amax(dim=-1), "amax").div_(qmax)
    old = flat_scales.index_select(0, writes.blocks)
    kept = (writes.first > 0)[:, None]
    prev = torch.where(kept, old, 0.0)
    # The blocks whose old codes matter: kept ones whose scale grows, or whose scale 1 may mean "all zero".
    looked = (kept & ((wanted > old) | (old == 1.0))).any(dim=1).nonzero().squeeze(1)
    raw = raw_bytes(cache)
    if looked.numel():
        ids = writes.blocks.index_select(0, looked)
        old_raw = raw.index_select(0, ids)
        old_codes = old_raw.view(cache.dtype).float()
        below = torch.arange(block_size, device=x.device)[None, :] < writes.first.index_select(0, looked)[:, None]
        below = below[:, :, None, None]
        nonzero = ((old_codes != 0) & below).any(dim=3).any(dim=1)
        looked_prev = prev.index_select(0, looked)
        looked_prev = torch.where((looked_prev == 1.0) & ~nonzero, 0.0, looked_prev)
        prev.index_copy_(0, looked, looked_prev)
    scale = torch.maximum(prev, wanted)
    scale = torch.where(scale > 0, scale, 1.0)
    if looked.numel():
        p, s = looked_prev[:, None, :, None], scale.index_select(0, looked)[:, None, :, None]
        grown = (s > p) & (p > 0) & below
        if bool(grown.any()):
            rescaled = raw_bytes(encode_codes(old_codes * p / s, cache.dtype))
            raw.index_copy_(0, ids, torch.where(grown, rescaled, old_raw))
    flat_scales.index_copy_(0, writes.blocks, scale)
    codes = encode_codes(x / scale.index_select(0, writes.token_block)[:, :, None], cache.dtype)
    raw.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw_bytes(codes))


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
