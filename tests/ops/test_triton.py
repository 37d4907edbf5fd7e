"""Triton kernels against the reference, under TRITON_INTERPRET=1 (set by tests/conftest.py) at tiny shapes."""

from __future__ import annotations

import os

import pytest
import torch
from ops_batch import make_batch, random_lengths

from pagedkv.ops import choose_backend, paged_attention, use_backend, write_kv
from pagedkv.ops.dispatch import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it)",
)

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

CASES = [
    # seed, num_seqs, max_len, max_q, block_size, group, window, soft_cap, dtype(, head_dim, num_kv_heads)
    (0, 3, 20, 1, 4, 2, None, None, torch.float32),  # decode, GQA
    (1, 2, 25, 6, 3, 1, None, None, torch.float32),  # chunked prefill, odd block size
    (2, 3, 30, 4, 16, 4, 7, None, torch.float32),  # window
    (3, 2, 18, 3, 1, 2, None, 4.0, torch.float32),  # soft cap, block size 1
    (4, 2, 40, 2, 32, 3, 9, 20.0, torch.float16),  # group 3 (padded to 4)
    (5, 2, 20, 5, 8, 2, None, None, torch.bfloat16),
    # the tiled kernel's modes: several query tiles per sequence, a block holding whole key tiles
    # (block 128 >= 64 keys), several blocks per key tile (block 2: a vector of ids), a runtime block size
    (6, 3, 150, 70, 16, 2, None, None, torch.float32),
    (7, 2, 300, 1, 128, 8, None, None, torch.float16, 64, 2),
    (8, 2, 200, 40, 2, 16, 33, 10.0, torch.bfloat16, 80, 1),
    (9, 3, 100, 20, 7, 5, None, None, torch.float16, 96, 2),
    (10, 2, 130, 130, 256, 1, 50, None, torch.float16, 16, 4),  # whole-prompt prefill, MHA
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c[0]}")
def test_attention_matches_reference(case: tuple) -> None:  # type: ignore[type-arg]
    seed, num_seqs, max_len, max_q, block_size, group, window, cap, dtype = case[:9]
    head_dim, num_kv_heads = case[9:] if len(case) > 9 else (8, 2)
    lens, q_lens = random_lengths(seed, num_seqs, max_len, max_q)
    batch = make_batch(seed, lens, q_lens, block_size=block_size, group=group, dtype=dtype, head_dim=head_dim,
                       num_kv_heads=num_kv_heads)
    expected = paged_attention(*batch.args(), sliding_window=window, soft_cap=cap, backend="reference")
    out = paged_attention(*batch.args(), sliding_window=window, soft_cap=cap, backend="triton")
    assert not out.isnan().any(), "the Triton kernel read a poisoned (unwritten) slot"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    # The same call with max_seqlen_q known (the decode kernel for decode batches) agrees too.
    planned = paged_attention(*batch.args(), sliding_window=window, soft_cap=cap, backend="triton",
                              max_seqlen_q=max(q_lens))
    torch.testing.assert_close(planned, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_reference(query_dtype: torch.dtype) -> None:
    from pagedkv.storage.slots import quantize_fp8

    lens, q_lens = random_lengths(21, 4, 90, 3)
    batch = make_batch(21, lens, q_lens, block_size=8, group=4, head_dim=16)
    batch.query = batch.query.to(query_dtype)
    k_scale, v_scale = 0.05, 0.02
    kc8 = quantize_fp8(batch.key_cache.nan_to_num(0.0), k_scale)
    vc8 = quantize_fp8(batch.value_cache.nan_to_num(0.0), v_scale)
    rest = batch.args()[3:]
    ref = paged_attention(batch.query, kc8, vc8, *rest, k_scale=k_scale, v_scale=v_scale, backend="reference")
    out = paged_attention(batch.query, kc8, vc8, *rest, k_scale=k_scale, v_scale=v_scale, backend="triton")
    atol, rtol = TOLERANCE[query_dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_matches_reference_and_leaves_other_slots(dtype: torch.dtype) -> None:
    shape = (5, 4, 2, 8)
    poison = torch.full(shape, float("nan"), dtype=dtype)
    caches = [poison.clone() for _ in range(4)]
    slots = torch.tensor([17, 0, 6, 19, 9], dtype=torch.int64)
    key, value = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    write_kv(caches[0], caches[1], key, value, slots, backend="reference")
    write_kv(caches[2], caches[3], key, value, slots, backend="triton")
    for ref, tri in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8)), "Triton write differs from the reference"
    flat = caches[2].view(-1, 2, 8)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert flat[untouched].isnan().all(), "a slot no write targeted changed"
    assert torch.equal(flat[slots], key)


def test_dispatch_by_device_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("PAGEDKV_ATTENTION_BACKEND", raising=False)
    assert choose_backend(cpu) == "reference"
    assert choose_backend(torch.device("cuda")) == "triton"
    assert choose_backend(torch.device("cuda"), cache_dtype=torch.float8_e4m3fn) == "reference"  # no sm_89 here
    assert choose_backend(torch.device("cuda"), cache_dtype=torch.float8_e4m3fn, op="write") == "reference"
    with use_backend("triton"):
        assert choose_backend(cpu) == "triton"
        assert choose_backend(cpu, "reference") == "reference"
    monkeypatch.setenv("PAGEDKV_ATTENTION_BACKEND", "triton")
    assert choose_backend(cpu) == "triton"
    with use_backend("reference"):
        assert choose_backend(cpu) == "reference"
    monkeypatch.setenv("PAGEDKV_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend(cpu)


def test_override_routes_calls_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.ops import triton_kernels

    calls = []
    original = triton_kernels.paged_attention_triton
    monkeypatch.setattr(triton_kernels, "paged_attention_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    lens, q_lens = random_lengths(9, 2, 12, 3)
    batch = make_batch(9, lens, q_lens, block_size=4)
    with use_backend("triton"):
        tri = paged_attention(*batch.args())
    assert calls == [1], "use_backend('triton') did not route the call to the Triton kernel"
    ref = paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits,window,max_q", [(2, None, 1), (4, None, 2), (4, 6, 2), (32, None, 1), (8, 40, 70)])
def test_split_k_matches_reference(num_splits: int, window: int | None, max_q: int) -> None:
    from pagedkv.ops.plan import plan_attention

    lens, q_lens = random_lengths(13, 3, 300, max_q)
    batch = make_batch(13, lens, q_lens, block_size=4, group=2)
    expected = paged_attention(*batch.args(), sliding_window=window, backend="reference")
    plan = plan_attention(*batch.args(), backend="triton", num_splits=num_splits, max_seqlen_q=max(q_lens))
    assert plan.triton is not None and plan.triton.num_splits == num_splits
    out = paged_attention(*batch.args(), sliding_window=window, plan=plan)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_reads_strided_views_in_place() -> None:
    """The model hands K/V as [T, Hkv, D] views of [Hkv, T, D] tensors: the write reads them as they are."""
    caches = [torch.full((6, 4, 3, 16), float("nan")) for _ in range(4)]
    key = torch.randn(3, 5, 16).transpose(0, 1)  # [5, 3, 16], not contiguous
    value = torch.randn(3, 5, 16).transpose(0, 1)
    slots = torch.tensor([0, 9, 23, 4, 13], dtype=torch.int64)
    write_kv(caches[0], caches[1], key, value, slots, backend="reference")
    write_kv(caches[2], caches[3], key, value, slots, backend="triton")
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
