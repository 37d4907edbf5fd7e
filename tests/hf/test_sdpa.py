"""The SDPA fast path equals `pagedkv.ops.paged_attention` (the reference) on the shapes it serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import ops
from pagedkv.hf.sdpa import SdpaPlan, decode_buckets, paged_sdpa, sdpa_supports
from pagedkv.ops import cpu_decode
from pagedkv.ops.options import AttentionOptions

BS, NUM_BLOCKS, H, HKV, D = 4, 40, 4, 2, 8


def caches_and_tables(
    lens: list[int], seed: int, num_blocks: int = NUM_BLOCKS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    v = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    rng = np.random.default_rng(seed)
    width = max(-(-n // BS) for n in lens) + 1
    ids = rng.permutation(np.arange(1, num_blocks))[: len(lens) * width].reshape(len(lens), width)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // BS)
        table[i, :used] = torch.from_numpy(ids[i, :used])  # the rest stays on the null block
    return k, v, table


@pytest.mark.parametrize("c_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_group(window: int | None, c_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if c_kernel and cpu_decode.isa() is None:
        pytest.skip("pagedkv.ops._cpu_decode is not built")
    if not c_kernel:
        monkeypatch.setattr(cpu_decode, "available", lambda *_: False)
    lens = [7, 1, 16, 13]
    k, v, table = caches_and_tables(lens, 0)
    q = torch.randn(len(lens), H, D)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = ops.paged_attention(
        q, k, v, table, seq_lens, cu, scale=0.3, sliding_window=window, backend="reference"
    )
    got = paged_sdpa(q, torch.stack([k, v]), SdpaPlan.build(table, seq_lens, 1, 16, BS), AttentionOptions(0.3, window))
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
    plan, options = SdpaPlan.build(table, seq_lens, num_q, length, BS), AttentionOptions(None, window)
    got = paged_sdpa(q, kv, plan, options)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if length == num_q:  # no cached context: the chunk's own K/V give the same answer without a gather
        slots = (table[0].long()[:, None] * BS + torch.arange(BS)).reshape(-1)[:length]
        new_k, new_v = k.view(-1, HKV, D)[slots], v.view(-1, HKV, D)[slots]
        direct = paged_sdpa(q, kv, plan, options, new_key=new_k, new_value=new_v)
        torch.testing.assert_close(direct, ref, atol=1e-5, rtol=1e-5)


def test_shapes_it_declines() -> None:
    none = AttentionOptions()
    assert sdpa_supports(1, 8, none) and sdpa_supports(30, 1, none)
    assert not sdpa_supports(3, 2, none)  # several prefill chunks in one group
    assert not sdpa_supports(1, 8, AttentionOptions(soft_cap=50.0))  # soft-cap


def _brute_force_cost(counts: list[int], call_cost: float) -> float:
    """The cheapest cut of the sorted counts into consecutive buckets, by trying every cut."""
    values = sorted(counts)
    best = float("inf")
    n = len(values)
    for mask in range(1 << max(n - 1, 0)):
        cost, start = 0.0, 0
        for i in range(n):
            if i == n - 1 or mask >> i & 1:
                cost += call_cost + (i + 1 - start) * values[i]
                start = i + 1
        best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_decode_buckets_are_a_cheapest_partition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 30, size=int(rng.integers(1, 11))).tolist()
    call_cost = float(rng.choice([0, 1, 4, 8, 50]))
    buckets = decode_buckets(counts, call_cost)
    rows = np.concatenate(buckets)
    assert sorted(rows.tolist()) == list(range(len(counts)))  # every row exactly once
    assert all((np.diff(b) > 0).all() for b in buckets)  # sorted inside a bucket
    cost = sum(call_cost + len(b) * max(counts[i] for i in b) for b in buckets)
    assert cost == pytest.approx(_brute_force_cost(counts, call_cost))
    if call_cost >= 50 * 30:
        assert len(buckets) == 1


def test_decode_buckets_edge_cases() -> None:
    assert decode_buckets([]) == []
    assert [b.tolist() for b in decode_buckets([3] * 5)] == [[0, 1, 2, 3, 4]]
    assert [b.tolist() for b in decode_buckets([1, 100], call_cost=1)] == [[0], [1]]
    assert [b.tolist() for b in decode_buckets([1, 100], call_cost=1000)] == [[0, 1]]


@pytest.fixture
def sdpa_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode groups take the gather + SDPA path even where the C kernel would serve them."""
    monkeypatch.setattr(cpu_decode, "available", lambda *_: False)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.usefixtures("sdpa_only")
def test_bucketed_decode_equals_the_padded_one(window: int | None, seed: int) -> None:
    """Cutting a decode group by length gives what one padded call gives (to rounding: SDPA's tiling depends on
    the padded length), and what the reference gives."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 40 * BS, size=12).tolist()
    lens[0] = 1
    k, v, table = caches_and_tables(lens, seed, num_blocks=12 * 41 + 1)
    kv = torch.stack([k, v])
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(seed))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    options = AttentionOptions(0.3, window)
    bucketed = SdpaPlan.build(table, seq_lens, 1, max(lens), BS)
    assert len(bucketed.buckets()) > 1, "the lengths should span several buckets"
    padded = SdpaPlan.build(table, seq_lens, 1, max(lens), BS, bucketed=False)
    got = paged_sdpa(q, kv, bucketed, options)
    want = paged_sdpa(q, kv, padded, options)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = ops.paged_attention(q, k, v, table, seq_lens, cu, scale=0.3, sliding_window=window, backend="reference")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
