"""`paged_attention` and `write_kv`: the public ops, one signature for every backend.

Contract (fixed; the hf integration and engine code against it):
- caches are `[num_blocks, block_size, num_kv_heads, head_dim]`; block 0 is usually the allocator's guard
  block that padding entries of block tables point at, and its content is never assumed.
- `write_kv(key_cache, value_cache, key, value, slot_mapping)`: `key[i]` (`[num_tokens, Hkv, D]`) goes to
  slot `slot_mapping[i]` (int64, `block_id * block_size + offset`), in place; nothing else changes.
- `paged_attention(query, key_cache, value_cache, block_table, seq_lens, cu_seqlens_q, ...)` returns
  `[num_q_tokens, num_heads, head_dim]` in the query dtype. `seq_lens[b]` counts ALL of sequence b's tokens,
  including the new ones whose KV is already written; sequence b's queries are its last
  `cu_seqlens_q[b+1] - cu_seqlens_q[b]` tokens, causal. `block_table` is int32 `[B, max_blocks]`, padded
  with a valid id; entries past `ceil(seq_lens[b] / block_size)` are never read. `sliding_window=w`: a
  query at position p sees keys at positions > p - w. `soft_cap=c`: scores = c * tanh(scores / c) after
  scaling. `sinks` (`[num_heads]`, gpt-oss): a logit per query head added to the softmax's denominator
  only. `scale` defaults to 1/sqrt(head_dim). GQA/MQA when num_heads is a multiple of num_kv_heads.
- `plan=`: an `AttentionPlan` from `pagedkv.ops.plan.plan_attention` made once per step for the same
  metadata; the call then skips validation, dispatch and metadata preparation (every layer of a forward
  shares one plan). Without it, each call plans for itself. Code that holds a plan calls
  `run_planned(plan, query, key_cache, value_cache, options)`, which takes the scalars as one
  `AttentionOptions` (`pagedkv.ops.options`), the spelling every backend below uses.
- Quantized caches (int8, fp8 e4m3/e5m2 codes) come with `kv_scales`, their float32 sidecar `[2, num_blocks,
  block_size, Hkv]` (a scale per token) or `[2, num_blocks, 1, Hkv]` (a scale per block; K then V;
  `KVStorage.layer_scales`): `write_kv` stores codes and scales in one pass (per-block scales by the rule of
  `pagedkv.storage.block_scales`, on the reference path on every device), `paged_attention` multiplies each
  code by its token's or block's scale for its head inside the kernel. fp8 e4m3 caches without a sidecar
  take one per-tensor `k_scale`/`v_scale` instead.
- The reference backend validates metadata values (raising `InvalidArgumentError`); the Triton backend
  checks shapes only, to stay free of host syncs.
"""

from __future__ import annotations

import torch

from pagedkv.ops.dispatch import choose_backend
from pagedkv.ops.options import AttentionOptions, attention_options
from pagedkv.ops.plan import AttentionPlan, plan_attention
from pagedkv.ops.reference import paged_attention_reference
from pagedkv.storage.slots import block_scaled, check_scales, check_write_args, scatter_kv


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Store new K/V at their slots (prefill chunks and decode tokens together), in place; into codes and
    `kv_scales` for a quantized cache with a sidecar."""
    chosen = choose_backend(key_cache.device, backend, cache_dtype=key_cache.dtype, op="write",
                            scaled=kv_scales is not None, block_scales=block_scaled(key_cache, kv_scales))  # fmt: skip
    check_write_args(key_cache, value_cache, key, value, slot_mapping, check_range=chosen == "reference")
    check_scales(key_cache, kv_scales)
    if chosen == "triton" and kv_scales is not None:
        from pagedkv.ops.triton_kernels import write_kv_codes_triton

        write_kv_codes_triton(key_cache, value_cache, key, value, slot_mapping, kv_scales)
    elif chosen == "triton":
        from pagedkv.ops.triton_kernels import write_kv_triton

        write_kv_triton(key_cache, value_cache, key, value, slot_mapping)
    else:
        scatter_kv(key_cache, value_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                   kv_scales=kv_scales)  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,
    backend: str | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Attention over paged KV for decode, prefill and chunked prefill in one call (see module docstring)."""
    options = attention_options(scale, sliding_window, soft_cap, sinks)
    if plan is None:
        plan = plan_attention(
            query, key_cache, value_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            backend=backend,
        )
    return run_planned(plan, query, key_cache, value_cache, options, k_scale=k_scale, v_scale=v_scale,
                       kv_scales=kv_scales)  # fmt: skip


def run_planned(
    plan: AttentionPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    options: AttentionOptions,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` on a plan, which holds the step's metadata (block table, lengths, query layout): a
    layer passes only its query, its caches and its `AttentionOptions`. The one dispatch point; both backends
    take these same arguments."""
    plan.check_call(query, key_cache)
    options.check_heads(plan.shape.num_heads, query.device)
    check_scales(key_cache, kv_scales)
    if plan.backend == "triton":
        from pagedkv.ops.triton_kernels import paged_attention_triton

        return paged_attention_triton(query, key_cache, value_cache, plan, options, k_scale=k_scale, v_scale=v_scale,
                                      kv_scales=kv_scales)  # fmt: skip
    return paged_attention_reference(query, key_cache, value_cache, plan, options, k_scale=k_scale, v_scale=v_scale,
                                     kv_scales=kv_scales)  # fmt: skip
