"""Quantized KV (int8, fp8 e4m3/e5m2 codes with a per-token-per-head scale sidecar) on every read path.

Each path reads the codes and scales in place and must equal the same path over the dequantized float32
pages (`codes * scale`, the oracle), and stay within the dtype's tolerance of full-precision KV. Unwritten
slots carry NaN scales, so a path that reads past a sequence's end shows NaN."""

from __future__ import annotations

import os

import pytest
import torch
from ops_batch import Batch, c_kernel_codes_and_pages, make_batch, random_lengths

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import cpu_decode, paged_attention, write_kv
from pagedkv.ops.dispatch import triton_available
from pagedkv.ops.options import AttentionOptions
from pagedkv.storage.slots import dequantize_rows, quantize_rows

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# max |quantized - full precision| of the attention output over these unit-normal cases (docs/attention.md)
FULL_PRECISION_TOLERANCE = {torch.int8: 0.03, torch.float8_e4m3fn: 0.12, torch.float8_e5m2: 0.25}
# max |path over codes - same path over the dequantized float32 pages|
ORACLE_TOLERANCE = 2e-5


def quantized(batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key codes, value codes, kv_scales [2, NB, BS, Hkv], dequantized K/V pages [2, NB, BS, Hkv, D]) of the
    batch's float32 pages; unwritten slots get NaN scales (their codes are 0)."""
    live = ~batch.key_cache.isnan().any(dim=-1)  # [NB, BS, Hkv]
    kc, ks = quantize_rows(batch.key_cache.nan_to_num(0.0), dtype)
    vc, vs = quantize_rows(batch.value_cache.nan_to_num(0.0), dtype)
    scales = torch.stack([ks, vs]).masked_fill_(~live, float("nan")).contiguous()
    pages = torch.stack([dequantize_rows(kc, scales[0]), dequantize_rows(vc, scales[1])])
    return kc, vc, scales, pages


