"""Reference paged attention (any torch device): the oracle the Triton kernels are tested against.

One variable-length call serves decode, prefill and chunked prefill. Sequence b has `seq_lens[b]` tokens of
KV already written; its queries are its LAST `q_len[b] = cu[b+1] - cu[b]` tokens:

    positions   0 ...................... L-q_len ........ L-1      (L = seq_lens[b])
    keys        [ cached tokens          | new tokens (queries) ]
    query at position p sees keys k with  k <= p  and (no window or k > p - sliding_window)

How it runs (no Python loop over sequences): queries are padded to `[B, max_q]` and grouped per KV head
(`[num_kv_heads, B, max_q * group, head_dim]`, so a KV head is read once for all its query heads); the keys
are walked in tiles of `tile` token positions shared by the whole batch. Each tile gathers the K/V of every
sequence's positions (whole blocks when `block_size` divides the tile, else token slots `block_table[b,
pos // block_size] * block_size + pos % block_size`) into a small `[B, tile, Hkv, D]` buffer that stays in
cache, and folds it into a float32 online softmax with one batched matmul per KV head over a strided view
(cheaper than permuting the tile). Prefill queries go in chunks of `_CHUNK_ROWS` rows; a chunk visits only
the tiles its rows can see, and tiles wholly below the diagonal skip masking. Only positions below the
longest sequence (and, with a window, not below the earliest visible key) are visited; positions past a
shorter sequence's end are clamped to its own last block (table entries beyond `seq_lens` are never read),
masked, and their V rows zeroed.

Attention sinks (`AttentionOptions.sinks`, gpt-oss): after a query chunk's last tile each row's denominator
gains exp(sink - m), m the row's running max that the denominator is relative to; the output gains nothing.

Numerics: float32 throughout (half inputs are upcast after the gather), output cast to the query dtype.
Exponents are floored at -87 (weight 1.6e-38 instead of 0 for masked keys: below float32 resolution next
to the row max's weight 1, and it keeps CPU exp off its slow denormal path). The tile width and the query
chunks depend only on the metadata (batch size, heads, head_dim, query and sequence lengths), never on the
block size or block ids, and the gather is an exact copy, so the result is bit-identical for any block size and any placement of the blocks,
including a contiguous one. It agrees with torch SDPA on the same contiguous KV to rounding only (a tiled
online softmax sums in another order); docs/attention.md states the tolerances the tests enforce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.storage.codes import FP8_DTYPES

if TYPE_CHECKING:
    from pagedkv.ops.options import AttentionOptions
    from pagedkv.ops.plan import AttentionPlan

# Tile sizing: ~12 MiB of float32 work per tile keeps the gathered K/V and the scores in the L3 of a CPU
# while each matmul stays large enough to amortise its call (measured at batch 32 / context 2048).
_TILE_BYTES = 12 << 20
_MIN_TILE, _MAX_TILE = 16, 512
# Query rows (query tokens x group) per chunk of a prefill, summed over the batch: enough for efficient
# matmuls, few enough that causal skipping pays off.
_CHUNK_ROWS = 512
_MIN_CHUNK_ROWS = 64
# A finite "minus infinity" for masked scores: a row whose keys are all masked stays finite (no NaN), and
# the rescale factor exp(-1e30 - m) of a real max m is exactly 0, which erases anything a fully masked tile
# added before the row saw its first visible key.
_MASKED = -1e30
_EXP_FLOOR = -87.0


def tile_width(num_seqs: int, num_kv_heads: int, head_dim: int, rows_per_head: int) -> int:
    """Token positions per tile: a power of two in [16, 512] sized to ~12 MiB of float32 K, V and scores."""
    per_token = 4 * num_seqs * num_kv_heads * (2 * head_dim + rows_per_head)
    width = _MIN_TILE
    while width * 2 <= _MAX_TILE and per_token * width * 2 <= _TILE_BYTES:
        width *= 2
    return width


def _pow2_at_least(n: int) -> int:
    width = _MIN_TILE
    while width < n:
        width *= 2
    return width


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    options: AttentionOptions,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed `query [num_q_tokens, H, D]` over paged KV through the step's `plan` (block table,
    lengths, query layout, validated by `plan_attention`); see the module docstring. `k_scale`/`v_scale`: fp8
    caches' per-tensor scales; `kv_scales` (`[2, num_blocks, block_size or 1, Hkv]`): int8/fp8 caches' scale
    per token or per block and KV head, applied to each gathered tile as it is read."""
    block_table, seq_lens, cu_seqlens_q = plan.block_table, plan.seq_lens, plan.cu_seqlens_q
    max_seqlen_q, sliding_window = plan.max_seqlen_q, options.sliding_window
    (num_q_tokens, num_heads, head_dim), num_kv_heads = query.shape, key_cache.shape[2]
    group, num_seqs = num_heads // num_kv_heads, block_table.shape[0]
    out = torch.empty_like(query)
    if num_seqs == 0 or num_q_tokens == 0:
        return out

    lens = seq_lens.long()
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    max_q = int(q_lens.max()) if max_seqlen_q is None else max_seqlen_q
    is_decode = max_q == 1 and num_q_tokens == num_seqs
    # 1. queries grouped per KV head, with the absolute position of every query row
    scale = options.scale_for(head_dim)
    q, token_seq, token_idx = _grouped_queries(query, cu, q_lens, max_q, num_kv_heads, scale, is_decode)
    first_q = lens - q_lens  # position of each sequence's first query
    q_pos = first_q[:, None] + torch.arange(max_q, device=query.device)[None, :]
    row_pos = q_pos.repeat_interleave(group, dim=1)[:, :, None]  # [B, rows, 1] (row r is query r // group)
    # 2. the key tiles and the chunks of queries that visit them
    q_chunk = max(1, max(_CHUNK_ROWS // num_seqs, _MIN_CHUNK_ROWS) // group)
    grid = _TileGrid.plan(
        key_cache, value_cache, block_table, lens, first_q, max_q, min(max_q, q_chunk) * group, sliding_window
    )
    # 3. each chunk's online softmax over the tiles it can see
    gather, k_heads, v_heads, v_tile = grid.buffers(key_cache, k_scale, v_scale, kv_scales)
    result = torch.empty((num_kv_heads, num_seqs, max_q * group, head_dim), device=query.device)
    sinks = _sink_rows(options.sinks, num_kv_heads, max_q)
    for i0 in range(0, max_q, q_chunk):
        i1 = min(max_q, i0 + q_chunk)
        r0, r1 = i0 * group, i1 * group
        acc, denom, m = _attend_chunk(
            grid, q[:, :, r0:r1], row_pos[:, r0:r1], i0, i1, gather, k_heads, v_heads, v_tile, options.soft_cap
        )
        if sinks is not None:  # the sink's weight joins the denominator (relative to the row's max, as denom)
            denom.add_(torch.exp(sinks[:, :, r0:r1] - m))
        torch.div(acc, denom, out=result[:, :, r0:r1])
    # 4. back to packed [num_q_tokens, H, D]
    result = result.view(num_kv_heads, num_seqs, max_q, group, head_dim).permute(1, 2, 0, 3, 4)
    result = result.reshape(num_seqs, max_q, num_heads, head_dim)
    if is_decode:
        out.copy_(result.view(num_seqs, num_heads, head_dim))
    else:
        out.copy_(result[token_seq, token_idx])
    return out


def _grouped_queries(
    query: torch.Tensor,
    cu: torch.Tensor,
    q_lens: torch.Tensor,
    max_q: int,
    num_kv_heads: int,
    scale: float,
    is_decode: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Queries padded to [B, max_q, H, D], then grouped per KV head: float32 `[Hkv, B, max_q * group, D]`
    scaled by `scale`; with each packed token's (sequence, index) for the way back (None for a decode)."""
    num_q_tokens, num_heads, head_dim = query.shape
    num_seqs = q_lens.shape[0]
    group = num_heads // num_kv_heads
    device = query.device
    if is_decode:
        q_pad = query.reshape(num_seqs, 1, num_heads, head_dim)
        token_seq = token_idx = None
    else:
        token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_q_tokens)
        token_idx = torch.arange(num_q_tokens, device=device) - cu[token_seq]
        q_pad = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q_pad[token_seq, token_idx] = query
    q = q_pad.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads, num_seqs, max_q * group, head_dim).float() * scale  # KV-head major
    return q, token_seq, token_idx


def _sink_rows(sinks: torch.Tensor | None, num_kv_heads: int, max_q: int) -> torch.Tensor | None:
    """Each query row's sink logit, float32 `[Hkv, 1, max_q * group, 1]` in the grouped row order (row r of KV
    head h is query r // group of head h * group + r % group); None without sinks."""
    if sinks is None:
        return None
    group = sinks.shape[0] // num_kv_heads
    rows = sinks.float().view(num_kv_heads, 1, 1, group).expand(num_kv_heads, 1, max_q, group)
    return rows.reshape(num_kv_heads, 1, max_q * group, 1)


@dataclass(frozen=True)
class _TileGrid:
    """The key positions a call visits: `num_tiles` tiles of `tile` positions on a grid starting at `lo`
    (the last one padded, its extra positions masked), so tile shapes and hence reduction orders depend only
    on the metadata, never on the block size or the block ids. `gather_ids[:, i * per_tile:(i + 1) *
    per_tile]` are tile i's rows of `k_rows`/`v_rows` (block rows or token rows)."""

    tile: int
    lo: int
    hi: int
    min_len: int
    min_first_q: int
    max_first_q: int
    lens: torch.Tensor
    sliding_window: int | None
    gather_ids: torch.Tensor
    per_tile: int
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    num_seqs: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def plan(
        cls,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        lens: torch.Tensor,
        first_q: torch.Tensor,
        max_q: int,
        rows_per_head: int,
        sliding_window: int | None,
    ) -> _TileGrid:
        # Queries go in chunks of padded query indices; a chunk visits only the key tiles its rows can see
        # (nothing past its last row, nothing before its first row's window) and tiles wholly below the
        # diagonal skip masking. A decode step is a single chunk.
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        num_seqs = block_table.shape[0]
        device = key_cache.device
        hi = int(lens.max())
        tile = min(tile_width(num_seqs, num_kv_heads, head_dim, rows_per_head), _pow2_at_least(hi))
        min_first_q = int(first_q.min())
        lo = 0
        if sliding_window is not None:
            lo = max(0, min_first_q - sliding_window + 1) // tile * tile
        num_tiles = -(-(hi - lo) // tile)
        span = num_tiles * tile
        table = block_table.long()
        if tile % block_size == 0:
            # Whole blocks per tile: gather block rows (large copies). Columns past a sequence's last live
            # block are clamped to it, so padding entries of the table are never read.
            cols = torch.arange(lo // block_size, (lo + span) // block_size, device=device)
            last_block = (lens + block_size - 1) // block_size - 1
            gather_ids = table.gather(1, torch.minimum(cols[None, :], last_block[:, None]))
            per_tile = tile // block_size
            k_rows = key_cache.view(-1, block_size * num_kv_heads, head_dim)
            v_rows = value_cache.view(-1, block_size * num_kv_heads, head_dim)
        else:
            # Token rows: slots of every visited position, clamped to the sequence's last token.
            positions = torch.arange(lo, lo + span, device=device)
            clamped = torch.minimum(positions[None, :], lens[:, None] - 1)
            gather_ids = table.gather(1, clamped // block_size) * block_size + clamped % block_size
            per_tile = tile
            k_rows = key_cache.view(-1, num_kv_heads, head_dim)
            v_rows = value_cache.view(-1, num_kv_heads, head_dim)
        return cls(
            tile=tile, lo=lo, hi=hi, min_len=int(lens.min()), min_first_q=min_first_q,
            max_first_q=int(first_q.max()), lens=lens, sliding_window=sliding_window, gather_ids=gather_ids,
            per_tile=per_tile, k_rows=k_rows, v_rows=v_rows, num_seqs=num_seqs, num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )  # fmt: skip

    def buffers(
        self, key_cache: torch.Tensor, k_scale: float, v_scale: float, kv_scales: torch.Tensor | None = None
    ) -> tuple[_TileGather, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Gather buffers, reused by every tile, and per-KV-head strided views of them made once."""
        is_fp8 = key_cache.dtype in FP8_DTYPES
        device = key_cache.device
        k_tile = torch.empty((self.num_seqs, self.tile, self.num_kv_heads, self.head_dim), device=device)
        v_tile = torch.empty_like(k_tile)
        k_heads = [k_tile[:, :, h].transpose(1, 2) for h in range(self.num_kv_heads)]
        v_heads = [v_tile[:, :, h] for h in range(self.num_kv_heads)]
        gather = _TileGather(self.k_rows, self.v_rows, k_tile, v_tile, is_fp8, k_scale, v_scale)
        if kv_scales is not None:
            gather.add_scales(kv_scales, self.tile // self.per_tile, key_cache.shape[1])
        return gather, k_heads, v_heads, v_tile


def _mask_tile(
    grid: _TileGrid,
    start: int,
    chunk_first: int,
    chunk_last: int,
    pos_c: torch.Tensor,
    s: torch.Tensor,
    v_tile: torch.Tensor,
) -> None:
    """Zero the V rows past each sequence's end and hide the scores a row may not see (after it, or outside
    its window) in the tile of positions [start, start + tile); tiles wholly below the diagonal and inside
    every window skip the score mask."""
    tile, sliding_window, device = grid.tile, grid.sliding_window, s.device
    last = start + tile - 1
    if last >= grid.min_len:
        # Positions past a sequence's end (the unwritten tail of its last block, or clamped
        # repeats) get zero weight, but 0 * NaN/Inf stale bytes would still poison the sum.
        past_end = torch.arange(start, start + tile, device=device)[None, :] >= grid.lens[:, None]
        v_tile.masked_fill_(past_end[:, :, None, None], 0.0)
    below_diagonal = last <= chunk_first
    inside_window = sliding_window is None or start > chunk_last - sliding_window
    if not (below_diagonal and inside_window):
        key_pos = torch.arange(start, start + tile, device=device)
        hidden = key_pos > pos_c
        if sliding_window is not None:
            hidden |= key_pos <= pos_c - sliding_window
        s.masked_fill_(hidden, _MASKED)


def _attend_chunk(
    grid: _TileGrid,
    q_chunk: torch.Tensor,
    pos_c: torch.Tensor,
    i0: int,
    i1: int,
    gather: _TileGather,
    k_heads: list[torch.Tensor],
    v_heads: list[torch.Tensor],
    v_tile: torch.Tensor,
    soft_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of the padded queries i0..i1 (`q_chunk [Hkv, B, chunk rows, D]`, row positions
    `pos_c`) over the tiles they can see: (unnormalised output, softmax denominator, the row maxima both are
    relative to)."""
    tile, lo, sliding_window = grid.tile, grid.lo, grid.sliding_window
    num_kv_heads = grid.num_kv_heads
    device = q_chunk.device
    chunk_first, chunk_last = grid.min_first_q + i0, grid.max_first_q + i1 - 1  # extreme row positions
    first_tile = 0
    if sliding_window is not None:
        first_tile = (max(0, chunk_first - sliding_window + 1) - lo) // tile
    last_tile = -(-(min(grid.hi, chunk_last + 1) - lo) // tile)
    q_heads = [q_chunk[h] for h in range(num_kv_heads)]

    # Online-softmax state, KV-head major: [Hkv, B, chunk rows, 1 | D]. Each tile's K/V stays in the
    # cache's natural [B, tile, Hkv, D] order and every KV head is one batched matmul over a strided
    # view of it, which costs less than permuting the tile to head-major first.
    state = q_chunk.shape[:3]
    m = torch.full((*state, 1), -math.inf, device=device)
    denom = torch.zeros((*state, 1), device=device)
    acc = torch.zeros((*state, grid.head_dim), device=device)
    pv = torch.empty((*state, grid.head_dim), device=device)
    s = torch.empty((*state, tile), device=device)
    for i in range(max(first_tile, 0), last_tile):
        start = lo + i * tile
        gather(grid.gather_ids[:, i * grid.per_tile : (i + 1) * grid.per_tile].reshape(-1))
        for h in range(num_kv_heads):
            torch.bmm(q_heads[h], k_heads[h], out=s[h])
        if soft_cap is not None:
            s.div_(soft_cap).tanh_().mul_(soft_cap)
        _mask_tile(grid, start, chunk_first, chunk_last, pos_c, s, v_tile)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        # exp of inputs below ~-87 (masked scores, far-off keys) lands in denormals or -inf, which
        # CPU vector exp handles ~30x slower; exp(-87) = 1.6e-38 weighs nothing next to the row max's 1.
        p = s.sub_(m_new).clamp_(min=_EXP_FLOOR).exp_()
        denom.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        for h in range(num_kv_heads):
            torch.bmm(p[h], v_heads[h], out=pv[h])
        acc.mul_(alpha).add_(pv)
        m = m_new
    return acc, denom, m


class _TileGather:
    """Gathers one tile's K and V rows (token rows `[num_slots, Hkv, D]` or block rows `[num_blocks,
    bs * Hkv, D]`) into the float32 `[B, tile, Hkv, D]` buffers, dequantizing int8/fp8 (codes times a scale
    per tensor, or per token or block and KV head with `add_scales`) and upcasting halves."""

    def __init__(
        self,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        k_tile: torch.Tensor,
        v_tile: torch.Tensor,
        is_fp8: bool,
        k_scale: float,
        v_scale: float,
    ) -> None:
        self.is_fp8 = is_fp8
        self.code_dtype = k_rows.dtype
        self.jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
        self.scale_jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.scale_id_divisor = 1
        for rows, tile, scale in ((k_rows, k_tile, k_scale), (v_rows, v_tile, v_scale)):
            src = rows.view(torch.uint8) if is_fp8 else rows  # fp8 lacks an index_select kernel on CPU
            # float32 caches gather straight into the tile; other dtypes into a raw buffer, then cast.
            raw = tile if src.dtype == torch.float32 else torch.empty(tile.shape, dtype=src.dtype, device=tile.device)
            self.jobs.append((src, raw, raw.view(-1, *src.shape[1:]), tile, scale if is_fp8 else 1.0))

    def add_scales(self, kv_scales: torch.Tensor, tokens_per_id: int, block_size: int) -> None:
        """The sidecar `kv_scales` `[2, num_blocks, block_size or 1, Hkv]` (per-token or per-block scales),
        applied per tile; a gather id covers `tokens_per_id` tokens (block_size for block rows, 1 for token
        rows). Per-token scale rows line up with the K/V rows; a block's one scale row is found from a token
        row's slot (id // block_size) and broadcast over the block's tokens."""
        self.jobs = [(src, raw, raw_rows, tile, 1.0) for src, raw, raw_rows, tile, _ in self.jobs]
        num_blocks, per_block, num_kv_heads = kv_scales.shape[1:]
        for sidecar, (_, _, _, tile, _) in zip(kv_scales, self.jobs, strict=True):
            num_seqs, width = tile.shape[:2]
            if per_block == block_size:  # [rows, bs * Hkv] (block rows) or [rows, Hkv] (token rows)
                rows = sidecar.view(-1, tokens_per_id * num_kv_heads)
                buf = torch.empty(tile.shape[:3], device=tile.device)
                self.scale_jobs.append((rows, buf.view(-1, rows.shape[1]), buf.unsqueeze(-1), tile))
            else:  # one scale per block: [num_blocks, Hkv], one row per gather id
                self.scale_id_divisor = block_size // tokens_per_id
                ids_per_seq = width // tokens_per_id
                buf = torch.empty((num_seqs * ids_per_seq, num_kv_heads), device=tile.device)
                by_id = tile.view(num_seqs, ids_per_seq, tokens_per_id, num_kv_heads, -1)
                factor = buf.view(num_seqs, ids_per_seq, 1, num_kv_heads, 1)
                self.scale_jobs.append((sidecar.view(num_blocks, num_kv_heads), buf, factor, by_id))

    def __call__(self, ids: torch.Tensor) -> None:
        for src, raw, raw_rows, tile, scale in self.jobs:
            torch.index_select(src, 0, ids, out=raw_rows)
            if self.is_fp8:
                tile.copy_(raw.view(self.code_dtype))
            elif raw is not tile:
                tile.copy_(raw)
            if scale != 1.0:
                tile.mul_(scale)
        if self.scale_jobs and self.scale_id_divisor > 1:
            ids = torch.div(ids, self.scale_id_divisor, rounding_mode="floor")
        for rows, buf_rows, factor, tile in self.scale_jobs:
            torch.index_select(rows, 0, ids, out=buf_rows)
            tile.mul_(factor)
