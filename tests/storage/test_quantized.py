"""Quantized KV pages (int8, fp8 e4m3/e5m2): per-token-per-head scales in a sidecar of each block, counted in
the block's bytes, written in one pass with the codes, and moved with the block (copy, swap, byte rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage import KVCacheSpec, KVStorage
from pagedkv.storage.block_rows import read_rows, write_rows
from pagedkv.storage.kv_spec import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from pagedkv.storage.slots import dequantize_rows

QUANTIZED = ["int8", "float8_e4m3fn", "float8_e5m2"]
# worst relative error of one element against its row's absmax: half a step of int8, e4m3's and e5m2's
# 3 and 2 mantissa bits (relative half-ulp 2^-4, 2^-3) on the largest magnitudes
TOLERANCE = {"int8": 0.5 / 127, "float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}


def test_quantized_spec_counts_the_scales() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="int8")
    assert spec.is_quantized and spec.scale_bytes == 4
    assert spec.bytes_per_token == 2 * 2 * 4 * (64 * 1 + 4)
    assert KVCacheSpec(2, 4, 64, "fp8_e5m2").dtype == "float8_e5m2"
    assert KVCacheSpec(2, 4, 64, "fp8_e4m3").bytes_per_token == spec.bytes_per_token
    bf16 = KVCacheSpec(2, 4, 64, "bf16")
    assert not bf16.is_quantized and bf16.scale_bytes == 0 and bf16.bytes_per_token == 2 * 2 * 4 * 128
    assert bf16.bytes_per_token / spec.bytes_per_token == pytest.approx(128 / 68)


def test_kv_cache_dtype_names() -> None:
    assert KV_CACHE_DTYPES == ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
    assert resolve_kv_cache_dtype("auto", "float32") == "float32"
    assert resolve_kv_cache_dtype("bf16", "float32") == "bfloat16"
    assert resolve_kv_cache_dtype("int8", "float32") == "int8"
    assert resolve_kv_cache_dtype("fp8_e4m3", "bfloat16") == "float8_e4m3fn"
    assert resolve_kv_cache_dtype("fp8_e5m2", "bfloat16") == "float8_e5m2"
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", "float32")


def _storage(dtype: str, num_blocks: int = 6) -> KVStorage:
    return KVStorage(KVCacheSpec(2, 3, 16, dtype), num_blocks=num_blocks, block_size=4)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_write_quantizes_per_token_and_head(dtype: str) -> None:
    torch.manual_seed(0)
    storage = _storage(dtype)
    assert storage.scales is not None and storage.scales.shape == (2, 2, 6, 4, 3)
    key = torch.randn(5, 3, 16) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]  # heads of very different size
    value = torch.randn(5, 3, 16)
    value[2, 1] = 0.0  # an all-zero row: scale stays finite, codes zero
    slots = torch.tensor([1, 4, 9, 10, 23])
    storage.write(1, key, value, slots)
    kc, vc = storage.layer(1)
    ks, vs = storage.layer_scales(1)
    for cache, scales, x in ((kc, ks, key), (vc, vs, value)):
        codes = cache.reshape(-1, 3, 16)[slots]
        got = dequantize_rows(codes, scales.reshape(-1, 3)[slots])
        absmax = x.abs().amax(dim=-1, keepdim=True)
        assert bool(((got - x).abs() <= TOLERANCE[dtype] * absmax + 1e-12).all()), f"{dtype} error too large"
        assert bool(scales.reshape(-1, 3)[slots].isfinite().all())
    assert float(vs.reshape(-1, 3)[9, 1]) > 0 and bool((vc.reshape(-1, 3, 16)[9, 1].float() == 0).all())
    untouched = torch.ones(6 * 4, dtype=torch.bool)
    untouched[slots] = False
    assert bool((ks.reshape(-1, 3)[untouched] == 1.0).all()), "only the written slots' scales change"


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_scales_move_with_the_block(dtype: str) -> None:
    torch.manual_seed(1)
    storage = _storage(dtype)
    storage.write(0, torch.randn(24, 3, 16), torch.randn(24, 3, 16), torch.arange(24))
    storage.write(1, torch.randn(24, 3, 16) * 5, torch.randn(24, 3, 16), torch.arange(24))
    assert storage.scales is not None
    before_codes, before_scales = storage.data.view(torch.uint8).clone(), storage.scales.clone()
    storage.copy_blocks([1, 3], [4, 5])  # copy-on-write
    assert torch.equal(storage.scales[:, :, [4, 5]], before_scales[:, :, [1, 3]])
    assert torch.equal(storage.data.view(torch.uint8)[:, :, [4, 5]], before_codes[:, :, [1, 3]])
    host = storage.swap_out([2, 0])
    assert host.scales is not None and host.scales.shape == (2, 2, 2, 4, 3)
    storage.scales[:, :, [2, 0]] = 7.0
    storage.swap_in(host, [2, 0])
    assert torch.equal(storage.scales[:, :, [2, 0]], before_scales[:, :, [2, 0]])
    rows = read_rows(storage, [1, 3])
    assert rows.shape == (2, storage.bytes_per_block)
    other = _storage(dtype)
    write_rows(other, [5, 2], rows)
    assert other.scales is not None
    assert torch.equal(other.scales[:, :, [5, 2]], before_scales[:, :, [1, 3]])
    assert torch.equal(other.data.view(torch.uint8)[:, :, [5, 2]], before_codes[:, :, [1, 3]])


def test_budget_counts_values_and_scales() -> None:
    spec = KVCacheSpec(3, 2, 8, "int8")
    storage = KVStorage.from_budget(spec, budget_bytes=100_000, block_size=8)
    assert storage.scales is not None
    held = storage.data.numel() * storage.data.element_size() + storage.scales.numel() * 4
    assert held == storage.num_blocks * storage.bytes_per_block == storage.num_blocks * 8 * 2 * 3 * 2 * (8 + 4)
    assert storage.num_blocks == 100_000 // (8 * 2 * 3 * 2 * 12)


def test_swap_in_refuses_host_blocks_without_scales() -> None:
    storage = _storage("int8")
    host = storage.swap_out([1])
    with pytest.raises(InvalidArgumentError, match="scales"):
        storage.swap_in(type(host)(host.data), [1])
    assert np.array_equal(read_rows(storage, [1]), read_rows(storage, [1]))
