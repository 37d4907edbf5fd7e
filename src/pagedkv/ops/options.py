"""Checks of attention arguments and metadata, with messages that say what to fix.

`check_attention_shapes` is cheap (no device sync) and runs on every backend; `check_attention_metadata`
reads values (a host sync on CUDA) and runs on the reference path, which is the oracle and the place where
bad metadata must be caught: a block id out of range, a length longer than its table, query counts that do
not fit their sequences.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage.slots import check_cache_pair


class AttentionShape(NamedTuple):
    num_seqs: int
    num_q_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int


def _int_tensor(t: torch.Tensor, name: str, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch tensor (see pagedkv.ops.metadata), got {type(t).__name__}")
    if t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(f"{name} must be a {dim}-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")


def check_attention_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> AttentionShape:
    """Shapes, dtypes and devices; never reads tensor values (the scalars are checked by `AttentionOptions`)."""
    check_cache_pair(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise InvalidArgumentError(
            f"query must be [num_q_tokens, num_heads, {head_dim}] (head_dim of the cache), got {tuple(query.shape)}"
        )
    if not query.dtype.is_floating_point:
        raise InvalidArgumentError(f"query must be floating point, got {query.dtype}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA/MQA"
        )
    _int_tensor(block_table, "block_table", 2)
    _int_tensor(seq_lens, "seq_lens", 1)
    _int_tensor(cu_seqlens_q, "cu_seqlens_q", 1)
    num_seqs = block_table.shape[0]
    if seq_lens.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise InvalidArgumentError(
            f"block_table has {num_seqs} rows, seq_lens {seq_lens.shape[0]} entries and cu_seqlens_q "
            f"{cu_seqlens_q.shape[0]}; expected B, B and B+1"
        )
    for name, t in (("query", query), ("block_table", block_table), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        if t.device != key_cache.device:
            raise InvalidArgumentError(f"{name} is on {t.device} but the cache is on {key_cache.device}")
    return AttentionShape(
        num_seqs, query.shape[0], num_heads, num_kv_heads, head_dim, block_size, num_blocks, block_table.shape[1]
    )


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """A layer's attention options, one value from the model's call down to every backend, under one spelling:
    `scale` (None: 1/sqrt(head_dim), see `scale_for`), `sliding_window` (a query at p sees keys > p - w),
    `soft_cap` (scores = c * tanh(scores / c)) and `sinks` (gpt-oss's attention sinks: a learned logit per
    query head, `[num_heads]`, that joins the softmax's denominator and adds no value: a query's weights sum
    to less than one). Valid by construction; `attention_options` builds them and checks each distinct
    scalar combination once per process. Equality and hashing see the scalars only (`sinks` is a tensor)."""

    scale: float | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        scale, window, cap, sinks = self.scale, self.sliding_window, self.soft_cap, self.sinks
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise InvalidArgumentError(f"scale must be a positive finite float, got {scale!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise InvalidArgumentError(f"sliding_window must be a positive int (tokens seen, itself included), got {window!r}")
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise InvalidArgumentError(f"soft_cap must be a positive finite float, got {cap!r}")
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not sinks.dtype.is_floating_point):
            got = f"{sinks.dtype} of shape {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise InvalidArgumentError(f"sinks must be a 1-D float tensor of one logit per query head, got {got}")

    def scale_for(self, head_dim: int) -> float:
        """The score multiplier: `scale`, or 1/sqrt(head_dim) (torch SDPA's default, to the bit)."""
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)

    def check_heads(self, num_heads: int, device: torch.device) -> None:
        """The sinks (if any) fit a call of `num_heads` query heads on `device`."""
        if self.sinks is not None and (tuple(self.sinks.shape) != (num_heads,) or self.sinks.device != device):
            raise InvalidArgumentError(
                f"sinks {tuple(self.sinks.shape)} on {self.sinks.device} do not fit {num_heads} query heads on {device}"
            )


NO_OPTIONS = AttentionOptions()


@functools.lru_cache(maxsize=256)
def _scalar_options(scale: float | None, sliding_window: int | None, soft_cap: float | None) -> AttentionOptions:
    return AttentionOptions(scale, sliding_window, soft_cap)


def attention_options(
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttentionOptions:
    """The `AttentionOptions` of these values; the scalars alone are checked the first time each combination
    is seen (a layer's call is cheap), sinks at every call (a cheap shape check)."""
    if sinks is None:
        return _scalar_options(scale, sliding_window, soft_cap)
    return AttentionOptions(scale, sliding_window, soft_cap, sinks)


def check_attention_metadata(
    shape: AttentionShape,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int | None,
) -> None:
    """Values: query counts fit their sequences, tables cover their lengths, live block ids are in range."""
    cu = cu_seqlens_q.long()
    lens = seq_lens.long()
    if int(cu[0]) != 0 or int(cu[-1]) != shape.num_q_tokens:
        raise InvalidArgumentError(
            f"cu_seqlens_q must start at 0 and end at num_q_tokens={shape.num_q_tokens}, "
            f"got {int(cu[0])}..{int(cu[-1])}"
        )
    q_lens = cu[1:] - cu[:-1]
    _first_bad(q_lens < 0, "cu_seqlens_q must be non-decreasing; sequence {i} has a negative query count", q_lens)
    _first_bad(lens < 1, "seq_lens[{i}] = {v}: every sequence needs at least one token", lens)
    _first_bad(
        q_lens > lens,
        "sequence {i} has more queries than tokens (seq_lens includes the new tokens); seq_lens = {v}",
        lens,
    )
    capacity = shape.max_blocks_per_seq * shape.block_size
    _first_bad(
        lens > capacity,
        "seq_lens[{i}] = {v} is longer than its block table: "
        + f"{shape.max_blocks_per_seq} blocks x {shape.block_size} = {capacity} tokens; widen the table",
        lens,
    )
    if max_seqlen_q is not None and shape.num_seqs > 0 and max_seqlen_q < int(q_lens.max()):
        raise InvalidArgumentError(f"max_seqlen_q={max_seqlen_q} is below the longest query run {int(q_lens.max())}")
    num_live = (lens + shape.block_size - 1) // shape.block_size
    live = torch.arange(shape.max_blocks_per_seq, device=lens.device)[None, :] < num_live[:, None]
    ids = block_table.long()
    bad = live & ((ids < 0) | (ids >= shape.num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise InvalidArgumentError(
            f"block_table[{b}, {j}] = {int(ids[b, j])} is not a block id of the cache "
            f"(0..{shape.num_blocks - 1}); a live entry must name an allocated block"
        )


def _first_bad(bad: torch.Tensor, message: str, values: torch.Tensor) -> None:
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise InvalidArgumentError(message.format(i=i, v=int(values[i])))
