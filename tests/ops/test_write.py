"""write_kv (reference): exact values at the target slots, every other slot unchanged, clear errors."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_and_decode_in_one_call(dtype: torch.dtype) -> None:
    num_blocks, block_size = 6, 4
    kc = torch.full((num_blocks, block_size, 2, 3), float("nan"), dtype=dtype)
    vc = kc.clone()
    # a 5-token prefill chunk into blocks 3 then 1, and one decode token into block 5 offset 2
    slots = torch.tensor([12, 13, 14, 15, 4, 22])
    key, value = torch.randn(6, 2, 3).to(dtype), torch.randn(6, 2, 3).to(dtype)
    write_kv(kc, vc, key, value, slots, backend="reference")
    flat_k, flat_v = kc.view(-1, 2, 3), vc.view(-1, 2, 3)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value)
    others = torch.ones(num_blocks * block_size, dtype=torch.bool)
    others[slots] = False
    assert flat_k[others].isnan().all() and flat_v[others].isnan().all(), "an untargeted slot changed"


def test_write_errors() -> None:
    kc = torch.zeros(2, 4, 2, 3)
    vc = torch.zeros(2, 4, 2, 3)
    key = torch.zeros(2, 2, 3)
    with pytest.raises(InvalidArgumentError, match=r"slots in \[0, 8\] but the cache has 8 slots"):
        write_kv(kc, vc, key, key, torch.tensor([0, 8]))
    with pytest.raises(InvalidArgumentError, match="slots in"):
        write_kv(kc, vc, key, key, torch.tensor([-1, 2]))
    with pytest.raises(InvalidArgumentError, match="int64"):
        write_kv(kc, vc, key, key, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="one slot per token"):
        write_kv(kc, vc, key, key, torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="key must be"):
        write_kv(kc, vc, torch.zeros(2, 3, 3), torch.zeros(2, 3, 3), torch.tensor([0, 1]))
    with pytest.raises(InvalidArgumentError, match="must match key_cache"):
        write_kv(kc, torch.zeros(2, 4, 2, 3, dtype=torch.float16), key, key, torch.tensor([0, 1]))
