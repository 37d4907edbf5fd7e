"""`--kv-cache-dtype` in `pagedkv plan` and `pagedkv simulate`: the KV bytes per token (scales included) and
the requests that fit follow the dtype and the scale scheme (`--kv-scale-scheme`), through the one arithmetic
(`pagedkv.storage.kv_spec.kv_bytes_per_block`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_MODELS
from pagedkv.sim.commands_plan import plan_main
from pagedkv.sim.commands_simulate import simulate_main
from pagedkv.storage.kv_spec import KVCacheSpec

ARGS = ["--model", "llama-3-8b", "--gpu", "l4", "--num-requests", "120", "--max-num-seqs", "1024", "--json"]


def test_model_shape_counts_values_and_scales() -> None:
    llama = BUILTIN_MODELS["llama-3-8b"]  # 32 layers, 8 KV heads, head dim 128, bf16
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    for dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        q = dataclasses.replace(llama, kv_cache_dtype=dtype)
        assert q.kv_bytes_per_token == 2 * 32 * 8 * (128 + 4) == KVCacheSpec(32, 8, 128, dtype).bytes_per_token
    assert dataclasses.replace(llama, kv_cache_dtype="bf16").kv_bytes_per_token == llama.kv_bytes_per_token
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype must be one of"):
        dataclasses.replace(llama, kv_cache_dtype="int4")


def test_plan_fits_about_twice_the_requests_in_int8(capsys: pytest.CaptureFixture[str]) -> None:
    plans = {}
    for dtype in ("auto", "int8", "fp8_e4m3"):
        assert plan_main([*ARGS, "--kv-cache-dtype", dtype]) == 0
        plans[dtype] = json.loads(capsys.readouterr().out)
    assert plans["auto"]["bytes_per_token"] == 131072 and plans["int8"]["bytes_per_token"] == 67584
    assert plans["int8"]["kv_budget_bytes"] == plans["auto"]["kv_budget_bytes"]
    assert plans["int8"]["num_blocks"] == plans["auto"]["kv_budget_bytes"] // (16 * 67584)
    base = plans["auto"]["allocators"]["paged"]["max_concurrent_memory"]
    for dtype in ("int8", "fp8_e4m3"):
        ratio = plans[dtype]["allocators"]["paged"]["max_concurrent_memory"] / base
        assert 1.8 < ratio <= 256 / 132 + 0.05, (dtype, ratio)


def test_simulate_takes_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "smollm2-135m", "--allocators", "paged", "--num-requests", "30", "--no-progress"]
    assert simulate_main([*args, "--kv-cache-dtype", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    assert simulate_main([*args, "--kv-cache-dtype", "fp8_e5m2"]) == 0
    assert "KV per token (fp8_e5m2: 1-byte values + a float32 scale per token and KV head) 12,240 bytes" in (
        capsys.readouterr().out
    )


def test_block_scales_in_plan_and_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    llama = BUILTIN_MODELS["llama-3-8b"]
    block = dataclasses.replace(llama, kv_cache_dtype="int8", kv_scale_scheme="block")
    assert block.kv_bytes_per_block(16) == KVCacheSpec(32, 8, 128, "int8", "block").bytes_per_block(16)
    assert block.kv_bytes_per_block(16) == 2 * 32 * 8 * (16 * 128 + 4)
    with pytest.raises(InvalidArgumentError, match="'block' needs a quantized KV cache dtype"):
        dataclasses.replace(llama, kv_scale_scheme="block")
    plans = {}
    for kv in (["auto"], ["int8"], ["int8", "--kv-scale-scheme", "block"]):
        assert plan_main([*ARGS, "--kv-cache-dtype", *kv]) == 0
        plans[kv[-1]] = json.loads(capsys.readouterr().out)
    assert plans["block"]["bytes_per_token"] == 2 * 32 * 8 * 128 + 2 * 32 * 8 * 4 // 16 == 65664
    assert plans["block"]["bytes_per_block"] == 16 * 65664
    conc = {k: p["allocators"]["paged"]["max_concurrent_memory"] for k, p in plans.items()}
    assert conc["block"] >= conc["int8"] and conc["block"] / conc["auto"] >= 1.95, conc
    args = ["--model", "smollm2-135m", "--allocators", "paged", "--num-requests", "30", "--no-progress"]
    assert simulate_main([*args, "--kv-cache-dtype", "int8", "--kv-scale-scheme", "block", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == (2 * 30 * 3 * (16 * 64 + 4)) / 16
    assert simulate_main([*args, "--kv-scale-scheme", "block"]) == 2
    assert "'block' needs a quantized KV cache dtype" in capsys.readouterr().err
