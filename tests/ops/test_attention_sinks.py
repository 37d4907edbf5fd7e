"""Attention sinks (gpt-oss): a learned logit per query head in the softmax's denominator, no value.

Each path that takes them agrees with the float64 contiguous oracle
(`pagedkv.ops.contiguous_oracle.sdpa_attention`, which appends the sink as one more logit and drops it after
the softmax): the reference op (decode, chunked prefill, query chunks, window, soft cap, GQA), the Triton
kernel under the interpreter (with and without split-K, whose merge adds the sink), and the
paths without them refuse them instead of ignoring them.
"""

from __future__ import annotations

import os

import pytest
import torch
from ops_batch import make_batch, random_lengths

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf.sdpa import sdpa_supports
from pagedkv.ops import cpu_decode, paged_attention
from pagedkv.ops.contiguous_oracle import sdpa_attention
from pagedkv.ops.dispatch import triton_available
from pagedkv.ops.options import AttentionOptions
from pagedkv.ops.plan import plan_attention

CASES = [
    # seed, num_seqs, max_len, max_q, block_size, group, window, soft_cap
    (0, 4, 40, 1, 4, 2, None, None),  # decode, GQA
    (1, 3, 60, 9, 3, 1, None, None),  # chunked prefill, odd block size
    (2, 3, 50, 6, 16, 4, 7, None),  # window
    (3, 2, 30, 5, 8, 2, None, 5.0),  # soft cap
    (4, 2, 700, 600, 16, 2, 50, None),  # several query chunks of the reference
]


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    # spread over a few units, so a sink outweighs some rows' keys and not others'
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(100 + seed)) * 2.0 + 2.0


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c[0]}")
def test_reference_equals_the_oracle(case: tuple) -> None:  # type: ignore[type-arg]
    seed, num_seqs, max_len, max_q, block_size, group, window, cap = case
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    b = make_batch(seed, lens, q_lens, block_size=block_size, group=group)
    sinks = _sinks(b.query.shape[1], seed)
    got = paged_attention(*b.args(), sliding_window=window, soft_cap=cap, sinks=sinks, backend="reference")
    options = AttentionOptions(None, window, cap, sinks)
    want = sdpa_attention(b.query, b.keys, b.values, b.seq_lens, b.cu_seqlens_q, options)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    plain = paged_attention(*b.args(), sliding_window=window, soft_cap=cap, backend="reference")
    assert (got - plain).abs().max() > 1e-3, "the sinks changed nothing: the test cannot see them"


@pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton and TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"case{c[0]}")
def test_triton_equals_the_reference(case: tuple, num_splits: int | None) -> None:  # type: ignore[type-arg]
    seed, num_seqs, max_len, max_q, block_size, group, window, cap = case
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    b = make_batch(seed, lens, q_lens, block_size=block_size, group=group)
    sinks = _sinks(b.query.shape[1], seed)
    want = paged_attention(*b.args(), sliding_window=window, soft_cap=cap, sinks=sinks, backend="reference")
    plan = plan_attention(*b.args(), backend="triton", num_splits=num_splits, max_seqlen_q=max(q_lens))
    got = paged_attention(*b.args(), sliding_window=window, soft_cap=cap, sinks=sinks, plan=plan)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sinks_of_the_wrong_shape_are_one_typed_line() -> None:
    b = make_batch(0, [9, 5], [1, 5], block_size=4)
    for bad in (torch.zeros(3), torch.zeros(4, 1)):
        with pytest.raises(InvalidArgumentError, match="sinks") as info:
            paged_attention(*b.args(), sinks=bad, backend="reference")
        assert "\n" not in str(info.value)


def test_paths_without_sinks_refuse_them() -> None:
    sinks = torch.zeros(4)
    assert not sdpa_supports(1, 3, AttentionOptions(sinks=sinks)), "SDPA would drop the sinks"
    if cpu_decode.isa() is None:
        pytest.skip("pagedkv.ops._cpu_decode is not built")
    q, kv = torch.randn(1, 4, 8), torch.randn(2, 3, 4, 2, 8)
    table, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="sinks"):
        cpu_decode.decode_attention(q, kv, table, lens, AttentionOptions(0.3, sinks=sinks))
