"""Quantized KV with one scale per block and KV head (`kv_scale_scheme="block"`): the bytes it costs, the write
rule (grow and rescale, start afresh at offset 0, keep the scale on a rollback) against a shadow written out in
numpy float32, and the moves that carry a block (copy, swap, byte rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage import KVCacheSpec, KVStorage
from pagedkv.storage.block_rows import read_rows, write_rows
from pagedkv.storage.block_scales import block_writes, dequantize_blocks, quantize_blocks
from pagedkv.storage.codes import QUANT_MAX
from pagedkv.storage.kv_spec import blocks_in_budget, kv_bytes_per_block
from pagedkv.tiers.value import BlockLayout

QUANTIZED = ["int8", "float8_e4m3fn", "float8_e5m2"]
TORCH_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


# --- bytes -----------------------------------------------------------------------------------------------


def test_block_scales_cost_four_bytes_per_block_and_head() -> None:
    spec = KVCacheSpec(2, 4, 64, "int8", "block")
    assert spec.block_scales and spec.scales_per_block(16) == 1
    assert spec.bytes_per_block(16) == 2 * 2 * 4 * (16 * 64 + 4) == kv_bytes_per_block(2, 4, 64, 1, 16, 4, "block")
    token = KVCacheSpec(2, 4, 64, "int8")
    assert token.bytes_per_block(16) == 16 * token.bytes_per_token == 2 * 2 * 4 * 16 * (64 + 4)
    bf16 = KVCacheSpec(2, 4, 64, "bf16").bytes_per_block(16)
    assert bf16 / spec.bytes_per_block(16) == pytest.approx(2 * 16 * 64 / (16 * 64 + 4))  # 1.99x
    assert spec.bytes_per_block(1) == token.bytes_per_block(1), "one token per block: the schemes coincide"
    with pytest.raises(InvalidArgumentError, match="counted per block"):
        _ = spec.bytes_per_token


def test_block_scales_reach_twice_the_requests_of_bf16() -> None:
    """SmolLM2-135M's KV (30 layers, 3 KV heads of 64) in 512 MiB, blocks of 16, requests of 1024 tokens."""
    budget, per_request = 512 << 20, 1024 // 16
    requests = {}
    for name, spec in (("bf16", KVCacheSpec(30, 3, 64, "bf16")), ("token", KVCacheSpec(30, 3, 64, "int8")),
                       ("block", KVCacheSpec(30, 3, 64, "int8", "block"))):  # fmt: skip
        requests[name] = (blocks_in_budget(budget, spec.bytes_per_block(16)) - 1) // per_request  # block 0: null
    assert requests == {"bf16": 22, "token": 42, "block": 45}
    assert requests["block"] >= 2 * requests["bf16"] > requests["token"]


def test_scheme_is_checked_and_named() -> None:
    with pytest.raises(InvalidArgumentError, match="needs a quantized KV cache dtype"):
        KVCacheSpec(2, 4, 64, "bf16", "block")
    with pytest.raises(InvalidArgumentError, match="kv_scale_scheme must be one of token, block"):
        KVCacheSpec(2, 4, 64, "int8", "tensor")
    assert KVCacheSpec(2, 4, 64, "int8").scale_scheme_id == "per-token-head-f32"
    assert KVCacheSpec(2, 4, 64, "int8", "block").scale_scheme_id == "per-block-head-f32"
    assert KVCacheSpec(2, 4, 64, "bf16").scale_scheme_id == ""
    for scheme in ("token", "block"):
        spec = KVCacheSpec(2, 4, 8, "fp8_e4m3", scheme)
        assert BlockLayout(spec.dtype, (2, 2, 16, 4, 8), scheme).nbytes == spec.bytes_per_block(16)


# --- the write rule, scenario by scenario ------------------------------------------------------------------


def _storage(dtype: str = "int8", num_blocks: int = 4, block_size: int = 4, heads: int = 1, dim: int = 8) -> KVStorage:
    return KVStorage(KVCacheSpec(1, heads, dim, dtype, "block"), num_blocks, block_size)


def _write(storage: KVStorage, slots: list[int], rows: torch.Tensor) -> None:
    storage.write(0, rows, rows.clone(), torch.tensor(slots))


