"""`AttentionPlan`: what a `paged_attention` call needs that does not change between layers, made once.

A forward pass calls attention once per layer with the same metadata (block tables, lengths, query
layout) and caches of the same shape. Everything derived from those alone is computed here once per step
and handed to every layer's call through `run_planned(plan, query, key_cache, value_cache, options)`:

- shape validation (`check_attention_shapes`) and, on the reference backend, the value checks
  (`check_attention_metadata`, a host sync on CUDA);
- the backend choice (`choose_backend`) and the int32/contiguous forms of the metadata tensors;
- for Triton: the launch configuration (`pagedkv.ops.launch`), the split count (with the device's SM count,
  read once per device), the query-tile table (query tile -> sequence, first packed token, token count,
  position of its first token: the kernel's "which sequence, which position"), and the split buffers.

The tile table is built with a few device ops and no host sync: the grid is an upper bound and tiles past
the real ones carry `q_len = 0`. Per layer, a planned call checks that the query and caches have the
planned shapes (tuple comparisons) and launches the kernel(s). Both backends take the same arguments:
`(query, key_cache, value_cache, plan, options)`, the plan holding the step's metadata and the layer's
scalars (`scale`, `sliding_window`, `soft_cap`) travelling as one `AttentionOptions`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops.dispatch import choose_backend
from pagedkv.ops.launch import LaunchConfig, choose_launch, choose_num_splits, num_tiles_upper_bound
from pagedkv.ops.options import (
    AttentionShape,
    check_attention_metadata,
    check_attention_shapes,
)


@dataclass(frozen=True, slots=True)
class TritonPlan:
    config: LaunchConfig
    num_splits: int
    num_tiles: int
    tiles: tuple[torch.Tensor, ...]  # 4 x int32 [num_tiles]: sequence, first packed token, token count, first position
    part_m: torch.Tensor | None  # float32 [num_q_tokens, num_heads, num_splits] when num_splits > 1
    part_l: torch.Tensor | None
    part_acc: torch.Tensor | None  # float32 [num_q_tokens, num_heads, num_splits, dim_pad]
    # compile-time arguments per (window?, soft cap?, sinks?, query dtype, kv scales?), filled by the first layer
    # needing them
    constexprs: dict[tuple[bool, bool, bool, torch.dtype, bool], dict[str, object]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """One step's attention metadata, validated and prepared for `backend` (see the module docstring)."""

    backend: str
    shape: AttentionShape
    query_shape: tuple[int, ...]
    cache_shape: tuple[int, ...]
    cache_dtype: torch.dtype
    block_table: torch.Tensor  # int32, contiguous
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int | None
    triton: TritonPlan | None

    def check_call(self, query: torch.Tensor, key_cache: torch.Tensor) -> None:
        """The call matches the plan (shapes, cache dtype); the scalars are checked by `AttentionOptions`."""
        if tuple(query.shape) != self.query_shape or tuple(key_cache.shape) != self.cache_shape:
            raise InvalidArgumentError(
                f"query {tuple(query.shape)} / cache {tuple(key_cache.shape)} do not match the plan's "
                f"{self.query_shape} / {self.cache_shape}; make a plan per step with plan_attention"
            )
        if key_cache.dtype != self.cache_dtype:
            raise InvalidArgumentError(f"cache dtype {key_cache.dtype} differs from the plan's {self.cache_dtype}")


