"""Triton kernels for `write_kv` and `paged_attention`, with the reference's signatures and semantics.

Imported only when the Triton backend runs (see `pagedkv.ops.dispatch`). Under `TRITON_INTERPRET=1` the
kernels run on CPU tensors through Triton's interpreter (tests do this at tiny shapes); every
specialization the launch heuristics can choose is also compiled to sm_80 and sm_90 cubins on the CPU by
`tests/ops/test_triton_compile.py`, because the interpreter accepts things the compiler refuses (a
non-constexpr global, for one). So: no module-level values inside kernels; constants are literals.

Write: one program per token copies its `num_kv_heads * head_dim` row of K and of V to its slot (reading
strided `[T, Hkv, D]` views in place). Into int8 caches with a scale sidecar (`write_kv_codes_triton`), the
program quantizes the rows in registers first: per KV head, scale = absmax / 127 and the codes, stored with
their scale in one pass (halves round away from zero where the reference rounds them to even: a code may
differ by one at an exact tie). It keeps per-token scales only: writes into per-block scales (which may
rescale a block's older codes, `pagedkv.storage.block_scales`) and fp8 writes stay on the reference (see
`pagedkv.ops.dispatch`).

Attention (one kernel for decode, prefill and chunked prefill), built like the fast paged decoders
(flash-decoding, vLLM's and SGLang's Triton decode kernels):

```
grid = (query tiles, KV heads, splits)
query tile  = up to BLOCK_Q consecutive query tokens of ONE sequence (decode: BLOCK_Q = 1)
program     = one tile x one KV head: its M = BLOCK_Q * GROUP_PAD rows are (query token, query head of
              the KV head's group), row r = token r // GROUP_PAD, head kv_head * group + r % GROUP_PAD
key loop    = tiles of TILE_N key positions; per tile ONE table load per KV block it covers
              (a scalar when BLOCK_SIZE >= TILE_N, a [TILE_N / BLOCK_SIZE] vector otherwise), then
              K^T [DIM_PAD, TILE_N] and V [TILE_N, DIM_PAD] loaded as whole rows of the block
              (contiguous head_dim runs), S = tl.dot(Q, K^T), O += tl.dot(P, V), float32 online softmax
              in base 2
split       = the tile's visible key range cut into `num_splits` runs of whole key tiles; each program
              writes a partial (max, sum, unnormalised acc) and `_merge_splits_kernel` combines them
```

The per-tile metadata (`tile_seq`, `tile_q_start`, `tile_q_len`, `tile_pos`: which sequence, first packed
query token, how many tokens, position of the first) is computed once per step on the device by
`pagedkv.ops.plan` and shared by every layer; tiles past the real ones have `tile_q_len = 0` and return at
once, so the grid size needs no host sync. Block sizes that are not a power of two take `BLOCK_SIZE = 0`:
the block size is then a runtime value and the table is read per key position (correct for any size, one
compile for all of them).

Attention sinks (`HAS_SINKS`, gpt-oss): each query head's sink logit joins the softmax's denominator at the
end, as 2^(sink * log2(e) - m) against the row's running max m, when the rows are stored (or, with
splits, once in `_merge_splits_kernel` against the max over the splits); it adds no value.

Numerics: float32 scores and accumulation; P is rounded to the value dtype before the P.V dot (as
FlashAttention does) for half caches (under the interpreter, whose bfloat16 dot is broken, bfloat16
operands are upcast to float32 after that rounding); float32 caches use IEEE float32 dots (no TF32). fp8 (e4m3) caches are
upcast to the query dtype on load and dequantized by `k_scale`/`v_scale`. Quantized caches with a scale
sidecar (`KV_SCALES`: int8, fp8 e4m3/e5m2 codes and `kv_scales [2, NB, BS, Hkv]`) load each key tile's and value
tile's scales beside its rows (scale index = row offset // HEAD_DIM, the caches being contiguous; with
`BLOCK_SCALES`, `kv_scales [2, NB, 1, Hkv]`, the key's block row offset // block stride, times Hkv, plus the
KV head: every key of a block loads the same scale): codes
convert exactly to the query dtype (int8, e4m3 and e5m2 values all fit fp16/bf16), a key's scale multiplies
its column of scores after the Q.K dot, and the value tile is dequantized in registers (code * scale in the
query dtype) before the P.V dot; no dequantized copy of any block is made. The sum order differs from the
reference's, so the two agree to rounding (tolerances in docs/attention.md), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.launch import LaunchConfig
from pagedkv.ops.options import AttentionOptions
from pagedkv.ops.plan import AttentionPlan


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    # key/value may be strided views (e.g. [T, Hkv, D] transposed from the model's [Hkv, T, D]): no copy.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    head = offs // HEAD_DIM
    d = offs % HEAD_DIM
    dst = slot * ROW + offs
    k = tl.load(key_ptr + token * stride_k_token + head * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_token + head * stride_v_head + d, mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `write_kv` (arguments already checked by `pagedkv.ops.write_kv`); one launch, no copies of
    `key`/`value` when only their token and head strides differ from contiguous."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        **write_constexprs(key_cache.shape[2], key_cache.shape[3]),
    )


@triton.jit
def _write_kv_codes_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    scales_ptr,
    slot_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    scales_half,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    # One token: its K and V rows of every KV head quantized in registers, codes and scales stored together.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    h_ok = h < NUM_HEADS
    mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    dst = slot * (NUM_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    s_dst = scales_ptr + slot * NUM_HEADS + h
    k_src = key_ptr + token * stride_k_token + h[:, None] * stride_k_head + d[None, :]
    _quantize_rows(k_src, mask, key_cache_ptr + dst, s_dst, h_ok, QMAX, IS_INT8)
    v_src = value_ptr + token * stride_v_token + h[:, None] * stride_v_head + d[None, :]
    _quantize_rows(v_src, mask, value_cache_ptr + dst, s_dst + scales_half, h_ok, QMAX, IS_INT8)


@triton.jit
def _quantize_rows(src, mask, dst, s_dst, h_ok, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """Rows [HEADS_PAD, DIM_PAD] at `src`: scale = absmax / QMAX per row (1 for a zero row), codes x / scale
    (int8: to nearest, halves away from zero; other code types: the conversion's rounding)."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(absmax > 0.0, absmax / QMAX, 1.0)
    y = tl.minimum(tl.maximum(x / scale[:, None], -QMAX), QMAX)
    if IS_INT8:
        y = tl.where(y >= 0.0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
    tl.store(s_dst, scale, mask=h_ok)


def write_kv_codes_triton(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor,
) -> None:
    """Triton quantizing `write_kv` into int8 codes and their `kv_scales` sidecar (arguments already checked by
    `pagedkv.ops.write_kv`); one launch, one program per token."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _write_kv_codes_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, kv_scales, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), kv_scales[0].numel(), **write_codes_constexprs(key_cache.shape[2], key_cache.shape[3],
                                                                       key_cache.dtype),
    )  # fmt: skip


def write_codes_constexprs(num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> dict[str, object]:
    """The compile-time arguments of `_write_kv_codes_kernel` (launch and compile test)."""
    from pagedkv.storage.codes import QUANT_MAX

    return {"HEAD_DIM": head_dim, "NUM_HEADS": num_kv_heads, "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
            "DIM_PAD": triton.next_power_of_2(head_dim), "QMAX": QUANT_MAX[cache_dtype],
            "IS_INT8": cache_dtype == torch.int8}  # fmt: skip


# Over the 60-line limit of tests/test_layers.py, and exempt there: a Triton kernel takes every pointer,
# stride and constexpr as its own parameter, so the signature alone is 56 lines; the body is split into the
# @triton.jit helpers below (inlined by the compiler, so the generated code is unchanged).
@triton.jit
def _paged_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    block_table_ptr,
    tile_seq_ptr,
    tile_q_start_ptr,
    tile_q_len_ptr,
    tile_pos_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sinks_ptr,
    kv_scales_ptr,
    scales_half,
    scale,
    k_scale,
    v_scale,
    soft_cap,
    window,
    group,
    num_heads,
    num_splits,
    block_size,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_token,
    stride_table,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IS_FP8: tl.constexpr,
    KV_SCALES: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_len = tl.load(tile_q_len_ptr + tile)
    if q_len == 0:
        return
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    q_start = tl.load(tile_q_start_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)

    r = tl.arange(0, BLOCK_M)
    q_idx = r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (q_idx < q_len) & (g < group)
    heads = kv_head * group + g
    tokens = (q_start + q_idx).to(tl.int64)
    row_pos = pos0 + q_idx
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    q_offs = tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not IS_FP8 and not KV_SCALES:
        q = q.to(key_cache_ptr.dtype.element_ty)  # one dot dtype (quantized K/V are upcast to the query's)
    # Scores in base 2: exp(x) = exp2(x * log2(e)); the scales fold into one multiplier.
    qk_scale = scale * k_scale
    if not HAS_SOFT_CAP:
        qk_scale = qk_scale * 1.4426950408889634

    lo, hi, t_begin, t_end = _key_tile_range(pos0, q_len, window, split, num_splits, TILE_N, HAS_WINDOW, SPLIT)
    table_row = block_table_ptr + seq * stride_table
    head_off = kv_head * HEAD_DIM
    n_arange = tl.arange(0, TILE_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for t in range(t_begin, t_end):
        start = lo + t * TILE_N
        n = start + n_arange
        n_ok = n < hi
        rows = _key_rows(
            table_row, start, n, n_ok, hi, block_size, stride_cache_block, stride_cache_token, TILE_N, BLOCK_SIZE
        )
        rows = rows + head_off
        kt = tl.load(
            key_cache_ptr + rows[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0
        )  # K^T [DIM_PAD, TILE_N]
        ks = n_ok.to(tl.float32)  # per-key score factor: each key's scale with KV_SCALES (unused otherwise)
        s_rows = rows // HEAD_DIM  # each key's scale: its slot's row (slot * Hkv + head), or its block's
        if BLOCK_SCALES:
            s_rows = (rows // stride_cache_block) * (stride_cache_token // HEAD_DIM) + kv_head
        if KV_SCALES:  # codes convert exactly to the query dtype; each key's scale multiplies its scores
            ks = tl.load(kv_scales_ptr + s_rows, mask=n_ok, other=1.0)
        s = _scores(
            q, kt, ks, qk_scale, soft_cap, n, row_pos, window,
            HAS_WINDOW, HAS_SOFT_CAP, IS_FP8 or KV_SCALES, KV_SCALES, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            value_cache_ptr + rows[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
        )  # [TILE_N, DIM_PAD]
        if KV_SCALES:  # the value tile dequantized in registers, in the query dtype
            vs = tl.load(kv_scales_ptr + scales_half + s_rows, mask=n_ok, other=0.0)
            v = v.to(q.dtype) * vs.to(q.dtype)[:, None]
        elif IS_FP8:
            v = v.to(q.dtype)
        if UPCAST_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc * v_scale
    _store_rows(
        acc, m_i, l_i, tokens, heads, row_ok, d, d_ok, split, num_splits, num_heads,
        part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, out_ptr, stride_o_token, stride_o_head, DIM_PAD, SPLIT,
        HAS_SINKS,
    )  # fmt: skip


@triton.jit
def _key_tile_range(pos0, q_len, window, split, num_splits, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    SPLIT: tl.constexpr):  # fmt: skip
    """(lo, hi, first tile, end tile) of the keys this program visits. Visible keys of the query tile are
    [lo, hi), lo aligned down to a whole key tile so tiles never straddle a block boundary in the middle
    (block sizes and TILE_N are powers of two in the fast modes); with SPLIT, this split's share of them."""
    hi = pos0 + q_len
    if HAS_WINDOW:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        lo = (tl.maximum(pos0 - window + 1, 0) // TILE_N) * TILE_N
    else:
        lo = pos0 * 0
    num_tiles = (hi - lo + TILE_N - 1) // TILE_N
    t_begin = num_tiles * 0
    t_end = num_tiles
    if SPLIT:
        per_split = (num_tiles + num_splits - 1) // num_splits
        t_begin = split * per_split
        t_end = tl.minimum(num_tiles, t_begin + per_split)
    return lo, hi, t_begin, t_end


@triton.jit
def _key_rows(table_row, start, n, n_ok, hi, block_size, stride_cache_block, stride_cache_token,
              TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Cache offsets of the key positions `n` = start + [0, TILE_N) (KV head 0), through the block table."""
    if BLOCK_SIZE == 0:
        # Any block size (runtime): the table entry of every key position.
        blk = tl.load(table_row + n // block_size, mask=n_ok, other=0).to(tl.int64)
        rows = blk * stride_cache_block + (n % block_size) * stride_cache_token
    elif BLOCK_SIZE >= TILE_N:
        # The key tile lies inside one block: one scalar table load.
        blk = tl.load(table_row + start // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_cache_block + ((start % BLOCK_SIZE) + tl.arange(0, TILE_N)) * stride_cache_token
    else:
        # TILE_N // BLOCK_SIZE whole blocks: one vector load of their ids.
        b = start // BLOCK_SIZE + tl.arange(0, TILE_N // BLOCK_SIZE)
        blks = tl.load(table_row + b, mask=b < (hi + BLOCK_SIZE - 1) // BLOCK_SIZE, other=0).to(tl.int64)
        rows2 = blks[:, None] * stride_cache_block + tl.arange(0, BLOCK_SIZE)[None, :] * stride_cache_token
        rows = tl.reshape(rows2, [TILE_N])
    return rows


@triton.jit
def _scores(q, kt, ks, qk_scale, soft_cap, n, row_pos, window, HAS_WINDOW: tl.constexpr,
            HAS_SOFT_CAP: tl.constexpr, UPCAST_KT: tl.constexpr, KEY_SCALES: tl.constexpr,
            DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):  # fmt: skip
    """Base-2 scores [BLOCK_M, TILE_N] of the queries against the key tile `kt` (one-byte codes upcast to the
    query dtype when UPCAST_KT; times each key's scale `ks` when KEY_SCALES), soft-capped, with the keys a
    row may not see (after it, or outside its window) at -inf."""
    if UPCAST_KT:
        kt = kt.to(q.dtype)
    if UPCAST_DOT:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
    if KEY_SCALES:
        s = s * ks[None, :]
    if HAS_SOFT_CAP:
        # c * tanh(s / c), with tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates cleanly), then to base 2.
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * 1.4426950408889634
    visible = n[None, :] <= row_pos[:, None]
    if HAS_WINDOW:
        visible = visible & (n[None, :] > row_pos[:, None] - window)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _store_rows(acc, m_i, l_i, tokens, heads, row_ok, d, d_ok, split, num_splits, num_heads, part_m_ptr, part_l_ptr,
                part_acc_ptr, sinks_ptr, out_ptr, stride_o_token, stride_o_head, DIM_PAD: tl.constexpr,
                SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    """The normalised output rows, or with SPLIT this split's partials for `_merge_splits_kernel` (which adds
    the sinks then). A sink joins the denominator as exp(sink - max) in base 2, like every score."""
    if SPLIT:
        # Partials [num_q_tokens, num_heads, num_splits(, DIM_PAD)]; an empty split leaves m = -inf,
        # l = 0, acc = 0, which the merge weighs by 0.
        part = (tokens * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=row_ok[:, None])
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = l_i + tl.where(row_ok, tl.exp2(sink - m_i), 0.0)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_offs = tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sinks_ptr,
    out_ptr,
    num_heads,
    num_splits,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    d = tl.arange(0, DIM_PAD)
    part = (token.to(tl.int64) * num_heads + head) * num_splits + sp
    m = tl.load(part_m_ptr + part, mask=sp_ok, other=float("-inf"))
    denom = tl.load(part_l_ptr + part, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)  # finite: every query sees at least its own key, in some split
    w = tl.exp2(m - m_max)
    total = tl.sum(denom * w, axis=0)
    if HAS_SINKS:
        total = total + tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max)
    out = tl.sum(acc * w[:, None], axis=0) / total
    o_offs = token.to(tl.int64) * stride_o_token + head * stride_o_head + d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    options: AttentionOptions,
    *,
    k_scale: float = 1.0, v_scale: float = 1.0, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton `paged_attention` for a planned step (`pagedkv.ops.plan`): the launches and nothing else (the
    options go as scalars; compile-time flags say which are set, and whether `kv_scales` come)."""
    tp = plan.triton
    assert tp is not None, "paged_attention_triton: the plan was made for another backend"
    cfg = tp.config
    shape = plan.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if shape.num_q_tokens == 0 or tp.num_tiles == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    split = tp.num_splits > 1
    constexprs = _planned_constexprs(plan, options, query, key_cache, kv_scales)
    _paged_attention_kernel[(tp.num_tiles, shape.num_kv_heads, tp.num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        plan.block_table,
        *tp.tiles,
        tp.part_m if split else out,
        tp.part_l if split else out,
        tp.part_acc if split else out,
        options.sinks if options.sinks is not None else out,
        *((kv_scales, kv_scales[0].numel()) if kv_scales is not None else (out, 0)),
        options.scale_for(shape.head_dim),
        float(k_scale),
        float(v_scale),
        float(options.soft_cap or 1.0),
        int(options.sliding_window or 0),
        shape.num_heads // shape.num_kv_heads,
        shape.num_heads,
        tp.num_splits,
        shape.block_size,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        plan.block_table.stride(0),
        **constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        sinks = options.sinks if options.sinks is not None else out
        _merge_splits_kernel[(shape.num_q_tokens, shape.num_heads)](
            tp.part_m, tp.part_l, tp.part_acc, sinks, out, shape.num_heads, tp.num_splits, out.stride(0),
            out.stride(1), **merge_constexprs(cfg, shape.head_dim, tp.num_splits, sinks=options.sinks is not None),
        )  # fmt: skip
    return out


def _planned_constexprs(
    plan: AttentionPlan, options: AttentionOptions, query: torch.Tensor, key_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
) -> dict[str, object]:  # fmt: skip
    """The attention kernel's constexprs for this plan and the options set, made once per plan and kept."""
    from pagedkv.storage.slots import block_scaled

    tp = plan.triton
    assert tp is not None, "triton kernels: a plan without its Triton part"
    window, soft_cap, sinks = (x is not None for x in (options.sliding_window, options.soft_cap, options.sinks))
    scaled, per_block = kv_scales is not None, block_scaled(key_cache, kv_scales)
    key = (window, soft_cap, sinks, query.dtype, scaled, per_block)
    constexprs = tp.constexprs.get(key)
    if constexprs is None:
        constexprs = attention_constexprs(
            tp.config,
            plan.shape.head_dim,
            window=window,
            soft_cap=soft_cap,
            sinks=sinks,
            query_dtype=query.dtype,
            cache_dtype=key_cache.dtype,
            split=tp.num_splits > 1,
            interpreting=_interpreting(),
            kv_scales=scaled,
            block_scales=per_block,
        )
        tp.constexprs[key] = constexprs
    return constexprs


def attention_constexprs(
    cfg: LaunchConfig,
    head_dim: int,
    *,
    window: bool,
    soft_cap: bool,
    query_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    split: bool,
    interpreting: bool = False,
    sinks: bool = False,
    kv_scales: bool = False,
    block_scales: bool = False,
) -> dict[str, object]:
    """The compile-time arguments of `_paged_attention_kernel` for one call: the single source for the
    launch above and for the compile test, which enumerates them. `block_scales`: the `kv_scales` hold one
    scale per block and KV head (`[2, NB, 1, Hkv]`) instead of one per token."""
    return {
        "HEAD_DIM": head_dim,
        "DIM_PAD": cfg.dim_pad,
        "GROUP_PAD": cfg.group_pad,
        "BLOCK_M": cfg.block_m,
        "TILE_N": cfg.tile_n,
        "BLOCK_SIZE": cfg.block_size_const,
        "HAS_WINDOW": window,
        "HAS_SOFT_CAP": soft_cap,
        "HAS_SINKS": sinks,
        "IS_FP8": cache_dtype == torch.float8_e4m3fn and not kv_scales,
        "KV_SCALES": kv_scales,
        "BLOCK_SCALES": kv_scales and block_scales,
        "SPLIT": split,
        "DOT_PRECISION": dot_precision(query_dtype, cache_dtype),
        "UPCAST_DOT": interpreting and _dot_dtype(query_dtype, cache_dtype) == torch.bfloat16,
    }


def merge_constexprs(cfg: LaunchConfig, head_dim: int, num_splits: int, *, sinks: bool = False) -> dict[str, object]:
    """The compile-time arguments of `_merge_splits_kernel` (launch and compile test)."""
    return {"HEAD_DIM": head_dim, "DIM_PAD": cfg.dim_pad, "SPLITS_PAD": num_splits, "HAS_SINKS": sinks}


def write_constexprs(num_kv_heads: int, head_dim: int) -> dict[str, object]:
    """The compile-time arguments of `_write_kv_kernel` (launch and compile test)."""
    row = num_kv_heads * head_dim
    return {"HEAD_DIM": head_dim, "ROW": row, "ROW_PAD": triton.next_power_of_2(row)}


def _interpreting() -> bool:
    """Triton's interpreter computes bfloat16 `tl.dot` wrongly (Triton 3.9), so there the kernel upcasts
    bfloat16 operands (after the same rounding of P) and dots in float32; compiled kernels never do."""
    from pagedkv.ops.dispatch import triton_interpreting

    return triton_interpreting()


def dot_precision(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """IEEE float32 dots when the dot runs in float32 (TF32 would lose the reference's 1e-5 agreement).

    The dot dtype is the cache's, or the query's for fp8 and int8 caches (upcast on load)."""
    return "ieee" if _dot_dtype(query_dtype, cache_dtype) == torch.float32 else "tf32"


def _dot_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    return query_dtype if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8) else cache_dtype