def _key(storage: KVStorage, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float code values [bs, H, D], scales [H]) of the K half of one block."""
    assert storage.scales is not None
    return storage.data[0, 0, block].float(), storage.scales[0, 0, block, 0]


def test_a_growing_token_rescales_the_block() -> None:
    storage = _storage()
    small, big = torch.full((1, 1, 8), 1.0), torch.full((1, 1, 8), 10.0)
    small[0, 0, 0] = -0.25
    _write(storage, [4], small)  # block 1, offset 0
    codes, scale = _key(storage, 1)
    assert float(scale) == pytest.approx(1 / 127) and codes[0, 0, 0] == -32 and codes[0, 0, 1] == 127
    _write(storage, [5], big)  # offset 1: absmax 10 > 1 -> the scale grows and offset 0 is rescaled
    codes, scale = _key(storage, 1)
    assert float(scale) == np.float32(10.0) / np.float32(127.0)
    assert codes[0, 0, 1] == 13 and codes[0, 0, 0] == -3, "code' = round(code * old / new): 12.7, -3.2"
    assert bool((codes[1] == 127).all())


def test_offset_zero_starts_the_block_afresh() -> None:
    storage = _storage()
    _write(storage, [4, 5, 6], torch.full((3, 1, 8), 100.0))
    _write(storage, [4], torch.full((1, 1, 8), 1.0))  # a new owner: the old scale is not its business
    codes, scale = _key(storage, 1)
    assert float(scale) == pytest.approx(1 / 127) and bool((codes[0] == 127).all())
    assert bool((codes[1:3] == 127).all()), "offsets past the write keep their bytes"


def test_a_rollback_keeps_the_scale() -> None:
    storage = _storage()
    rows = torch.ones(4, 1, 8)
    rows[3] = 50.0
    _write(storage, [4, 5, 6, 7], rows)
    _write(storage, [7], torch.ones(1, 1, 8))  # speculative tokens rejected: offset 3 rewritten
    codes, scale = _key(storage, 1)
    assert float(scale) == np.float32(50.0) / np.float32(127.0)
    assert bool((codes[:4] == 3).all()), "round(1 / (50 / 127)) = 3 at the kept scale"


def test_an_all_zero_block_has_scale_one_until_something_arrives() -> None:
    storage = _storage()
    _write(storage, [4], torch.zeros(1, 1, 8))
    codes, scale = _key(storage, 1)
    assert float(scale) == 1.0 and bool((codes == 0).all())
    _write(storage, [5], torch.full((1, 1, 8), 0.25))  # the 1 meant "nothing yet": the scale is 0.25 / 127
    codes, scale = _key(storage, 1)
    assert float(scale) == np.float32(0.25) / np.float32(127.0) and bool((codes[1] == 127).all())
    assert bool((codes[0] == 0).all())


def test_one_call_writes_many_blocks_each_with_its_own_scale() -> None:
    storage = _storage(heads=2)
    rows = torch.randn(7, 2, 8)
    rows[:, 1] *= 1000.0
    slots = [4, 5, 6, 7, 8, 9, 13]  # block 1 whole, block 2 offsets 0-1, block 3 offset 1
    _write(storage, slots, rows)
    assert storage.scales is not None
    for block, idx in ((1, [0, 1, 2, 3]), (2, [4, 5]), (3, [6])):
        want = rows[idx].abs().amax(dim=(0, 2)) / 127.0
        torch.testing.assert_close(storage.scales[0, 0, block, 0], want, atol=0, rtol=0)
    writes = block_writes(torch.tensor(slots), 4)
    assert writes.blocks.tolist() == [1, 2, 3] and writes.first.tolist() == [0, 0, 1]
    assert writes.token_block.tolist() == [0, 0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_writing_whole_blocks_is_quantize_blocks(dtype: str) -> None:
    torch.manual_seed(0)
    storage = _storage(dtype, num_blocks=3, heads=3, dim=16)
    x = torch.randn(2, 4, 3, 16) * torch.tensor([0.01, 1.0, 300.0])[None, None, :, None]
    storage.write(0, x.reshape(8, 3, 16), x.reshape(8, 3, 16), torch.arange(4, 12))
    codes, scales = quantize_blocks(x, TORCH_DTYPES[dtype])
    assert torch.equal(storage.data[0, 0, 1:].view(torch.uint8), codes.view(torch.uint8))
    assert storage.scales is not None and torch.equal(storage.scales[0, 0, 1:], scales)
    err = (dequantize_blocks(codes, scales) - x).abs() / x.abs().amax(dim=(1, 3), keepdim=True)
    assert float(err.max()) <= {"int8": 0.5 / 127, "float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}[dtype]


# --- the write rule against a shadow, over random write sequences -------------------------------------------


def _encode(y: np.ndarray, dtype: str) -> np.ndarray:
    """Values already divided by their scale, as code values (float32): the storage's rounding."""
    qmax = np.float32(QUANT_MAX[TORCH_DTYPES[dtype]])
    if dtype == "int8":
        return np.clip(np.rint(y), -qmax, qmax).astype(np.float32)
    return torch.from_numpy(np.clip(y, -qmax, qmax)).to(TORCH_DTYPES[dtype]).float().numpy()


class Shadow:
    """The rule of `pagedkv.storage.block_scales`, one (K/V, block, KV head) at a time, in numpy float32."""

    def __init__(self, dtype: str, num_blocks: int, block_size: int, heads: int, dim: int) -> None:
        self.dtype = dtype
        self.qmax = np.float32(QUANT_MAX[TORCH_DTYPES[dtype]])
        self.scales = np.ones((2, num_blocks, heads), np.float32)
        self.codes = np.zeros((2, num_blocks, block_size, heads, dim), np.float32)

    def write(self, kv: int, block: int, start: int, x: np.ndarray) -> None:
        for h in range(x.shape[1]):
            scale, kept = self.scales[kv, block, h], self.codes[kv, block, :start, h]
            prev = np.float32(0.0) if start == 0 or (scale == 1.0 and not kept.any()) else scale
            new = max(prev, np.abs(x[:, h]).max() / self.qmax)
            new = new if new > 0 else np.float32(1.0)
            if new > prev > 0:
                self.codes[kv, block, :start, h] = _encode(kept * prev / new, self.dtype)
            self.codes[kv, block, start : start + len(x), h] = _encode(x[:, h] / new, self.dtype)
            self.scales[kv, block, h] = new