@functools.cache
def device_sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device, read once per process."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def plan_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
    launch: LaunchConfig | None = None,
) -> AttentionPlan:
    """Validate and prepare one step's metadata for every layer's `paged_attention` call.

    `query` may be any layer's query (only its shape, dtype and device are read). `max_seqlen_q` and
    `max_seqlen_k` (host ints the caller usually has) pick the decode kernel and the split count; without
    them the plan assumes the widest case, which is always correct. `num_splits` (a power of two <= 32)
    overrides the split heuristic, `launch` the launch configuration (tests, tuning sweeps).
    """
    shape = check_attention_shapes(query, key_cache, value_cache, block_table, seq_lens, cu_seqlens_q)
    chosen = choose_backend(query.device, backend, cache_dtype=key_cache.dtype)
    triton_plan = None
    if chosen == "reference":
        check_attention_metadata(shape, block_table, seq_lens, cu_seqlens_q, max_seqlen_q)
    else:
        triton_plan = _plan_triton(shape, key_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                                   max_seqlen_k, num_splits, launch)
    table = block_table if block_table.dtype == torch.int32 and block_table.is_contiguous() else (
        block_table.to(torch.int32).contiguous()
    )
    return AttentionPlan(
        backend=chosen,
        shape=shape,
        query_shape=tuple(query.shape),
        cache_shape=tuple(key_cache.shape),
        cache_dtype=key_cache.dtype,
        block_table=table,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        triton=triton_plan,
    )


def _plan_triton(
    shape: AttentionShape,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    num_splits: int | None,
    launch: LaunchConfig | None,
) -> TritonPlan:
    decode = max_seqlen_q == 1 if max_seqlen_q is not None else shape.num_q_tokens <= shape.num_seqs
    config = launch or choose_launch(
        decode=decode,
        group=shape.num_heads // shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        cache_bits=key_cache.element_size() * 8,
    )
    device = key_cache.device
    num_tiles = num_tiles_upper_bound(shape.num_q_tokens, shape.num_seqs, config.block_q)
    # Rows padded to a multiple of 4 int32s so each row starts 16-byte aligned, the alignment the compiled
    # (and compile-tested) specialization assumes; the padding tiles are never launched.
    padded = -(-num_tiles // 4) * 4
    tiles = tuple(query_tiles(seq_lens, cu_seqlens_q, config.block_q, padded).unbind(0))
    if num_splits is None:
        max_context = max_seqlen_k if max_seqlen_k is not None else shape.max_blocks_per_seq * shape.block_size
        num_sms = device_sm_count(device.index or 0) if device.type == "cuda" else 0
        num_splits = choose_num_splits(
            num_tiles * shape.num_kv_heads, max_context, config.tile_n, num_sms, config.num_warps
        )
    if num_splits < 1 or num_splits > 32 or num_splits & (num_splits - 1):
        raise InvalidArgumentError(f"num_splits must be a power of two in [1, 32], got {num_splits}")
    part_m = part_l = part_acc = None
    if num_splits > 1:
        part_m = torch.empty((shape.num_q_tokens, shape.num_heads, num_splits), dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (shape.num_q_tokens, shape.num_heads, num_splits, config.dim_pad), dtype=torch.float32, device=device
        )
    return TritonPlan(config, num_splits, num_tiles, tiles, part_m, part_l, part_acc)


def query_tiles(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, block_q: int, num_tiles: int) -> torch.Tensor:
    """int32 `[4, num_tiles]`: per query tile its sequence, first packed token, token count, first position.

    Sequence b's queries (packed tokens `cu[b] .. cu[b+1]-1`, positions `seq_lens[b] - q_len_b ..`) are cut
    into `ceil(q_len_b / block_q)` tiles in order; tiles past the last real one have count 0. Device ops
    only (no host sync): `num_tiles` is an upper bound the caller computes from host ints.
    """
    device = cu_seqlens_q.device
    cu = cu_seqlens_q.long()
    lens = seq_lens.long()
    q_lens = cu[1:] - cu[:-1]
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    tile_cu = torch.zeros(lens.numel() + 1, dtype=torch.long, device=device)
    torch.cumsum(tiles_per_seq, dim=0, out=tile_cu[1:])
    t = torch.arange(num_tiles, device=device)
    seq = torch.searchsorted(tile_cu[1:], t, right=True)
    valid = seq < lens.numel()
    seq_c = seq.clamp(max=max(lens.numel() - 1, 0))
    q_start = cu[seq_c] + (t - tile_cu[seq_c]) * block_q
    q_len = torch.where(valid, (cu[seq_c + 1] - q_start).clamp(min=0, max=block_q), 0)
    pos = lens[seq_c] - (cu[seq_c + 1] - q_start)
    return torch.stack([seq_c, q_start, q_len, pos]).to(torch.int32).contiguous()
