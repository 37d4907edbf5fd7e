"""Random paged batches for the ops tests: KV written through `write_kv`, unused slots poisoned with NaN."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.ops import write_kv


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    keys: torch.Tensor  # [B, max_len, Hkv, D], the same KV laid out contiguously (zero past each end)
    values: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.cu_seqlens_q)


def make_batch(
    seed: int,
    seq_lens: list[int],
    q_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    shuffle: bool = True,
    spare_blocks: int = 3,
    keys: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    query: torch.Tensor | None = None,
) -> Batch:
    """Sequences of `seq_lens` tokens whose last `q_lens` are queries, in blocks placed at random ids.

    Block 0 is the guard block (table padding points at it); it and every unused slot hold NaN, so a read
    of anything but live KV shows up as NaN in the output. Pass `keys`/`values`/`query` to lay out the same
    data under another block size or placement.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_seqs, max_len = len(seq_lens), max(seq_lens)
    if keys is None or values is None:
        keys = torch.randn(num_seqs, max_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(num_seqs, max_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    if query is None:
        query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    num_live = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(num_live) + spare_blocks
    ids = np.arange(1, num_blocks)
    if shuffle:
        rng.shuffle(ids)
    width = max(num_live) + 1  # one padding column at least
    table = np.zeros((num_seqs, width), dtype=np.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for b, n in enumerate(seq_lens):  # building test data, not a hot path
        table[b, : num_live[b]] = ids[used : used + num_live[b]]
        used += num_live[b]
        pos = np.arange(n)
        slots = torch.from_numpy(table[b, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        write_kv(key_cache, value_cache, keys[b, :n], values[b, :n], slots, backend="reference")
    keys = keys.clone()
    values = values.clone()
    for b, n in enumerate(seq_lens):
        keys[b, n:] = 0
        values[b, n:] = 0
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return Batch(
        query, key_cache, value_cache, torch.from_numpy(table), torch.tensor(seq_lens, dtype=torch.int32), cu, keys, values
    )


def random_lengths(seed: int, num_seqs: int, max_len: int, max_q: int) -> tuple[list[int], list[int]]:
    """Sequence lengths in [1, max_len] and query counts in [1, min(len, max_q)] (decode when max_q == 1)."""
    rng = np.random.default_rng(seed + 1000)
    lens = rng.integers(1, max_len + 1, size=num_seqs)
    q_lens = np.minimum(lens, rng.integers(1, max_q + 1, size=num_seqs))
    return [int(x) for x in lens], [int(x) for x in q_lens]


def c_kernel_codes_and_pages(
    batch: Batch, codes: torch.Tensor, scales: torch.Tensor, pages: torch.Tensor
) -> Iterator[tuple[str, int | None, torch.Tensor, torch.Tensor]]:
    """The C decode kernel over quantized `codes` with their `scales`, and over `pages` (the same KV
    dequantized), for each copy of the kernel this CPU runs and windows None and 17: yields (copy, window,
    output over codes, output over pages). The kernel copy in use is put back afterwards."""
    from pagedkv.ops import cpu_decode
    from pagedkv.ops.options import AttentionOptions

    before = cpu_decode.isa()
    assert before is not None
    isas = ["generic"] + (["avx2+fma"] if before == "avx2+fma" else [])
    try:
        for isa in isas:
            cpu_decode.set_isa(isa)
            for window in (None, 17):
                options = AttentionOptions(None, window)
                args = (batch.block_table, batch.seq_lens, options)
                out = cpu_decode.decode_attention(batch.query, codes, *args, scales=scales)
                yield isa, window, out, cpu_decode.decode_attention(batch.query, pages, *args)
    finally:
        cpu_decode.set_isa(before)
