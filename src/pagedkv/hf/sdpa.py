"""Paged attention by block gather + torch SDPA: the CPU fast path of the hf integration.

Same semantics as `pagedkv.ops.paged_attention` (causal; a query at position p sees keys at positions
`<= p` and, with a window w, `> p - w`; GQA; `seq_lens` counts the new tokens, whose KV is already written),
for the two shapes a CPU step is made of (see `pagedkv.hf.step_metadata`, attention groups):

- a decode group: B sequences with one query each, cut into length buckets (`decode_buckets`: sequences
  of similar length together, so a short context is not padded to the longest one; the cut minimises the
  padded blocks read plus a fixed cost per call). Each bucket's blocks are gathered into `[b, Hkv, L, D]`
  (L = the bucket's longest context, rounded up to whole blocks), an additive mask hides each row's positions
  past its own length (and outside its window), and one SDPA call per bucket does the rest. As before the
  cut, a row's last bits depend on the padded length SDPA tiles over, so on the other rows' lengths;
- one prefill chunk: a single sequence's n queries against its L keys, gathered from its blocks; with no
  cached context and no window it is plain causal SDPA, otherwise a bottom-right causal mask.

A float32 or bfloat16 decode group on a CPU skips the gather and SDPA altogether: `pagedkv.ops.cpu_decode`
(a C kernel, built with the package) reads the pages in place, about 2x faster than the buckets on the
decode groups of `pagedkv bench e2e`; the buckets serve every other dtype and builds without
the extension (`PAGEDKV_NATIVE=0` turns it off).

Why not the reference op: it pads queries and keys to the batch maxima and folds tiles through a float32
online softmax in Python, which is the right oracle but costs 3-5x more than SDPA on these shapes on a CPU.
Soft-capped models (Gemma 2), models with attention sinks (gpt-oss) and any other group shape go to
`pagedkv.ops.paged_attention`. Padding entries of block tables point at the null block; what the gather
reads there is masked out. The pages are zero-initialised and only ever hold finite values, so masked rows
contribute exactly nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from pagedkv.ops import cpu_decode
from pagedkv.ops.options import AttentionOptions

# What one more bucket costs (a gather, an SDPA call, the query and output copies), in blocks of one sequence
# read: on a CPU ~18 us a call and ~4-5 us a block of 16 tokens for a 9-head model, and replaying the decode
# groups of `pagedkv bench e2e` through `paged_sdpa` was fastest at 8 (1, 2, 4, 8, 16 tried; 1.7x less time
# than one padded call). `decode_buckets` trades padding against calls with it.
CALL_COST_BLOCKS = 8


def decode_buckets(num_blocks: npt.ArrayLike, call_cost: float = CALL_COST_BLOCKS) -> list[npt.NDArray[np.int64]]:
    """Cut a decode group's sequences (`num_blocks[i]` blocks of context each) into buckets, each a sorted
    array of row indices, minimising `sum over buckets (call_cost + rows * the bucket's most blocks)`: the
    blocks one SDPA call per bucket reads, padding included, plus a fixed cost per call. Exact (dynamic
    programming over the distinct block counts, O(K^2) for K distinct counts); rows keep their order inside a
    bucket, and buckets come shortest first."""
    counts = np.asarray(num_blocks, dtype=np.int64).reshape(-1)
    order = np.argsort(counts, kind="stable")
    values, first = np.unique(counts[order], return_index=True)
    ends = np.append(first[1:], counts.size)  # rows [0, ends[j]) of `order` have count <= values[j]
    k = values.size
    best = np.zeros(k + 1)  # best[j]: cheapest cut of the rows with the j smallest distinct counts
    cut = np.zeros(k + 1, dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1]))
    for j in range(1, k + 1):
        costs = best[:j] + call_cost + (ends[j - 1] - starts[:j]) * values[j - 1]
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    buckets: list[npt.NDArray[np.int64]] = []
    j = k
    while j > 0:
        i = int(cut[j])
        buckets.append(np.sort(order[starts[i] : ends[j - 1]]))
        j = i
    return buckets[::-1]


@dataclass(frozen=True, slots=True)
class SdpaPlan:
    """One attention group's metadata and what `paged_sdpa` derives from it alone, made once per step and
    shared by the layers: the block table and lengths, the block ids to gather, the key length, and, each at
    first use, the visibility mask per sliding window and a decode group's length buckets (`buckets()`; not
    computed at all when the C kernel serves it)."""

    block_table: torch.Tensor  # int [B, W]
    ids: torch.Tensor  # int64 [B * num_blocks]: table[:, :num_blocks], flattened
    num_blocks: int
    length: int  # a prefill chunk's sequence length (its single sequence); 0 for decode groups
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    cuttable: bool = False  # a decode group to cut into buckets at first use
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _cut: list[tuple[tuple[torch.Tensor, SdpaPlan], ...]] = field(default_factory=list)

    @staticmethod
    def build(block_table: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
              block_size: int, *, bucketed: bool = True) -> SdpaPlan:
        """The plan of one group; a decode group of several sequences is cut by `decode_buckets` when first
        asked (`buckets()`) unless `bucketed=False` (then one gather over every row, padded to the longest)."""
        num_blocks = -(-max_seqlen_k // block_size)
        ids = block_table[:, :num_blocks].reshape(-1).long()
        length = int(seq_lens[0]) if max_seqlen_q > 1 else 0
        cuttable = max_seqlen_q == 1 and bucketed and seq_lens.shape[0] > 1
        return SdpaPlan(block_table, ids, num_blocks, length, seq_lens, max_seqlen_q, max_seqlen_k, block_size,
                        cuttable)  # fmt: skip

    def buckets(self) -> tuple[tuple[torch.Tensor, SdpaPlan], ...]:
        """A decode group's length buckets, each (row indices, that bucket's plan); () when one padded call
        serves the group. Cut at the first call and kept."""
        if not self._cut:
            parts = []
            if self.cuttable:
                lens = self.seq_lens.cpu().numpy().astype(np.int64)
                cut = decode_buckets(-(-lens // self.block_size))
                for rows in cut if len(cut) > 1 else ():
                    idx = torch.from_numpy(rows).to(self.block_table.device)
                    sub = SdpaPlan.build(self.block_table[idx], self.seq_lens[idx], 1, int(lens[rows].max()),
                                         self.block_size, bucketed=False)  # fmt: skip
                    parts.append((idx, sub))
            self._cut.append(tuple(parts))
        return self._cut[0]

    def mask(self, num_q: int, sliding_window: int | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode: `[B, 1, 1, L]` additive (0 visible, -inf hidden) of `dtype`; prefill chunk: `[num_q,
        length]` boolean (True = visible); cached per window."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            device = self.ids.device
            key_pos = torch.arange(self.num_blocks * self.block_size, device=device)
            if self.max_seqlen_q == 1:
                lens = self.seq_lens.long()[:, None]
                visible = key_pos[None, :] < lens
                if sliding_window is not None:
                    visible &= key_pos[None, :] > lens - 1 - sliding_window
                # additive (0 / -inf) in the query's dtype: SDPA would convert a boolean mask at every call
                mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
                mask = mask[:, None, None, :]
            else:
                q_pos = torch.arange(self.length - num_q, self.length, device=device)[:, None]
                visible = key_pos[None, : self.length] <= q_pos
                if sliding_window is not None:
                    visible &= key_pos[None, : self.length] > q_pos - sliding_window
                mask = visible
            self._masks[sliding_window] = mask
        return mask


def sdpa_supports(max_seqlen_q: int, num_seqs: int, options: AttentionOptions) -> bool:
    """Whether `paged_sdpa` handles a group of this shape with these options (SDPA has no soft cap and no
    attention sinks)."""
    return options.soft_cap is None and options.sinks is None and (max_seqlen_q == 1 or num_seqs == 1)


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
    plan: SdpaPlan,
    options: AttentionOptions,
    *,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[num_q_tokens, H, D]` attention for a decode group or a single prefill chunk (see module docs).

    `kv` is one layer's pages, `[2, num_blocks, block_size, Hkv, D]` (K then V); `plan` (`SdpaPlan.build`,
    shared by a step's layers) holds the group's metadata. A prefill chunk with no cached context
    (`max_seqlen_k == max_seqlen_q`) attends over `new_key`/`new_value` (`[n, Hkv, D]`, the chunk's own K/V,
    already written to the pages) when given, skipping the gather."""
    num_q, num_heads, head_dim = query.shape
    gqa = num_heads != kv.shape[3]
    scale, sliding_window = options.scale_for(head_dim), options.sliding_window
    if plan.max_seqlen_q == 1:  # decode group: one query per sequence, at position seq_len - 1
        if cpu_decode.available(query, kv):  # float32 or bf16: the C kernel reads the pages in place
            return cpu_decode.decode_attention(query, kv, plan.block_table, plan.seq_lens, options)
        return _decode(query, kv, plan, options)
    if plan.max_seqlen_k == plan.max_seqlen_q and new_key is not None and new_value is not None:
        k, v = new_key.transpose(0, 1).unsqueeze(0), new_value.transpose(0, 1).unsqueeze(0)
        if sliding_window is None:
            q = query.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
    else:
        k, v = _gather(kv, plan.ids, 1, plan.num_blocks)
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


def _decode(query: torch.Tensor, kv: torch.Tensor, plan: SdpaPlan, options: AttentionOptions) -> torch.Tensor:
    """A decode group's `[B, H, D]` attention: one gather + SDPA per length bucket of `plan`."""
    parts = plan.buckets()
    if parts:
        out = torch.empty_like(query)
        for rows, sub in parts:
            out.index_copy_(0, rows, _decode(query.index_select(0, rows), kv, sub, options))
        return out
    num_q, num_heads, head_dim = query.shape
    num_kv_heads = kv.shape[3]
    k, v = _gather(kv, plan.ids, num_q, plan.num_blocks)
    # One query position per sequence: the query heads sharing a KV head become that head's query rows
    # (heads h*g .. h*g+g-1 read KV head h), so K/V are never repeated per query head.
    q = query.reshape(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = plan.mask(num_q, options.sliding_window, q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=options.scale_for(head_dim))
    return out.reshape(num_q, num_heads, head_dim)
