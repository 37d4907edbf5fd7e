"""The SDPA fast path equals `pagedkv.ops.paged_attention` (the reference) on the shapes it serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import ops
from pagedkv.hf.sdpa import paged_sdpa, sdpa_supports

BS, NUM_BLOCKS, H, HKV, D = 4, 40, 4, 2, 8


def caches_and_tables(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    v = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    rng = np.random.default_rng(seed)
    width = max(-(-n // BS) for n in lens) + 1
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))[: len(lens) * width].reshape(len(lens), width)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // BS)
        table[i, :used] = torch.from_numpy(ids[i, :used])  # the rest stays on the null block
    return k, v, table


@pytest.mark.parametrize("window", [None, 5])
def test_decode_group(window: int | None) -> None:
    lens = [7, 1, 16, 13]
    k, v, table = caches_and_tables(lens, 0)
    q = torch.randn(len(lens), H, D)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = ops.paged_attention(
        q, k, v, table, seq_lens, cu, scale=0.3, sliding_window=window, backend="reference"
    )
    got = paged_sdpa(
        q,
        torch.stack([k, v]),
        table,
        seq_lens,
        max_seqlen_q=1,
        max_seqlen_k=16,
        scale=0.3,
        sliding_window=window,
    )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("length", "num_q", "window"), [(11, 11, None), (11, 11, 4), (15, 6, None), (15, 6, 3)]
)
def test_prefill_chunk(length: int, num_q: int, window: int | None) -> None:
    k, v, table = caches_and_tables([length], 1)
    q = torch.randn(num_q, H, D)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    cu = torch.tensor([0, num_q], dtype=torch.int32)
    ref = ops.paged_attention(q, k, v, table, seq_lens, cu, sliding_window=window, backend="reference")
    kv = torch.stack([k, v])
    got = paged_sdpa(
        q, kv, table, seq_lens, max_seqlen_q=num_q, max_seqlen_k=length, scale=None, sliding_window=window
    )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if length == num_q:  # no cached context: the chunk's own K/V give the same answer without a gather
        slots = (table[0].long()[:, None] * BS + torch.arange(BS)).reshape(-1)[:length]
        new_k, new_v = k.view(-1, HKV, D)[slots], v.view(-1, HKV, D)[slots]
        direct = paged_sdpa(
            q, kv, table, seq_lens, max_seqlen_q=num_q, max_seqlen_k=length, scale=None,
            sliding_window=window, new_key=new_k, new_value=new_v,
        )  # fmt: skip
        torch.testing.assert_close(direct, ref, atol=1e-5, rtol=1e-5)


def test_shapes_it_declines() -> None:
    assert sdpa_supports(1, 8, None) and sdpa_supports(30, 1, None)
    assert not sdpa_supports(3, 2, None)  # several prefill chunks in one group
    assert not sdpa_supports(1, 8, 50.0)  # soft-cap
