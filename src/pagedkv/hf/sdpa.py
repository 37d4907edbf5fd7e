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


def _gather(kv: torch.Tensor, table: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `table[:, :num_blocks]` of one layer's `kv` (`[2, num_blocks, block_size, Hkv, D]`, K then V)
    as K and V `[B, Hkv, num_blocks * block_size, D]`, in one `index_select`."""
    batch = table.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv.shape
    ids = table[:, :num_blocks].reshape(-1).long()
    rows = kv.flatten(2).index_select(1, ids)  # [2, B * nb, bs * Hkv * D]
    rows = rows.view(2, batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(2, 3)
    return rows[0], rows[1]


def paged_sdpa(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None,
    sliding_window: int | None,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[num_q_tokens, H, D]` attention for a decode group or a single prefill chunk (see module docs).

    `kv` is one layer's pages, `[2, num_blocks, block_size, Hkv, D]` (K then V). A prefill chunk with no
    cached context (`max_seqlen_k == max_seqlen_q`) attends over `new_key`/`new_value` (`[n, Hkv, D]`, the
    chunk's own K/V, already written to the pages) when given, skipping the gather."""
    num_q, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    gqa = num_heads != num_kv_heads
    if max_seqlen_q > 1 and max_seqlen_k == max_seqlen_q and new_key is not None and new_value is not None:
        k, v = new_key.transpose(0, 1).unsqueeze(0), new_value.transpose(0, 1).unsqueeze(0)
        if sliding_window is None:
            q = query.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
    else:
        num_blocks = -(-max_seqlen_k // block_size)
        k, v = _gather(kv, block_table, num_blocks)
    key_pos = torch.arange(k.shape[2], device=query.device)
    if max_seqlen_q == 1:  # decode group: one query per sequence, at position seq_len - 1
        lens = seq_lens.long()[:, None]
        visible = key_pos[None, :] < lens
        if sliding_window is not None:
            visible &= key_pos[None, :] > lens - 1 - sliding_window
        # One query position per sequence: the query heads sharing a KV head become that head's query rows
        # (heads h*g .. h*g+g-1 read KV head h), so K/V are never repeated per query head.
        q = query.reshape(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=scale)
        return out.reshape(num_q, num_heads, head_dim)
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
