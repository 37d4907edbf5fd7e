"""The roofline against values computed by hand from the published figures (Llama-2-7B, A100-40GB)."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.step_time import StepTimeModel

PARAMS = 6_738_415_616  # Llama-2-7B
KV = 2 * 32 * 32 * 128 * 2  # bytes per token
BW, FLOPS = 1555e9, 312e12  # A100-40GB
PAIR = 4 * 32 * 32 * 128  # attention FLOPs per (query, key) pair: QK^T + PV, all layers and heads


@pytest.fixture
def model() -> StepTimeModel:
    return StepTimeModel(BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-40gb"], overhead_s=0.002)


def test_single_decode_is_memory_bound(model: StepTimeModel) -> None:
    # one token at position 1000: read weights once, read 1001 tokens of KV, write 1.
    cost = model.cost([1000], [1])
    bytes_moved = 2 * PARAMS + 1001 * KV + 1 * KV
    assert cost.bytes_moved == bytes_moved == 14_002_167_808, "bytes"
    assert cost.flops == 2 * PARAMS + PAIR * 1001, "flops"
    assert cost.bound == "memory", "decode is bandwidth-bound"
    assert cost.seconds == pytest.approx(14_002_167_808 / 1555e9 + 0.002, rel=1e-12), "step time"
    assert cost.seconds == pytest.approx(0.0110046, abs=1e-6), "about 11.0 ms"


def test_long_prefill_is_compute_bound(model: StepTimeModel) -> None:
    # a 2048-token prompt from scratch: token i attends to i + 1 keys -> 2048 * 2049 / 2 pairs.
    cost = model.cost([0], [2048])
    flops = 2 * PARAMS * 2048 + PAIR * (2048 * 2049 // 2)
    assert cost.flops == flops == 28_700_598_861_824, "flops"
    assert cost.bytes_moved == 2 * PARAMS + 2048 * KV + 2048 * KV, "bytes"
    assert cost.bound == "compute", "prefill is compute-bound"
    assert cost.seconds == pytest.approx(flops / FLOPS + 0.002, rel=1e-12), "step time"
    assert cost.seconds == pytest.approx(0.093989, abs=1e-6), "about 94 ms"


def test_mixed_batch_sums_chunks(model: StepTimeModel) -> None:
    # 32 decodes at context 500 plus a 512-token chunk resuming a prompt at 1024.
    starts = [500] * 32 + [1024]
    news = [1] * 32 + [512]
    cost = model.cost(starts, news)
    kv_read = (32 * 501 + 1024 + 512) * KV
    kv_written = (32 + 512) * KV
    assert cost.bytes_moved == 2 * PARAMS + kv_read + kv_written, "bytes"
    pairs = 32 * 501 + (512 * 1024 + 512 * 513 // 2)
    assert cost.flops == 2 * PARAMS * 544 + PAIR * pairs, "flops"
    assert cost.seconds == pytest.approx(max(cost.bytes_moved / BW, cost.flops / FLOPS) + 0.002, rel=1e-12)


def test_tensor_parallel_divides_both_terms() -> None:
    one = StepTimeModel(BUILTIN_MODELS["llama-2-70b"], BUILTIN_GPUS["a100-80gb"], overhead_s=0.0)
    four = StepTimeModel(
        BUILTIN_MODELS["llama-2-70b"], BUILTIN_GPUS["a100-80gb"], overhead_s=0.0, tensor_parallel=4
    )
    assert four.step_seconds([100], [1]) == pytest.approx(one.step_seconds([100], [1]) / 4), "tp=4"


def test_empty_step_is_weights_plus_overhead(model: StepTimeModel) -> None:
    assert model.step_seconds([], []) == pytest.approx(2 * PARAMS / BW + 0.002), "weights only"


def test_bad_input(model: StepTimeModel) -> None:
    with pytest.raises(InvalidArgumentError, match="same length"):
        model.cost([1, 2], [1])
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        model.cost([-1], [1])
    with pytest.raises(InvalidArgumentError, match="overhead"):
        StepTimeModel(BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["l4"], overhead_s=-1)
