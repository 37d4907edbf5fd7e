"""KVCacheSpec budget arithmetic and KVStorage writes, copy-on-write copies and swaps (bit exact)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage import KVCacheSpec, KVStorage


def test_spec_arithmetic_and_validation() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16)
    assert spec.dtype == "bfloat16" and spec.bytes_per_token == 2 * 2 * 4 * 8 * 2
    assert spec.bytes_per_block(16) == 16 * 256
    assert spec.num_blocks_for_budget(10 * 4096 + 4095, 16) == 10
    assert KVCacheSpec(1, 1, 1, "fp8").bytes_per_element == 1
    with pytest.raises(InvalidArgumentError, match="cannot hold one block of 4096 bytes"):
        spec.num_blocks_for_budget(4095, 16)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads must be a positive int"):
        KVCacheSpec(2, 0, 8)
    with pytest.raises(InvalidArgumentError, match="unsupported KV storage dtype"):
        KVCacheSpec(2, 2, 8, "int4")
    with pytest.raises(InvalidArgumentError, match="block_size"):
        spec.bytes_per_block(257)


def test_spec_is_torch_free() -> None:
    code = "import sys, pagedkv.storage.kv_spec, pagedkv.storage; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_from_budget_allocates_what_it_reports() -> None:
    spec = KVCacheSpec(3, 2, 4, "float16")
    storage = KVStorage.from_budget(spec, budget_bytes=100_000, block_size=8)
    assert storage.num_blocks == spec.num_blocks_for_budget(100_000, 8)
    assert storage.bytes_per_block == 8 * 2 * 3 * 2 * 4 * 2
    assert storage.data.numel() * storage.data.element_size() == storage.num_blocks * storage.bytes_per_block
    kc, vc = storage.layer(2)
    assert kc.shape == (storage.num_blocks, 8, 2, 4) and kc.is_contiguous() and vc.dtype == torch.float16


def _filled(dtype: str = "bfloat16", num_blocks: int = 7) -> KVStorage:
    storage = KVStorage(KVCacheSpec(2, 2, 4, dtype), num_blocks=num_blocks, block_size=3)
    raw = storage.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8))  # arbitrary bytes, no NaN patterns needed
    return storage


def test_write_targets_only_its_slots() -> None:
    storage = _filled("float32")
    storage.data.fill_(float("nan"))
    key, value = torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    slots = torch.tensor([0, 5, 6, 20])
    storage.write(1, key, value, slots)
    kc, vc = storage.layer(1)
    assert torch.equal(kc.view(-1, 2, 4)[slots], key) and torch.equal(vc.view(-1, 2, 4)[slots], value)
    assert int((~storage.data.isnan()).sum()) == 2 * 4 * 2 * 4, "only the written slots of layer 1 may change"
    with pytest.raises(InvalidArgumentError, match="slots in"):
        storage.write(0, key, value, torch.tensor([0, 1, 2, 21]))
    with pytest.raises(InvalidArgumentError, match="layer 2 out of range"):
        storage.write(2, key, value, slots)


def test_copy_blocks_all_layers_exact() -> None:
    storage = _filled()
    before = storage.data.clone()
    storage.copy_blocks(np.array([1, 4]), torch.tensor([5, 2]))
    expected = before.clone()
    expected[:, :, 5] = before[:, :, 1]
    expected[:, :, 2] = before[:, :, 4]
    assert torch.equal(storage.data.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(InvalidArgumentError, match=r"dst holds block ids in \[7, 7\] but the storage has blocks \[0, 7\)"):
        storage.copy_blocks([1], [7])
    with pytest.raises(InvalidArgumentError, match="both a source and a destination"):
        storage.copy_blocks([1, 2], [2, 3])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        storage.copy_blocks([1, 2], [3, 3])
    with pytest.raises(InvalidArgumentError, match="2 sources for 1 destinations"):
        storage.copy_blocks([1, 2], [3])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_swap_round_trip_is_bit_exact(dtype: str) -> None:
    storage = _filled(dtype)
    before = storage.data.view(torch.uint8).clone()
    host = storage.swap_out([6, 0, 3])
    assert host.num_blocks == 3 and host.data.device.type == "cpu" and host.data.dtype == storage.dtype
    storage.data.view(torch.uint8)[:, :, [6, 0, 3]] = 255  # the blocks get reused meanwhile
    storage.swap_in(host, [6, 0, 3])
    assert torch.equal(storage.data.view(torch.uint8), before)
    # swapping in at other ids moves exactly those blocks
    storage.swap_in(host, torch.tensor([1, 2, 4]))
    after = storage.data.view(torch.uint8)
    assert torch.equal(after[:, :, [1, 2, 4]], before[:, :, [6, 0, 3]])
    assert torch.equal(after[:, :, [0, 3, 5, 6]], before[:, :, [0, 3, 5, 6]])
    with pytest.raises(InvalidArgumentError, match="do not match"):
        storage.swap_in(host, [1, 2])


def test_fp8_write_quantizes_per_token_head() -> None:
    storage = KVStorage(KVCacheSpec(1, 1, 4, "fp8"), num_blocks=2, block_size=2)
    key = torch.tensor([[[0.25, 1.0, -3.0, 896.0]]])
    storage.write(0, key, key, torch.tensor([1]))
    kc, _ = storage.layer(0)
    scales = storage.layer_scales(0)
    assert scales is not None and scales[0].view(-1)[1].item() == 2.0  # absmax 896 -> e4m3's max 448
    assert kc.view(-1, 1, 4)[1].float().tolist() == [[0.125, 0.5, -1.5, 448.0]]
