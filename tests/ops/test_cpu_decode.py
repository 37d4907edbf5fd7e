"""The C decode kernel (`pagedkv.ops.cpu_decode`) against the reference op, and its refusals."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from native_policy import require_native

from pagedkv import ops
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import cpu_decode
from pagedkv.ops.options import AttentionOptions

require_native("pagedkv.ops._cpu_decode", cpu_decode.isa() is not None)


ISAS = ["generic"] + (["avx2+fma"] if cpu_decode.isa() == "avx2+fma" else [])


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each compiled copy this machine can run, switched in for the test and back after."""
    before = cpu_decode.isa()
    assert before is not None
    cpu_decode.set_isa(request.param)
    yield request.param
    cpu_decode.set_isa(before)


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


def dense_float64(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention in float64 from the same float32 inputs, one sequence at a time (no window)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv.shape[3]
    for i, n in enumerate(lens.tolist()):
        rows = kv[:, table[i, : -(-n // kv.shape[2])].long()].flatten(1, 2)[:, :n].double()  # [2, n, Hkv, D]
        k, v = rows[0].repeat_interleave(group, dim=1), rows[1].repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", w, v)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_equals_the_reference(seed: int, isa: str) -> None:
    rng = np.random.default_rng(seed)
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 3, 4]))
    dim = int(rng.choice([5, 8, 64, 72]))  # tails shorter than the 8 partial sums too
    block_size = int(rng.choice([1, 4, 16]))
    lens = rng.integers(1, 90, size=int(rng.integers(1, 9))).tolist()
    window = [None, 1, 7, 50][seed % 4]
    q, kv, table, seq_lens = make_case(lens, heads, kv_heads, dim, block_size, seed)
    got = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.2, window))
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = ops.paged_attention(q, kv[0], kv[1], table, seq_lens, cu, scale=0.2, sliding_window=window,
                              backend="reference")  # fmt: skip
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)


def test_wide_score_ranges_match_the_reference(isa: str) -> None:
    """Scores spread over tens to hundreds: many weights fall far below the largest (e^x near and below -88,
    where the vector exp flushes to 0), the rest must still match."""
    q, kv, table, seq_lens = make_case([3, 8, 9, 40, 77], 8, 2, 64, 16, 5)
    cu = torch.arange(6, dtype=torch.int32)
    for scale in (2.0, 5.0, 40.0):
        got = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(scale))
        ref32 = ops.paged_attention(q, kv[0], kv[1], table, seq_lens, cu, scale=scale, backend="reference")
        ref64 = dense_float64(q, kv, table, seq_lens, scale)
        # float32 scores of +-300 carry ~1e-5 of rounding, which e^x amplifies: no closer to the float64 answer
        # than the float32 reference op (with a floor for the well-conditioned cases)
        own, base = (got.double() - ref64).abs().max(), (ref32.double() - ref64).abs().max()
        assert own <= 2 * base + 2e-6, (scale, float(own), float(base))


def test_a_row_depends_only_on_its_own_sequence(isa: str) -> None:
    """Bitwise: a sequence gives the same row alone as in a batch, wherever its blocks are."""
    q, kv, table, seq_lens = make_case([33, 7, 61, 16, 90], 6, 2, 64, 8, 3)
    options = AttentionOptions(0.3, 45)
    batch = cpu_decode.decode_attention(q, kv, table, seq_lens, options)
    for i in range(5):
        alone = cpu_decode.decode_attention(q[i : i + 1], kv, table[i : i + 1], seq_lens[i : i + 1], options)
        assert torch.equal(alone[0], batch[i])


def test_a_nan_key_poisons_only_its_sequence(isa: str) -> None:
    q, kv, table, seq_lens = make_case([20, 20], 4, 2, 64, 4, 4)
    kv[0, table[0, 1].long(), 2, 0, 5] = float("nan")
    out = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.3))
    assert torch.isnan(out[0, :2]).all() and not torch.isnan(out[0, 2:]).any()  # KV head 0 serves heads 0-1
    assert not torch.isnan(out[1]).any()


def test_the_copies_agree() -> None:
    if len(ISAS) == 1:
        pytest.skip("this CPU runs only the generic copy")
    q, kv, table, seq_lens = make_case([1, 9, 64, 100, 17, 8], 12, 4, 128, 16, 6)
    outs = []
    for name in ISAS:
        cpu_decode.set_isa(name)
        outs.append(cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.09, 70)))
    cpu_decode.set_isa(ISAS[-1])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_set_isa_refuses_unknown_copies() -> None:
    with pytest.raises(InvalidArgumentError, match="not a copy"):
        cpu_decode.set_isa("avx512")
    assert cpu_decode.isa() in ISAS


def test_reads_each_sequence_through_its_own_table() -> None:
    """Two sequences with the same tokens on different blocks give the same rows; moving one block of the
    second changes only its row."""
    q, kv, table, seq_lens = make_case([20, 20], 4, 2, 8, 4, 0)
    q[1] = q[0]
    kv[:, table[1, :5].long()] = kv[:, table[0, :5].long()]
    out = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.3))
    assert torch.equal(out[0], out[1])
    kv[:, table[1, 2].long()] += 1.0
    moved = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.3))
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
        cpu_decode.decode_attention(*args, AttentionOptions(0.5))


