from __future__ import annotations

import pytest

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
from pagedkv.sim.kv_budget import KVBudget, activation_reserve_bytes

GIB = 1024**3


def test_budget_arithmetic_by_hand() -> None:
    m, g = BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-40gb"]
    act = activation_reserve_bytes(m, 8192, 256)
    assert act == 8192 * (4 * 4096 + 2 * 11008) * 2 + 256 * 32000 * 4, "activation estimate"
    b = KVBudget(m, g, 0.9, 16, act)
    usable = int(40 * GIB * 0.9)
    assert b.kv_budget_bytes == usable - 2 * 6_738_415_616 - act, "budget = mem x util - weights - act"
    assert b.bytes_per_block == 16 * 524_288, "bytes per block"
    assert b.num_blocks == b.kv_budget_bytes // (16 * 524_288) == 2922, "blocks"
    assert b.num_usable_blocks == 2921 and b.num_tokens == 2921 * 16, "less the null block"
    text = "\n".join(b.lines())
    for part in ("a100-40gb", "llama-2-7b", "0.9", "KV budget", "2,922 blocks"):
        assert part in text, f"printed arithmetic lacks {part!r}"


def test_model_that_does_not_fit_names_the_values() -> None:
    m, g = BUILTIN_MODELS["llama-2-70b"], BUILTIN_GPUS["a100-40gb"]
    with pytest.raises(CapacityError, match=r"llama-2-70b.*--tensor-parallel"):
        KVBudget(m, g, 0.9, 16, 0)
    assert KVBudget(m, g, 0.9, 16, 0, tensor_parallel=8).num_blocks > 0, "fits on 8 GPUs"


def test_validation() -> None:
    m, g = BUILTIN_MODELS["llama-2-7b"], BUILTIN_GPUS["a100-80gb"]
    with pytest.raises(InvalidArgumentError, match="gpu_memory_utilization"):
        KVBudget(m, g, 1.5, 16, 0)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        KVBudget(m, g, 0.9, 0, 0)
