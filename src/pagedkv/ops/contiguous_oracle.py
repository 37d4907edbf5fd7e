"""The contiguous side of every equivalence: paged KV gathered into one run per sequence, and torch SDPA.

`gather_kv` copies each sequence's tokens out of the paged cache into `[B, max_len, Hkv, D]` (exact copies;
zeros past each sequence's end). `sdpa_attention` is the oracle the paged paths are compared with: torch's
`scaled_dot_product_attention` per sequence over its contiguous KV, with the same causal/window semantics
as `paged_attention`. Soft-capping and attention sinks have no SDPA form, so with `soft_cap` or `sinks` the
oracle computes the same math explicitly in float64. This module is for tests and benchmarks; it loops over
sequences on purpose (clarity over speed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedkv.ops.options import NO_OPTIONS, AttentionOptions


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's K and V as `[B, max_len, Hkv, D]`, zero past `seq_lens[b]` (no table entry past it is read)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    lens = seq_lens.long()
    max_len = int(lens.max()) if lens.numel() else 0
    pos = torch.arange(max_len, device=lens.device)
    live = pos[None, :] < lens[:, None]
    clamped = torch.minimum(pos[None, :], (lens[:, None] - 1).clamp(min=0))
    slots = block_table.long().gather(1, clamped // block_size) * block_size + clamped % block_size
    out = []
    for cache in (key_cache, value_cache):
        rows = cache.view(-1, num_kv_heads, head_dim)[slots.reshape(-1)]
        rows = rows.view(lens.numel(), max_len, num_kv_heads, head_dim)
        out.append(torch.where(live[:, :, None, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)))
    return out[0], out[1]


def visibility_mask(q_len: int, kv_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """`[q_len, kv_len]` bool, True where the query (the last q_len positions) may see the key."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def sdpa_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    options: AttentionOptions = NO_OPTIONS,
) -> torch.Tensor:
    """Contiguous oracle: per sequence, SDPA of its queries over `keys[b, :seq_lens[b]]` (`[B, L, Hkv, D]`)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = keys.shape[2]
    scale, sliding_window, soft_cap = options.scale_for(head_dim), options.sliding_window, options.soft_cap
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        q = query[q0:q1].transpose(0, 1)[None]  # [1, H, q_len, D]
        k = keys[b, :kv_len].transpose(0, 1)[None]  # [1, Hkv, kv_len, D]
        v = values[b, :kv_len].transpose(0, 1)[None]
        visible = visibility_mask(q1 - q0, kv_len, sliding_window, query.device)
        if soft_cap is None and options.sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        else:
            group = num_heads // num_kv_heads
            k64 = k.double().repeat_interleave(group, dim=1)
            s = torch.matmul(q.double(), k64.transpose(-1, -2)) * scale
            if soft_cap is not None:
                s = soft_cap * torch.tanh(s / soft_cap)
            s = s.masked_fill(~visible, -math.inf)
            if options.sinks is not None:  # one more logit per head in the softmax, dropped after it
                sink = options.sinks.double().view(1, num_heads, 1, 1).expand(1, num_heads, q1 - q0, 1)
                p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            o = torch.matmul(p, v.double().repeat_interleave(group, dim=1))
        out[q0:q1] = o[0].transpose(0, 1).to(query.dtype)
    return out