def test_a_soft_cap_is_refused() -> None:
    q, kv, table, seq_lens = make_case([9, 14], 4, 2, 8, 4, 1)
    with pytest.raises(InvalidArgumentError, match="no soft cap"):
        cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.5, None, 30.0))


def test_takes_a_strided_query_and_applies_only_to_float32() -> None:
    q, kv, table, seq_lens = make_case([5, 30, 17], 6, 3, 16, 4, 2)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided.is_contiguous()
    a = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.25))
    b = cpu_decode.decode_attention(strided, kv, table, seq_lens, AttentionOptions(0.25))
    assert torch.equal(a, b)
    assert cpu_decode.available(q, kv)
    assert not cpu_decode.available(q.half(), kv.half())
    assert not cpu_decode.available(q.clone().requires_grad_(), kv)  # no backward: SDPA serves it
    assert cpu_decode.isa() in ("avx2+fma", "generic")


@pytest.mark.parametrize("threads", [2, 3])
def test_a_group_cut_across_threads_is_bit_identical_to_one_thread(threads: int) -> None:
    lens = [5, 30, 17, 1, 64, 33, 9, 12, 40, 7, 3, 21, 50]
    q, kv, table, seq_lens = make_case(lens, 6, 3, 16, 4, 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.25, 20))
        torch.set_num_threads(threads)
        cut = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.25, 20))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, cut)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OpenMP build is Linux's (setup.py)")
def test_the_linux_build_splits_in_c_on_torchs_own_openmp_runtime() -> None:
    """setup.py builds the kernel with -fopenmp on Linux, and the process then holds one libgomp: torch's."""
    assert cpu_decode._OPENMP
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) == 1, gomps
    assert os.path.dirname(next(iter(gomps))) == os.path.join(os.path.dirname(torch.__file__), "lib")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_openmp_team_size_gives_the_one_thread_answer(dtype: torch.dtype) -> None:
    if not cpu_decode._OPENMP:
        pytest.skip("this build has no OpenMP")
    lens = [5, 30, 17, 1, 64, 33, 9]
    q, kv, table, seq_lens = make_case(lens, 6, 3, 16, 4, 3)
    q, kv = q.to(dtype), kv.to(dtype)
    bf16 = dtype == torch.bfloat16
    kernel = cpu_decode._NATIVE.decode_bf16 if bf16 else cpu_decode._NATIVE.decode
    pages = kv.view(torch.int16).numpy() if bf16 else kv.numpy()
    args = (q.float().contiguous().numpy(), pages, table.numpy(), seq_lens.numpy())
    outs = []
    for team in (1, 2, 3, 7, 50):  # more threads than sequences: one sequence each
        out = np.zeros((len(lens), 6, 16), dtype=np.float32)
        kernel(*args, out, 0.25, 20, team)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kernel(*args, np.zeros((len(lens), 6, 16), dtype=np.float32), 0.25, 20, 0)


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn])
def test_every_openmp_team_size_gives_the_one_thread_answer_over_quantized_pages(code_dtype: torch.dtype) -> None:
    if not cpu_decode._OPENMP:
        pytest.skip("this build has no OpenMP")
    lens = [5, 30, 17, 1, 64, 33, 9]
    q, kv, table, seq_lens = make_case(lens, 6, 3, 16, 4, 4)
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-100, 100, kv.shape, generator=gen, dtype=torch.int8)
    if code_dtype != torch.int8:
        codes = (codes.float() / 16).to(code_dtype)
    scales = torch.rand(kv.shape[:-1], generator=gen) + 0.01
    args = (q.contiguous().numpy(), codes.view(torch.uint8).numpy(), scales.numpy(),
            cpu_decode._lut(code_dtype).numpy(), table.numpy(), seq_lens.numpy())  # fmt: skip
    outs = []
    for team in (1, 2, 3, 7, 50):
        out = np.zeros((len(lens), 6, 16), dtype=np.float32)
        cpu_decode._NATIVE.decode_codes(*args, out, 0.25, 20, cpu_decode._KINDS[code_dtype], team)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        cpu_decode._NATIVE.decode_codes(*args, np.zeros((len(lens), 6, 16), dtype=np.float32), 0.25, 20, 1, 0)


def test_split_rows_covers_every_row_once() -> None:
    seen: list[tuple[int, int]] = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        cpu_decode._split_rows(13, lambda lo, hi: seen.append((lo, hi)))
        assert sorted(seen) == [(0, 4), (4, 8), (8, 13)]
        seen.clear()
        cpu_decode._split_rows(5, lambda lo, hi: seen.append((lo, hi)))  # too few rows to cut
        assert seen == [(0, 5)]
    finally:
        torch.set_num_threads(before)
