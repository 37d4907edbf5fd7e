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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SdpaPlan:
    """What `paged_sdpa` derives from a group's metadata alone, made once per step and shared by the layers:
    the block ids to gather, the key length, and the visibility mask per sliding window (made at first use)."""

    ids: torch.Tensor  # int64 [B * num_blocks]: table[:, :num_blocks], flattened
    num_blocks: int
    length: int  # a prefill chunk's sequence length (its single sequence); 0 for decode groups
    seq_lens: torch.Tensor
    max_seqlen_q: int
    block_size: int
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def build(block_table: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
              block_size: int) -> SdpaPlan:
        num_blocks = -(-max_seqlen_k // block_size)
        ids = block_table[:, :num_blocks].reshape(-1).long()
        length = int(seq_lens[0]) if max_seqlen_q > 1 else 0
        return SdpaPlan(ids, num_blocks, length, seq_lens, max_seqlen_q, block_size)

    def mask(self, num_q: int, sliding_window: int | None) -> torch.Tensor:
        """Decode: `[B, 1, 1, L]`; prefill chunk: `[num_q, length]` (True = visible), cached per window."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            device = self.ids.device
            key_pos = torch.arange(self.num_blocks * self.block_size, device=device)
            if self.max_seqlen_q == 1:
                lens = self.seq_lens.long()[:, None]
                visible = key_pos[None, :] < lens
                if sliding_window is not None:
                    visible &= key_pos[None, :] > lens - 1 - sliding_window
                mask = visible[:, None, None, :]
            else:
                q_pos = torch.arange(self.length - num_q, self.length, device=device)[:, None]
                visible = key_pos[None, : self.length] <= q_pos
                if sliding_window is not None:
                    visible &= key_pos[None, : self.length] > q_pos - sliding_window
                mask = visible
            self._masks[sliding_window] = mask
        return mask


def sdpa_supports(max_seqlen_q: int, num_seqs: int, soft_cap: float | None) -> bool:
    """Whether `paged_sdpa` handles a group of this shape."""
    return soft_cap is None and (max_seqlen_q == 1 or num_seqs == 1)


def _gather(kv: torch.Tensor, ids: torch.Tensor, batch: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `ids` (`table[:, :num_blocks]` flattened) of one layer's `kv` (`[2, num_blocks, block_size, Hkv,
    D]`, K then V) as K and V `[B, Hkv, num_blocks * block_size, D]`, in one `index_select`."""
    _, _, block_size, num_kv_heads, head_dim = kv.shape
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
    plan: SdpaPlan | None = None,
) -> torch.Tensor:
    """`[num_q_tokens, H, D]` attention for a decode group or a single prefill chunk (see module docs).

    `kv` is one layer's pages, `[2, num_blocks, block_size, Hkv, D]` (K then V). A prefill chunk with no
    cached context (`max_seqlen_k == max_seqlen_q`) attends over `new_key`/`new_value` (`[n, Hkv, D]`, the
    chunk's own K/V, already written to the pages) when given, skipping the gather. `plan` (from
    `SdpaPlan.build` on the same metadata, shared by a step's layers) saves the per-call index work."""
    num_q, num_heads, head_dim = query.shape
    num_kv_heads = kv.shape[3]
    gqa = num_heads != num_kv_heads
    if plan is None:
        plan = SdpaPlan.build(block_table, seq_lens, max_seqlen_q, max_seqlen_k, kv.shape[2])
    if max_seqlen_q > 1 and max_seqlen_k == max_seqlen_q and new_key is not None and new_value is not None:
        k, v = new_key.transpose(0, 1).unsqueeze(0), new_value.transpose(0, 1).unsqueeze(0)
        if sliding_window is None:
            q = query.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
    else:
        k, v = _gather(kv, plan.ids, block_table.shape[0], plan.num_blocks)
    if max_seqlen_q == 1:  # decode group: one query per sequence, at position seq_len - 1
        # One query position per sequence: the query heads sharing a KV head become that head's query rows
        # (heads h*g .. h*g+g-1 read KV head h), so K/V are never repeated per query head.
        q = query.reshape(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask(num_q, sliding_window), scale=scale)
        return out.reshape(num_q, num_heads, head_dim)
    # one sequence, n queries at positions [L - n, L)
    length = plan.length
    k, v = k[:, :, :length], v[:, :, :length]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if length == num_q and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask(num_q, sliding_window), scale=scale,
                                             enable_gqa=gqa)
    return out[0].transpose(0, 1)
