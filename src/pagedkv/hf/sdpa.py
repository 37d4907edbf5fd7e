"""Paged attention by block gather + torch SDPA: the CPU fast path of the hf integration.

Same semantics as `pagedkv.ops.paged_attention` (causal; a query at position p sees keys at positions
`<= p` and, with a window w, `> p - w`; GQA; `seq_lens` counts the new tokens, whose KV is already written),
for the two shapes a CPU step is made of (see `pagedkv.hf.metadata`, attention groups):

- a decode group: B sequences with one query each. Their blocks are gathered into `[B, Hkv, L, D]`
  (L = the longest context, rounded up to whole blocks), a boolean mask hides each row's positions past its
  own length (and outside its window), and one SDPA call does the rest;
- one prefill chunk: a single sequence's n queries against its L keys, gathered from its blocks; with no
  cached context and no window it is plain causal SDPA, otherwise a bottom-right causal mask.

Why not the reference op: it pads queries and keys to the batch maxima and folds tiles through a float32
online softmax in Python, which is the right oracle but costs 3-5x more than SDPA on these shapes on a CPU.
Soft-capped models (Gemma 2) and any other group shape go to `pagedkv.ops.paged_attention`. Padding
entries of block tables point at the null block; what the gather reads there is masked out. The pages are
zero-initialised and only ever hold finite values, so masked rows contribute exactly nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_supports(max_seqlen_q: int, num_seqs: int, soft_cap: float | None) -> bool:
    """Whether `paged_sdpa` handles a group of this shape."""
    return soft_cap is None and (max_seqlen_q == 1 or num_seqs == 1)


def _gather(cache: torch.Tensor, table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Blocks `table[:, :num_blocks]` of `cache` as `[B, Hkv, num_blocks * block_size, D]`."""
    batch = table.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache[table[:, :num_blocks].long()]  # [B, nb, bs, Hkv, D]
    return rows.view(batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def paged_sdpa(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """`[num_q_tokens, H, D]` attention for a decode group or a single prefill chunk (see module docs)."""
    num_q, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-max_seqlen_k // block_size)
    k = _gather(key_cache, block_table, num_blocks)
    v = _gather(value_cache, block_table, num_blocks)
    gqa = num_heads != num_kv_heads
    key_pos = torch.arange(num_blocks * block_size, device=query.device)
    if max_seqlen_q == 1:  # decode group: one query per sequence, at position seq_len - 1
        lens = seq_lens.long()[:, None]
        visible = key_pos[None, :] < lens
        if sliding_window is not None:
            visible &= key_pos[None, :] > lens - 1 - sliding_window
        q = query.view(num_q, num_heads, 1, head_dim)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=gqa
        )
        return out.view(num_q, num_heads, head_dim)
    # one sequence, n queries at positions [L - n, L)
    length = int(seq_lens[0])
    k, v = k[:, :, :length], v[:, :, :length]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if length == num_q and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(length - num_q, length, device=query.device)[:, None]
        visible = key_pos[None, :length] <= q_pos
        if sliding_window is not None:
            visible &= key_pos[None, :length] > q_pos - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
