"""Per-step batch metadata: what one forward pass over a packed, paged batch needs.

All scheduled sequences' new tokens are packed into one row of length T (batch dim 1, like vLLM), so
prefill chunks and decode tokens of different lengths share one forward without padding:

```
packed row:   [ seq 0: tokens s0 .. s0+n0-1 | seq 1: s1 .. s1+n1-1 | ... ]     T = sum(n_i)
cu_seqlens_q: [0, n0, n0+n1, ...]                                             (B+1)
positions:    [s0, s0+1, ..., s0+n0-1, s1, ...]                               (T)
seq_lens:     [s0+n0, s1+n1, ...]   context incl. the new tokens              (B)
slot_mapping: slot of each packed token = table[t // block_size] * block_size + t % block_size
```

`s_i` is how many tokens of sequence i already have KV in the cache (computed or served from the prefix
cache); the new tokens' KV is written first, then each query attends causally to `seq_lens[i]` tokens.
`logits_indices` picks, for every sequence whose chunk ends at its last known token, the packed index of
that token: only those rows go through the LM head.

Everything arrives as numpy arrays from the allocator and crosses into torch with `torch.from_numpy`.

Attention groups: the reference attention path pads queries to `[B, max_q]` and walks keys up to the
longest sequence, so one call over a decode batch plus a 200-token prefill chunk computes 200 query rows
for every decoding sequence. On CPU (`split_groups=True`, the default there) the batch is therefore cut into
groups that each cost what they compute: every run of consecutive decode sequences (one query each) is one
group, and every prefill chunk is a group of its own. A fused GPU kernel takes the whole batch as one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.core.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences `[seq_start, seq_end)` of a step, whose queries are packed tokens `[token_start, token_end)`."""

    token_start: int
    token_end: int
    block_table: torch.Tensor  # int32 [b, W]
    seq_lens: torch.Tensor  # int32 [b]
    cu_seqlens_q: torch.Tensor  # int32 [b + 1], relative to token_start
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One forward pass's inputs. Tensors live on the model's device; see the module docstring."""

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_table: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    logits_indices: torch.Tensor  # int64 [K], packed index of each sequence's last token that samples
    groups: tuple[AttentionGroup, ...]  # how attention is split into calls (see the module docstring)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def build_step_batch(
    new_token_ids: Sequence[npt.ArrayLike],
    starts: npt.ArrayLike,
    block_table: npt.NDArray[np.int32],
    slot_mapping: npt.NDArray[np.int64],
    produces_token: npt.ArrayLike,
    *,
    device: torch.device | str = "cpu",
    split_groups: bool | None = None,
) -> StepBatch:
    """Pack one step. `new_token_ids[i]` are sequence i's tokens at positions `starts[i]..`; `block_table`
    and `slot_mapping` come from the allocator (`block_table(seq_ids, pad_id=0)`,
    `slot_mapping(seq_ids, starts, starts + n)`); `produces_token[i]` says whether sequence i samples."""
    chunks, starts_np, produces, num_new, cu = _checked_step(
        new_token_ids, starts, block_table, slot_mapping, produces_token
    )
    num_seqs = len(chunks)
    total = int(cu[-1])
    seq_lens = starts_np + num_new
    if block_table.shape[1] == 0:
        raise InvalidArgumentError("build_step_batch: block_table has no columns")
    positions = np.arange(total, dtype=np.int64) + np.repeat(starts_np - cu[:-1], num_new)
    logits_indices = (cu[1:] - 1)[produces]
    dev = torch.device(device)

    def to(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    block_table_t = to(block_table.astype(np.int32, copy=False))
    seq_lens_t = to(seq_lens.astype(np.int32))
    cu_t = to(cu.astype(np.int32))
    if split_groups is None:
        split_groups = dev.type == "cpu"
    bounds = _group_bounds(num_new) if split_groups else [(0, num_seqs)]
    groups = tuple(
        AttentionGroup(
            token_start=int(cu[a]),
            token_end=int(cu[b]),
            block_table=block_table_t[a:b],
            seq_lens=seq_lens_t[a:b],
            cu_seqlens_q=cu_t[a : b + 1] - cu_t[a],
            max_seqlen_q=int(num_new[a:b].max()),
            max_seqlen_k=int(seq_lens[a:b].max()),
        )
        for a, b in bounds
    )
    return StepBatch(
        input_ids=to(np.concatenate(chunks)).view(1, total),
        position_ids=to(positions).view(1, total),
        slot_mapping=to(slot_mapping.astype(np.int64, copy=False)),
        block_table=block_table_t,
        seq_lens=seq_lens_t,
        cu_seqlens_q=cu_t,
        max_seqlen_q=int(num_new.max()),
        max_seqlen_k=int(seq_lens.max()),
        logits_indices=to(logits_indices),
        groups=groups,
    )


def _checked_step(
    new_token_ids: Sequence[npt.ArrayLike],
    starts: npt.ArrayLike,
    block_table: npt.NDArray[np.int32],
    slot_mapping: npt.NDArray[np.int64],
    produces_token: npt.ArrayLike,
) -> tuple[
    list[npt.NDArray[np.int64]],
    npt.NDArray[np.int64],
    npt.NDArray[np.bool_],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
]:
    """`build_step_batch`'s arguments as arrays, checked against each other: (token chunks, starts,
    produces_token, new tokens per sequence, their cumulative offsets `cu [num_seqs + 1]`)."""
    chunks = [np.asarray(t, dtype=np.int64).reshape(-1) for t in new_token_ids]
    num_seqs = len(chunks)
    starts_np = np.asarray(starts, dtype=np.int64).reshape(-1)
    produces = np.asarray(produces_token, dtype=bool).reshape(-1)
    if num_seqs == 0:
        raise InvalidArgumentError("build_step_batch: empty batch; schedule at least one sequence")
    if starts_np.shape[0] != num_seqs or produces.shape[0] != num_seqs:
        raise InvalidArgumentError(
            f"build_step_batch: {num_seqs} sequences but {starts_np.shape[0]} starts and "
            f"{produces.shape[0]} produces_token flags"
        )
    if block_table.ndim != 2 or block_table.shape[0] != num_seqs:
        raise InvalidArgumentError(
            f"build_step_batch: block_table must be [{num_seqs}, W], got shape {block_table.shape}"
        )
    num_new = np.fromiter((c.shape[0] for c in chunks), dtype=np.int64, count=num_seqs)
    if (num_new <= 0).any() or (starts_np < 0).any():
        raise InvalidArgumentError("build_step_batch: every sequence needs >= 1 new token and a start >= 0")
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=cu[1:])
    total = int(cu[-1])
    if slot_mapping.shape != (total,):
        raise InvalidArgumentError(
            f"build_step_batch: slot_mapping must have one slot per new token ({total}), got {slot_mapping.shape}"
        )
    return chunks, starts_np, produces, num_new, cu


def _group_bounds(num_new: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """[start, end) sequence ranges: runs of consecutive one-token sequences, and each longer chunk alone."""
    bounds: list[tuple[int, int]] = []
    start = 0
    for i, n in enumerate(num_new.tolist()):
        if n > 1:
            if start < i:
                bounds.append((start, i))
            bounds.append((i, i + 1))
            start = i + 1
    if start < len(num_new):
        bounds.append((start, len(num_new)))
    return bounds