MAGNITUDES = [0.0, 1e-3, 0.5, 1.0, 127.0, 1e4]


class BlockWriteMachine(RuleBasedStateMachine):
    """Random write calls (appends, fresh starts at offset 0, rollbacks; several blocks per call): the storage
    holds exactly the shadow's codes and scales, every byte of every block, after each call."""

    NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 4, 4, 2, 8

    @initialize(dtype=st.sampled_from(QUANTIZED))
    def start(self, dtype: str) -> None:
        spec = KVCacheSpec(1, self.HEADS, self.DIM, dtype, "block")
        self.storage = KVStorage(spec, self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.shadow = Shadow(dtype, self.NUM_BLOCKS, self.BLOCK_SIZE, self.HEADS, self.DIM)
        self.lengths = [0] * self.NUM_BLOCKS

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(0, self.NUM_BLOCKS - 1), min_size=1, max_size=3, unique=True))
        slots: list[int] = []
        runs: list[tuple[int, int, int]] = []
        for block in blocks:
            n_written = self.lengths[block]
            starts = [0] + ([n_written] if 0 < n_written < self.BLOCK_SIZE else []) + list(range(1, n_written))
            start = data.draw(st.sampled_from(starts))
            n = data.draw(st.integers(1, self.BLOCK_SIZE - start))
            runs.append((block, start, n))
            slots += [block * self.BLOCK_SIZE + start + i for i in range(n)]
        mags = data.draw(st.lists(st.sampled_from(MAGNITUDES), min_size=len(slots), max_size=len(slots)))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        x = rng.standard_normal((2, len(slots), self.HEADS, self.DIM)).astype(np.float32)
        x *= np.array(mags, np.float32)[None, :, None, None]
        self.storage.write(0, torch.from_numpy(x[0]), torch.from_numpy(x[1]), torch.tensor(slots))
        i = 0
        for block, start, n in runs:
            for kv in (0, 1):
                self.shadow.write(kv, block, start, x[kv, i : i + n])
            self.lengths[block] = start + n
            i += n

    @invariant()
    def storage_equals_shadow(self) -> None:
        if not hasattr(self, "storage"):
            return
        assert self.storage.scales is not None
        np.testing.assert_array_equal(self.storage.scales[0, :, :, 0].numpy(), self.shadow.scales)
        np.testing.assert_array_equal(self.storage.data[0].float().numpy(), self.shadow.codes)


BlockWriteMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_write_rule = BlockWriteMachine.TestCase


# --- moves ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_block_scales_move_with_the_block(dtype: str) -> None:
    torch.manual_seed(1)
    storage = KVStorage(KVCacheSpec(2, 3, 16, dtype, "block"), num_blocks=6, block_size=4)
    assert storage.scales is not None and storage.scales.shape == (2, 2, 6, 1, 3)
    storage.write(0, torch.randn(24, 3, 16), torch.randn(24, 3, 16), torch.arange(24))
    storage.write(1, torch.randn(24, 3, 16) * 5, torch.randn(24, 3, 16), torch.arange(24))
    storage.copy_blocks([1, 3], [4, 5])
    for src, dst in ((1, 4), (3, 5)):
        assert torch.equal(storage.data[:, :, dst].view(torch.uint8), storage.data[:, :, src].view(torch.uint8))
        assert torch.equal(storage.scales[:, :, dst], storage.scales[:, :, src])
    before_codes, before_scales = storage.data.view(torch.uint8).clone(), storage.scales.clone()
    host = storage.swap_out([1, 2])
    assert host.scales is not None and host.scales.shape == (2, 2, 2, 1, 3)
    storage.data.zero_()
    storage.scales.fill_(7.0)
    storage.swap_in(host, [1, 2])
    assert torch.equal(storage.data[:, :, 1:3].view(torch.uint8), before_codes[:, :, 1:3])
    assert torch.equal(storage.scales[:, :, 1:3], before_scales[:, :, 1:3])
    rows = read_rows(storage, [1, 2])
    assert rows.shape == (2, storage.bytes_per_block)
    other = KVStorage(storage.spec, num_blocks=6, block_size=4)
    write_rows(other, [3, 0], rows)
    assert other.scales is not None
    assert torch.equal(other.data[:, :, [3, 0]].view(torch.uint8), storage.data[:, :, [1, 2]].view(torch.uint8))
    assert torch.equal(other.scales[:, :, [3, 0]], storage.scales[:, :, [1, 2]])
    with pytest.raises(InvalidArgumentError, match="needs the blocks' scales"):
        storage.swap_in(host._replace(scales=torch.ones(2, 2, 2, 4, 3)), [1, 2])
