"""Paged attention (reference path) against attention over the same KV laid out contiguously.

Two claims, tested exactly as docs/attention.md states them:
- vs torch SDPA over the gathered contiguous KV: equal within TOLERANCE[dtype] (another summation order);
- vs the same reference over a contiguous layout (any block size, blocks in order): bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from ops_batch import make_batch, random_lengths

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import paged_attention
from pagedkv.ops.contiguous_oracle import gather_kv, sdpa_attention
from pagedkv.ops.options import AttentionOptions

# (atol, rtol) of paged reference vs contiguous SDPA, per dtype (outputs are O(1) for randn inputs).
TOLERANCE = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _oracle(batch, **kwargs):  # type: ignore[no-untyped-def]
    options = AttentionOptions(**kwargs)
    return sdpa_attention(batch.query, batch.keys, batch.values, batch.seq_lens, batch.cu_seqlens_q, options)


CASES = [
    # seed, num_seqs, max_len, max_q, block_size, num_kv_heads, group, window, soft_cap, dtype
    (0, 1, 1, 1, 1, 1, 1, None, None, torch.float32),
    (1, 5, 40, 1, 16, 2, 4, None, None, torch.float32),  # decode, GQA
    (2, 4, 70, 9, 3, 2, 1, None, None, torch.float32),  # chunked prefill + decode, odd block size
    (3, 3, 50, 50, 7, 1, 8, None, None, torch.float32),  # MQA, full prefills
    (4, 6, 90, 5, 16, 2, 2, 13, None, torch.float32),  # sliding window
    (5, 4, 60, 6, 5, 2, 2, None, 5.0, torch.float32),  # soft cap
    (6, 3, 300, 4, 256, 2, 2, 40, 30.0, torch.float32),  # block size 256, window + cap
    (7, 8, 64, 1, 1, 4, 1, None, None, torch.float32),  # block size 1
    (8, 5, 80, 6, 16, 2, 4, None, None, torch.float16),
    (9, 5, 80, 6, 8, 2, 4, 17, None, torch.bfloat16),
    (10, 17, 200, 1, 32, 2, 4, None, None, torch.bfloat16),
    (11, 2, 400, 300, 16, 2, 4, None, None, torch.float32),  # long prefills: several query chunks
    (12, 3, 600, 600, 5, 2, 2, 50, None, torch.float32),  # query chunks + window
    (13, 4, 500, 400, 3, 1, 1, None, 10.0, torch.float16),  # 512-row chunks, soft cap
]


@pytest.mark.parametrize("seed,num_seqs,max_len,max_q,block_size,num_kv_heads,group,window,cap,dtype", CASES)
def test_matches_contiguous_sdpa(seed, num_seqs, max_len, max_q, block_size, num_kv_heads, group, window, cap, dtype):  # type: ignore[no-untyped-def]
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    batch = make_batch(seed, lens, q_lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group, dtype=dtype)
    out = paged_attention(*batch.args(), sliding_window=window, soft_cap=cap, backend="reference")
    expected = _oracle(batch, sliding_window=window, soft_cap=cap)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert not out.isnan().any(), "a poisoned (unwritten) slot or padding entry was read"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_sdpa(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pick = lambda choices: choices[int(torch.randint(len(choices), (), generator=gen))]  # noqa: E731
    lens, q_lens = random_lengths(seed, pick([1, 2, 7, 16]), pick([8, 33, 129]), pick([1, 1, 4, 33]))
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    window = pick([None, None, 1, 9, 64])
    batch = make_batch(seed, lens, q_lens, block_size=pick([1, 2, 5, 16, 32]), group=pick([1, 2, 3]), dtype=dtype)
    out = paged_attention(*batch.args(), sliding_window=window, backend="reference")
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, _oracle(batch, sliding_window=window), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_q,window", [(1, None), (7, None), (5, 11), (300, None), (280, 30)])
def test_bit_identical_across_block_sizes_and_placements(dtype: torch.dtype, max_q: int, window: int | None) -> None:
    lens, q_lens = random_lengths(11, 6, 150, max_q)
    lens[0], q_lens[0] = max_q + 20, max_q  # long enough to span several query chunks
    base = make_batch(11, lens, q_lens, block_size=16, dtype=dtype, shuffle=False)
    reference = paged_attention(*base.args(), sliding_window=window, backend="reference")
    for block_size in (1, 3, 16, 64, 256):
        for shuffle in (False, True):
            other = make_batch(
                11, lens, q_lens, block_size=block_size, dtype=dtype, shuffle=shuffle,
                keys=base.keys, values=base.values, query=base.query,
            )
            out = paged_attention(*other.args(), sliding_window=window, backend="reference")
            assert torch.equal(out, reference), f"block_size={block_size} shuffle={shuffle} changed the bits"


def test_padding_entries_and_guard_block_are_never_read() -> None:
    lens, q_lens = [5, 37, 16], [1, 3, 16]
    batch = make_batch(3, lens, q_lens, block_size=4)
    table = batch.block_table.clone()
    live = (torch.tensor(lens) + 3) // 4
    table[torch.arange(table.shape[1])[None, :] >= live[:, None]] = 10**6  # garbage past each table's end
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, table, batch.seq_lens, batch.cu_seqlens_q)
    torch.testing.assert_close(out, _oracle(batch), atol=2e-6, rtol=2e-6)


def test_cached_prefix_plus_chunk_equals_full_prefill_rows() -> None:
    # A chunked prefill of the last 5 tokens equals the last 5 rows of the full prefill.
    full = make_batch(4, [29], [29], block_size=4)
    chunk = make_batch(4, [29], [5], block_size=4, keys=full.keys, values=full.values, query=full.query[-5:])
    out_full = paged_attention(*full.args())
    out_chunk = paged_attention(*chunk.args())
    torch.testing.assert_close(out_chunk, out_full[-5:], atol=2e-6, rtol=2e-6)


def test_scale_defaults_to_inverse_sqrt_head_dim() -> None:
    batch = make_batch(5, [9, 4], [2, 1], block_size=4)
    default = paged_attention(*batch.args())
    explicit = paged_attention(*batch.args(), scale=8**-0.5)
    assert torch.equal(default, explicit), "default scale must be 1/sqrt(head_dim)"
    assert not torch.equal(default, paged_attention(*batch.args(), scale=0.1)), "scale must change the output"


def test_gather_kv_is_exact() -> None:
    batch = make_batch(6, [13, 1, 40], [1, 1, 1], block_size=8, dtype=torch.bfloat16)
    keys, values = gather_kv(batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens)
    assert torch.equal(keys, batch.keys) and torch.equal(values, batch.values)


def _bad(batch, **changes):  # type: ignore[no-untyped-def]
    args = dict(zip(["query", "key_cache", "value_cache", "block_table", "seq_lens", "cu_seqlens_q"], batch.args()))
    args.update(changes)
    return paged_attention(**args, backend="reference")


def test_bad_metadata_gets_clear_errors() -> None:
    batch = make_batch(7, [10, 20], [1, 1], block_size=4)
    table = batch.block_table.clone()
    table[1, 2] = batch.key_cache.shape[0]
    with pytest.raises(InvalidArgumentError, match=r"block_table\[1, 2\].*not a block id"):
        _bad(batch, block_table=table)
    table[1, 2] = -1
    with pytest.raises(InvalidArgumentError, match="not a block id"):
        _bad(batch, block_table=table)
    with pytest.raises(InvalidArgumentError, match=r"seq_lens\[1\] = 99 is longer than its block table"):
        _bad(batch, seq_lens=torch.tensor([10, 99], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="more queries than tokens"):
        _bad(batch, seq_lens=torch.tensor([10, 20], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 11, 12], dtype=torch.int32), query=torch.randn(12, 4, 8))
    with pytest.raises(InvalidArgumentError, match="cu_seqlens_q must start at 0"):
        _bad(batch, cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        _bad(batch, seq_lens=torch.tensor([0, 20], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 0, 2], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="multiple of num_kv_heads"):
        _bad(batch, query=torch.randn(2, 3, 8))
    with pytest.raises(InvalidArgumentError, match="int32"):
        _bad(batch, block_table=batch.block_table.float())
    with pytest.raises(InvalidArgumentError, match="B, B and B\\+1"):
        _bad(batch, seq_lens=torch.tensor([10], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        paged_attention(*batch.args(), sliding_window=0)
    with pytest.raises(InvalidArgumentError, match="soft_cap"):
        paged_attention(*batch.args(), soft_cap=-1.0)


def test_sequence_without_queries_is_skipped() -> None:
    batch = make_batch(8, [12, 30, 7], [2, 0, 1], block_size=4)
    out = paged_attention(*batch.args())
    assert out.shape == (3, 4, 8)
    torch.testing.assert_close(out, _oracle(batch), atol=2e-6, rtol=2e-6)
