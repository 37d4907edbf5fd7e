"""Quantized KV with one scale per block and KV head (`kv_scales [2, NB, 1, Hkv]`) on every read path and on
`write_kv`.

Each read path over codes and block scales must equal the same path over the dequantized float32 pages
(`code * scale[block]`, the oracle): bit for bit for the reference and the C kernel, to rounding for Triton.
Slots past a sequence's end hold the largest code, and the oracle's pages NaN there, so a path that reads one
is caught; blocks nothing lives in have NaN scales."""

from __future__ import annotations

import os

import pytest
import torch
from ops_batch import Batch, c_kernel_codes_and_pages, make_batch, random_lengths

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import choose_backend, cpu_decode, paged_attention, write_kv
from pagedkv.ops.dispatch import triton_available
from pagedkv.ops.options import AttentionOptions
from pagedkv.storage.block_scales import dequantize_blocks, quantize_blocks
from pagedkv.storage.codes import QUANT_MAX

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# max |block-quantized - full precision| of the attention output over these unit-normal cases: a block's
# scale follows its largest element, so small rows lose more than under per-token scales
FULL_PRECISION_TOLERANCE = {torch.int8: 0.05, torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}
TRITON_TOLERANCE = 2e-5

CASES = [
    # seed, num_seqs, max_len, max_q, block_size, group, window
    (0, 4, 40, 1, 4, 2, None),  # decode, GQA
    (1, 3, 33, 7, 3, 1, None),  # chunked prefill, odd block size (token rows in the reference)
    (2, 3, 50, 5, 16, 4, 9),  # window
    (3, 2, 70, 1, 8, 3, 20),  # decode with window
]


def block_quantized(batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key codes, value codes, kv_scales [2, NB, 1, Hkv], dequantized pages [2, NB, BS, Hkv, D]): the batch's
    blocks quantized whole; slots past the end hold the largest code (NaN in the pages), empty blocks NaN
    scales."""
    live = ~batch.key_cache.isnan().any(dim=-1)  # [NB, BS, Hkv]
    kc, ks = quantize_blocks(batch.key_cache.nan_to_num(0.0), dtype)
    vc, vs = quantize_blocks(batch.value_cache.nan_to_num(0.0), dtype)
    scales = torch.stack([ks, vs]).masked_fill_(~live.any(dim=1, keepdim=True), float("nan")).contiguous()
    largest = torch.tensor([QUANT_MAX[dtype]]).to(dtype).view(torch.uint8)
    for codes in (kc, vc):
        codes.view(torch.uint8)[~live] = largest
    pages = torch.stack([dequantize_blocks(kc, scales[0]), dequantize_blocks(vc, scales[1])])
    return kc, vc, scales, pages.masked_fill_(~live[None, :, :, :, None], float("nan"))


def check_close_to_full_precision(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "a read reached a slot or a block nothing lives in"
    err = float((out - exact).abs().max())
    assert err < FULL_PRECISION_TOLERANCE[dtype], f"{dtype}: {err} from full precision"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c[0]}")
def test_reference_reads_block_scales(case: tuple[int, ...], dtype: torch.dtype) -> None:
    seed, num_seqs, max_len, max_q, block_size, group, window = case
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    batch = make_batch(seed, lens, q_lens, block_size=block_size, group=group, head_dim=16)
    kc, vc, scales, pages = block_quantized(batch, dtype)
    args = (batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    out = paged_attention(batch.query, kc, vc, *args, kv_scales=scales, sliding_window=window, backend="reference")
    oracle = paged_attention(batch.query, pages[0], pages[1], *args, sliding_window=window, backend="reference")
    assert torch.equal(out, oracle), "codes x block scales, tile by tile, differ from the dequantized pages"
    check_close_to_full_precision(out, paged_attention(*batch.args(), sliding_window=window, backend="reference"), dtype)


needs_c = pytest.mark.skipif(cpu_decode.isa() is None, reason="the C decode kernel is not built")


@needs_c
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [16, 64, 13])
def test_c_decode_kernel_reads_block_scales(dtype: torch.dtype, dim: int) -> None:
    lens, _ = random_lengths(7, 5, 90, 1)
    batch = make_batch(7, lens, [1] * 5, block_size=8, group=3, head_dim=dim)
    kc, vc, scales, pages = block_quantized(batch, dtype)
    exact = paged_attention(*batch.args(), backend="reference")
    for isa, window, out, oracle in c_kernel_codes_and_pages(batch, torch.stack([kc, vc]), scales, pages):
        assert torch.equal(out, oracle), f"{isa}: codes x block scales differ from the dequantized pages"
        if window is None:
            check_close_to_full_precision(out, exact, dtype)


@needs_c
def test_c_decode_kernel_refuses_other_scale_shapes() -> None:
    q, codes = torch.zeros(1, 2, 8), torch.zeros(2, 3, 4, 1, 8, dtype=torch.int8)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=r"scales must be \[2, NB, BS or 1, Hkv\]"):
        cpu_decode.decode_attention(q, codes, table, lens, AttentionOptions(), scales=torch.ones(2, 3, 2, 1))


@pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton and TRITON_INTERPRET=1")  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [*CASES, (4, 2, 150, 40, 16, 2, None), (5, 2, 200, 1, 32, 4, None)],
                         ids=lambda c: f"case{c[0]}")  # fmt: skip
def test_triton_reads_block_scales(case: tuple[int, ...], dtype: torch.dtype) -> None:
    seed, num_seqs, max_len, max_q, block_size, group, window = case
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    batch = make_batch(seed, lens, q_lens, block_size=block_size, group=group, head_dim=16)
    kc, vc, scales, pages = block_quantized(batch, dtype)
    args = (batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    oracle = paged_attention(batch.query, pages[0], pages[1], *args, sliding_window=window, backend="reference")
    for max_seqlen_q in (None, max(q_lens)):
        out = paged_attention(batch.query, kc, vc, *args, kv_scales=scales, sliding_window=window, backend="triton",
                              max_seqlen_q=max_seqlen_q)  # fmt: skip
        assert not out.isnan().any(), "a read reached a slot or a block nothing lives in"
        torch.testing.assert_close(out, oracle, atol=TRITON_TOLERANCE, rtol=TRITON_TOLERANCE)


def test_write_kv_with_block_scales_takes_the_reference_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_ATTENTION_BACKEND", raising=False)
    cuda = torch.device("cuda")
    assert choose_backend(cuda, cache_dtype=torch.int8, op="write", scaled=True, block_scales=True) == "reference"
    torch.manual_seed(0)
    kc, scales = torch.zeros(3, 4, 2, 8, dtype=torch.int8), torch.ones(2, 3, 1, 2)
    vc = kc.clone()
    x = torch.randn(2, 4, 2, 8)
    write_kv(kc, vc, x.reshape(8, 2, 8), x.reshape(8, 2, 8), torch.arange(4, 12), kv_scales=scales)
    codes, want = quantize_blocks(x, torch.int8)
    assert torch.equal(kc[1:], codes) and torch.equal(scales[0, 1:], want) and torch.equal(scales[1, 1:], want)
    if triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(InvalidArgumentError, match="per-token kv_scales"):
            write_kv(kc, vc, x[0], x[0], torch.arange(4), kv_scales=scales, backend="triton")
    with pytest.raises(InvalidArgumentError, match="kv_scales must be contiguous float32"):
        write_kv(kc, vc, x[0], x[0], torch.arange(4), kv_scales=torch.ones(2, 3, 2, 2))
