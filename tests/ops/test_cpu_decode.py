"""The C decode kernel (`pagedkv.ops.cpu_decode`) against the reference op, and its refusals."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from pagedkv import ops
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import cpu_decode

if cpu_decode.isa() is None:  # a machine with a C compiler must have built it: fail rather than skip
    if os.environ.get("PAGEDKV_NATIVE", "1") != "0" and (shutil.which("cc") or shutil.which("gcc")):
        pytest.fail("pagedkv.ops._cpu_decode is not built although a C compiler is present", pytrace=False)
    pytest.skip("pagedkv.ops._cpu_decode is not built (no C compiler, or PAGEDKV_NATIVE=0)", allow_module_level=True)


def make_case(
    lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query [B,H,D], kv [2,NB,BS,Hkv,D], block_table [B,W] int32 with shuffled blocks, seq_lens int32)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * width + 1
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    ids = np.random.default_rng(seed).permutation(np.arange(1, num_blocks)).reshape(len(lens), width)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        table[i, :used] = torch.from_numpy(ids[i, :used])
    query = torch.randn(len(lens), heads, dim, generator=gen)
    return query, kv, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(12))
def test_equals_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 3, 4]))
    dim = int(rng.choice([5, 8, 64, 72]))  # tails shorter than the 8 partial sums too
    block_size = int(rng.choice([1, 4, 16]))
    lens = rng.integers(1, 90, size=int(rng.integers(1, 9))).tolist()
    window = [None, 1, 7, 50][seed % 4]
    q, kv, table, seq_lens = make_case(lens, heads, kv_heads, dim, block_size, seed)
    got = cpu_decode.decode_attention(q, kv, table, seq_lens, scale=0.2, sliding_window=window)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = ops.paged_attention(q, kv[0], kv[1], table, seq_lens, cu, scale=0.2, sliding_window=window,
                              backend="reference")  # fmt: skip
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)


def test_reads_each_sequence_through_its_own_table() -> None:
    """Two sequences with the same tokens on different blocks give the same rows; moving one block of the
    second changes only its row."""
    q, kv, table, seq_lens = make_case([20, 20], 4, 2, 8, 4, 0)
    q[1] = q[0]
    kv[:, table[1, :5].long()] = kv[:, table[0, :5].long()]
    out = cpu_decode.decode_attention(q, kv, table, seq_lens, scale=0.3)
    assert torch.equal(out[0], out[1])
    kv[:, table[1, 2].long()] += 1.0
    moved = cpu_decode.decode_attention(q, kv, table, seq_lens, scale=0.3)
    assert torch.equal(moved[0], out[0]) and not torch.equal(moved[1], out[1])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, kv, t, s: (q, kv, t, s.clone().fill_(0)), "seq_lens"),
        (lambda q, kv, t, s: (q, kv, t, s + 100), "seq_lens"),
        (lambda q, kv, t, s: (q, kv, t.clone().fill_(10_000), s), "block_table"),
        (lambda q, kv, t, s: (q, kv, t.clone().fill_(-1), s), "block_table"),
        (lambda q, kv, t, s: (q[:, :3], kv, t, s), "shapes"),  # 3 heads over 2 KV heads
        (lambda q, kv, t, s: (q.double(), kv, t, s), "float32"),
        (lambda q, kv, t, s: (q[:1], kv, t, s), "shapes"),
    ],
)
def test_bad_arguments_raise_one_typed_error(change: object, match: str) -> None:
    q, kv, table, seq_lens = make_case([9, 14], 4, 2, 8, 4, 1)
    args = change(q, kv, table, seq_lens)  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=match):
        cpu_decode.decode_attention(*args, scale=0.5)


def test_takes_a_strided_query_and_applies_only_to_float32_on_one_thread() -> None:
    q, kv, table, seq_lens = make_case([5, 30, 17], 6, 3, 16, 4, 2)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided.is_contiguous()
    a = cpu_decode.decode_attention(q, kv, table, seq_lens, scale=0.25)
    b = cpu_decode.decode_attention(strided, kv, table, seq_lens, scale=0.25)
    assert torch.equal(a, b)
    assert cpu_decode.available(q, kv) == (torch.get_num_threads() == 1)
    assert not cpu_decode.available(q.half(), kv.half())
    assert not cpu_decode.available(q.clone().requires_grad_(), kv)  # no backward: SDPA serves it
    assert cpu_decode.isa() in ("avx2+fma", "generic")
