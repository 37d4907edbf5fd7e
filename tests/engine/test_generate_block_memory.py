"""`pagedkv generate --num-blocks` checks the KV bytes against the machine with the storage's own arithmetic
(`pagedkv.storage.kv_spec`): the KV cache dtype's bytes and a quantized dtype's scales, not 4 bytes an element."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from pagedkv.engine import generate_command

CONFIG = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3, dtype=None)


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "bytes_per_token_per_layer_head"),
    [("float32", "auto", 16 * 4), ("bfloat16", "auto", 16 * 2), ("float32", "bf16", 16 * 2), ("float32", "int8", 16 + 4)],
)
def test_block_bytes_follow_the_kv_cache_dtype(
    monkeypatch: pytest.MonkeyPatch, dtype: str, kv_cache_dtype: str, bytes_per_token_per_layer_head: int
) -> None:
    seen: list[int] = []
    monkeypatch.setattr(generate_command, "check_fits_memory", lambda n, *_: seen.append(n))
    args = argparse.Namespace(num_blocks=10, host_blocks=5, block_size=8, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                              kv_scale_scheme="token")  # fmt: skip
    generate_command._check_block_memory(args, CONFIG)
    assert seen == [15 * 8 * 2 * 3 * 2 * bytes_per_token_per_layer_head]


def test_block_scales_count_once_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(generate_command, "check_fits_memory", lambda n, *_: seen.append(n))
    args = argparse.Namespace(num_blocks=10, host_blocks=5, block_size=8, dtype="float32", kv_cache_dtype="int8",
                              kv_scale_scheme="block")  # fmt: skip
    generate_command._check_block_memory(args, CONFIG)
    assert seen == [15 * 2 * 3 * 2 * (8 * 16 + 4)]  # blocks x K/V x layers x KV heads x (codes + one scale)
