"""Triton kernels for `write_kv` and `paged_attention`, with the reference's signatures and semantics.

Imported only when the Triton backend runs (see `pagedkv.ops.dispatch`). Under `TRITON_INTERPRET=1` the
kernels run on CPU tensors through Triton's interpreter; CI tests them that way at tiny shapes.

Write: one program per token copies its `num_kv_heads * head_dim` row of K and of V to its slot.

Attention: one program per (query token, KV head). It holds the `group = num_heads / num_kv_heads` query
heads that share the KV head (so each K/V row is loaded once for the whole group), walks the keys its query
may see in tiles of `BLOCK_N` token positions, resolves each position to its slot through the block table
(`table[pos // block_size] * block_size + pos % block_size`, any block size), and keeps a float32 online
softmax. Only positions in `[max(0, p - window + 1), p]` are loaded: the table past `seq_lens` is never
read. Decode, prefill and chunked prefill are the same kernel (a decode step has one query per sequence).
The dot products are broadcast-multiply-and-sum rather than `tl.dot`, which keeps any group size and head
dim legal (`tl.dot` wants dims >= 16) and is adequate for memory-bound decode; prefill re-reads the keys
once per query token and is the part to tile with `tl.dot` when it matters.

Split-K (flash-decoding): when (query tokens x KV heads) programs are too few to fill the GPU (small
decode batches, long contexts), a third grid axis splits each query's keys into `num_splits` slices; each
program writes a partial (max, sum, accumulator) and a second kernel merges them.

Numerics: float32 scores and accumulation (half inputs upcast on load); the sum order differs from the
reference's, so the two agree to rounding (tolerances in docs/attention.md), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASKED = -1e30


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    src = token.to(tl.int64) * ROW + offs
    dst = slot * ROW + offs
    k = tl.load(key_ptr + src, mask=mask)
    v = tl.load(value_ptr + src, mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `write_kv` (arguments already checked by `pagedkv.ops.write_kv`)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = key_cache.shape[2] * key_cache.shape[3]
    _write_kv_kernel[(num_tokens,)](
        key.contiguous(),
        value.contiguous(),
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    block_table_ptr,
    token_seq_ptr,
    token_pos_ptr,
    scale,
    soft_cap,
    window,
    block_size,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_table,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    num_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    pos = tl.load(token_pos_ptr + token)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_offs = token.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale

    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    hi = pos + 1
    if NUM_SPLITS > 1:
        # Split-K (flash-decoding): this program takes one of NUM_SPLITS BLOCK_N-aligned slices of [lo, hi).
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(block_table_ptr + seq * stride_table + n // block_size, mask=n_mask, other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        row = (slot * num_kv_heads + kv_head) * HEAD_DIM
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_N]
        if HAS_SOFT_CAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly at +-1, and the interpreter has it.
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        s = tl.where(n_mask[None, :], s, _MASKED)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    if NUM_SPLITS > 1:
        # Partial results [num_q_tokens, num_heads, NUM_SPLITS(, DIM_PAD)]; an empty slice leaves m = -inf,
        # l = 0, acc = 0, which the reduction weighs by exp(-inf) = 0.
        part = (token.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=g_mask[:, None])
    else:
        out = acc / l_i[:, None]
        o_offs = token.to(tl.int64) * stride_o_token + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _reduce_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    num_heads,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, DIM_PAD)
    part = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + sp
    m = tl.load(part_m_ptr + part)
    denom = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :])
    m_max = tl.max(m, axis=0)  # split 0 is never empty, so this is finite
    w = tl.exp(m - m_max)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(denom * w, axis=0)
    o_offs = token.to(tl.int64) * stride_o_token + head * stride_o_head + d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def query_positions(
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_q_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed query token: its sequence index and absolute position (int32), without host syncs.

    Token n of sequence b (cu[b] <= n < cu[b+1]) sits at position seq_lens[b] - (cu[b+1] - n).
    """
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    seq_ids = torch.arange(q_lens.numel(), device=cu.device)
    token_seq = torch.repeat_interleave(seq_ids, q_lens, output_size=num_q_tokens)
    token_pos = seq_lens.long()[token_seq] - (cu[1:][token_seq] - torch.arange(num_q_tokens, device=cu.device))
    return token_seq.to(torch.int32), token_pos.to(torch.int32)


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_n: int = 32,
    num_warps: int = 4,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton `paged_attention` (shapes already checked by `pagedkv.ops.paged_attention`).

    `num_splits` (a power of two) splits each query's keys across programs (flash-decoding) when the
    (token, KV head) grid alone is too small to fill the GPU; None chooses from the grid and the table
    width (no host sync).
    """
    num_q_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_q_tokens == 0:
        return out
    token_seq, token_pos = query_positions(seq_lens, cu_seqlens_q, num_q_tokens)
    table = block_table.to(torch.int32).contiguous()
    dim_pad = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(num_q_tokens * num_kv_heads, table.shape[1] * key_cache.shape[1], block_n, query.device)
    if num_splits & (num_splits - 1) or num_splits < 1:
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_splits > 1:
        part_m = torch.empty((num_q_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_q_tokens, num_heads, num_splits, dim_pad), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _paged_attention_kernel[(num_q_tokens, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        table,
        token_seq,
        token_pos,
        float(scale),
        float(soft_cap or 1.0),
        int(sliding_window or 0),
        key_cache.shape[1],
        num_kv_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        table.stride(0),
        part_m,
        part_l,
        part_acc,
        num_heads,
        GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 1),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_N=block_n,
        HAS_SOFT_CAP=soft_cap is not None,
        HAS_WINDOW=sliding_window is not None,
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_q_tokens, num_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
        )
    return out


def choose_num_splits(num_programs: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Enough splits to give the GPU ~4 programs per SM, each split keeping >= 4 tiles of keys; 1 on CPU."""
    if device.type != "cuda":
        return 1
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while splits < 64 and num_programs * splits < target and max_context >= 8 * block_n * splits:
        splits *= 2
    return splits