def check(out: torch.Tensor, oracle: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "a read reached an unwritten slot (NaN scale)"
    torch.testing.assert_close(out, oracle, atol=ORACLE_TOLERANCE, rtol=ORACLE_TOLERANCE)
    err = float((out - exact).abs().max())
    assert err < FULL_PRECISION_TOLERANCE[dtype], f"{dtype}: {err} from full precision"


CASES = [
    # seed, num_seqs, max_len, max_q, block_size, group, window
    (0, 4, 40, 1, 4, 2, None),  # decode, GQA
    (1, 3, 33, 7, 3, 1, None),  # chunked prefill, odd block size
    (2, 3, 50, 5, 16, 4, 9),  # window
    (3, 2, 70, 1, 8, 3, 20),  # decode with window
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c[0]}")
def test_reference_reads_codes_and_scales(case: tuple[int, ...], dtype: torch.dtype) -> None:
    seed, num_seqs, max_len, max_q, block_size, group, window = case
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    batch = make_batch(seed, lens, q_lens, block_size=block_size, group=group, head_dim=16)
    kc, vc, scales, pages = quantized(batch, dtype)
    args = (batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    out = paged_attention(batch.query, kc, vc, *args, kv_scales=scales, sliding_window=window, backend="reference")
    oracle = paged_attention(batch.query, pages[0], pages[1], *args, sliding_window=window, backend="reference")
    exact = paged_attention(*batch.args(), sliding_window=window, backend="reference")
    check(out, oracle, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_then_read_equals_storage_round_trip(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kc = torch.zeros(4, 4, 2, 8, dtype=dtype)
    vc = torch.zeros_like(kc)
    scales = torch.ones(2, 4, 4, 2)
    key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([4, 5, 6, 7, 12, 13])
    write_kv(kc, vc, key, value, slots, kv_scales=scales)
    codes, s = quantize_rows(key, dtype)
    assert torch.equal(kc.view(-1, 2, 8)[slots].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(scales[0].view(-1, 2)[slots], s)
    # the same tokens read back through a table: blocks 1 and 3
    q = torch.randn(1, 4, 8)
    table = torch.tensor([[1, 3]], dtype=torch.int32)
    out = paged_attention(q, kc, vc, table, torch.tensor([6], dtype=torch.int32),
                          torch.tensor([0, 1], dtype=torch.int32), kv_scales=scales, backend="reference")  # fmt: skip
    k_deq, v_deq = dequantize_rows(*quantize_rows(key, dtype)), dequantize_rows(*quantize_rows(value, dtype))
    w = torch.softmax(torch.einsum("hd,nhd->hn", q[0], k_deq.repeat_interleave(2, dim=1)) / 8**0.5, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hn,nhd->hd", w, v_deq.repeat_interleave(2, dim=1)))


def test_misuse_is_refused() -> None:
    kc = torch.zeros(2, 4, 2, 8, dtype=torch.int8)
    key, slots = torch.zeros(1, 2, 8), torch.tensor([0])
    with pytest.raises(InvalidArgumentError, match="int8 cache needs its scales"):
        write_kv(kc, kc.clone(), key, key, slots)
    with pytest.raises(InvalidArgumentError, match="kv_scales must be contiguous float32"):
        write_kv(kc, kc.clone(), key, key, slots, kv_scales=torch.ones(2, 2, 4))
    with pytest.raises(InvalidArgumentError, match="kv_scales are for int8/fp8 caches"):
        write_kv(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), key, key, slots, kv_scales=torch.ones(2, 2, 4, 2))
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="int8 cache needs its scales"):
        paged_attention(torch.zeros(1, 2, 8), kc, kc.clone(), torch.tensor([[1]], dtype=torch.int32), one,
                        torch.tensor([0, 1], dtype=torch.int32), backend="reference")  # fmt: skip


needs_c = pytest.mark.skipif(cpu_decode.isa() is None, reason="the C decode kernel is not built")


@needs_c
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [16, 64, 13, 136])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])  # query heads per KV head: the key loop takes them 3 at a time
def test_c_decode_kernel_reads_codes_in_place(dtype: torch.dtype, dim: int, group: int) -> None:
    lens, _ = random_lengths(7, 5, 90, 1)
    batch = make_batch(7, lens, [1] * 5, block_size=8, group=group, head_dim=dim)
    kc, vc, scales, pages = quantized(batch, dtype)
    exact = paged_attention(*batch.args(), backend="reference")
    for isa, window, out, oracle in c_kernel_codes_and_pages(batch, torch.stack([kc, vc]), scales, pages):
        assert torch.equal(out, oracle), f"{isa}: codes read in place differ from the dequantized pages"
        if window is None:
            check(out, oracle, exact, dtype)


@needs_c
def test_c_decode_kernel_availability_and_refusals() -> None:
    q = torch.zeros(1, 2, 8)
    codes = torch.zeros(2, 3, 4, 1, 8, dtype=torch.int8)
    assert cpu_decode.available(q, codes, torch.ones(2, 3, 4, 1)) == (torch.get_num_threads() == 1)
    assert not cpu_decode.available(q, codes)  # codes without scales
    with pytest.raises(InvalidArgumentError, match="scales"):
        cpu_decode.decode_attention(q, codes, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                    AttentionOptions(), scales=torch.ones(2, 3, 4, 2))  # fmt: skip


@pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton and TRITON_INTERPRET=1")  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [*CASES, (4, 2, 150, 40, 16, 2, None), (5, 2, 200, 1, 32, 4, None)],
                         ids=lambda c: f"case{c[0]}")  # fmt: skip
def test_triton_reads_codes_and_scales(case: tuple[int, ...], dtype: torch.dtype) -> None:
    seed, num_seqs, max_len, max_q, block_size, group, window = case
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    batch = make_batch(seed, lens, q_lens, block_size=block_size, group=group, head_dim=16)
    kc, vc, scales, pages = quantized(batch, dtype)
    args = (batch.block_table, batch.seq_lens, batch.cu_seqlens_q)
    oracle = paged_attention(batch.query, pages[0], pages[1], *args, sliding_window=window, backend="reference")
    exact = paged_attention(*batch.args(), sliding_window=window, backend="reference")
    for max_seqlen_q in (None, max(q_lens)):
        out = paged_attention(batch.query, kc, vc, *args, kv_scales=scales, sliding_window=window, backend="triton",
                              max_seqlen_q=max_seqlen_q)  # fmt: skip
        check(out, oracle, exact, dtype)


@pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton and TRITON_INTERPRET=1")  # fmt: skip
def test_triton_write_quantizes_int8_like_the_reference() -> None:
    """One program per token: codes and scales of every KV head in one pass, from strided [T, Hkv, D] views."""
    torch.manual_seed(3)
    key = (torch.randn(3, 6, 24) * torch.tensor([0.01, 1.0, 40.0])[:, None, None]).transpose(0, 1)
    value = torch.randn(3, 6, 24).transpose(0, 1)
    value[2, 1] = 0.0  # an all-zero row
    slots = torch.tensor([0, 9, 23, 4, 13, 30], dtype=torch.int64)
    caches = [torch.full((8, 4, 3, 24), -99, dtype=torch.int8) for _ in range(4)]
    scales = [torch.full((2, 8, 4, 3), float("nan")) for _ in range(2)]
    write_kv(caches[0], caches[1], key, value, slots, kv_scales=scales[0], backend="reference")
    write_kv(caches[2], caches[3], key, value, slots, kv_scales=scales[1], backend="triton")
    torch.testing.assert_close(scales[1], scales[0], equal_nan=True, atol=0.0, rtol=0.0)  # NaN: not written
    for ref, tri in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ref, tri), "codes differ (no exact .5 ties in this data)"  # untouched slots stay -99
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(InvalidArgumentError, match="quantizes only to int8"):
            write_kv(caches[0].to(fp8), caches[1].to(fp8), key, value, slots, kv_scales=scales[0], backend="triton")


def test_quantizing_writes_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.ops import choose_backend

    monkeypatch.delenv("PAGEDKV_ATTENTION_BACKEND", raising=False)
    cuda = torch.device("cuda")
    if triton_available():
        assert choose_backend(cuda, cache_dtype=torch.int8, op="write", scaled=True) == "triton"
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert choose_backend(cuda, cache_dtype=fp8, op="write", scaled=True) == "reference"
    assert choose_backend(cuda, cache_dtype=torch.int8, op="write") == "reference"  # no scales: cannot quantize


@needs_c
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_c_decode_kernel_takes_a_bfloat16_query_over_codes(dtype: torch.dtype) -> None:
    """A bfloat16 model over quantized KV: the query is widened (exactly) and the float32 answer rounded."""
    lens, _ = random_lengths(5, 4, 70, 1)
    batch = make_batch(5, lens, [1] * 4, block_size=8, group=3, head_dim=64)
    kc, vc, scales, _ = quantized(batch, dtype)
    codes = torch.stack([kc, vc])
    q16 = batch.query.to(torch.bfloat16)
    assert cpu_decode.available(q16, codes, scales)
    options = AttentionOptions(None, None)
    got = cpu_decode.decode_attention(q16, codes, batch.block_table, batch.seq_lens, options, scales=scales)
    wide = cpu_decode.decode_attention(q16.float(), codes, batch.block_table, batch.seq_lens, options, scales=scales)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, wide.to(torch.bfloat16))


@needs_c
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_bfloat16_model_over_quantized_kv_decodes_in_the_c_kernel(kv_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.hf.tiny import tiny_model

    seen: list[torch.dtype] = []
    real = cpu_decode.decode_attention
    monkeypatch.setattr(cpu_decode, "decode_attention", lambda q, kv, *a, **k: seen.append(kv.dtype) or real(q, kv, *a, **k))
    model = tiny_model("llama", 0).to(torch.bfloat16)
    engine = Engine(model, None, EngineConfig(num_blocks=32, block_size=4, kv_cache_dtype=kv_dtype))
    outs = engine.generate([[5, 9, 2, 7, 11], [4, 4, 6]], SamplingParams(max_new_tokens=6))
    assert all(len(o.output_token_ids) == 6 for o in outs)
    assert seen and all(d in (torch.int8, torch.float8_e4m3fn) for d in seen)
