"""fp8 (e4m3) caches on the reference path: attention over dequantized KV equals attention over it in fp32."""

from __future__ import annotations

import torch
from ops_batch import make_batch, random_lengths

from pagedkv.ops import paged_attention
from pagedkv.storage.slots import quantize_fp8


def test_fp8_cache_attention_matches_dequantized_fp32() -> None:
    lens, q_lens = random_lengths(21, 4, 40, 3)
    batch = make_batch(21, lens, q_lens, block_size=8)
    k_scale, v_scale = 0.05, 0.02
    kc8 = quantize_fp8(batch.key_cache.nan_to_num(0.0), k_scale)
    vc8 = quantize_fp8(batch.value_cache.nan_to_num(0.0), v_scale)
    out = paged_attention(batch.query, kc8, vc8, *batch.args()[3:], k_scale=k_scale, v_scale=v_scale)
    deq = paged_attention(batch.query, kc8.float() * k_scale, vc8.float() * v_scale, *batch.args()[3:])
    torch.testing.assert_close(out, deq, atol=1e-6, rtol=1e-6)
    exact = paged_attention(*batch.args())
    assert (out - exact).abs().max() < 0.2, "fp8 attention drifted too far from full precision"
