"""PagedKVCache: block copies and swaps move exactly the right bytes, in the scheduler's order."""

from __future__ import annotations

import torch

from pagedkv.hf.cache import PagedKVCache
from pagedkv.hf.model_spec import model_spec
from pagedkv.hf.tiny import tiny_model


def filled_cache() -> PagedKVCache:
    cache = PagedKVCache.for_model(model_spec(tiny_model("llama")), 8, 4, num_host_blocks=4)
    gen = torch.Generator().manual_seed(0)
    cache.storage.data.copy_(torch.randn(cache.storage.data.shape, generator=gen))
    return cache


def block(cache: PagedKVCache, block_id: int) -> torch.Tensor:
    return cache.storage.data[:, :, block_id].clone()


def test_swap_out_then_in_restores_blocks_bit_for_bit() -> None:
    cache = filled_cache()
    before = [block(cache, b) for b in (3, 5)]
    cache.swap(out_device_ids=[3, 5], out_host_ids=[1, 0], in_host_ids=[], in_device_ids=[])
    cache.storage.data[:, :, [3, 5]] = 0.0
    cache.swap(out_device_ids=[], out_host_ids=[], in_host_ids=[1, 0], in_device_ids=[6, 2])
    assert torch.equal(block(cache, 6), before[0]) and torch.equal(block(cache, 2), before[1])


def test_swap_out_may_reuse_the_host_block_a_swap_in_releases() -> None:
    cache = filled_cache()
    cache.swap(out_device_ids=[4], out_host_ids=[2], in_host_ids=[], in_device_ids=[])
    swapped = block(cache, 4)
    other = block(cache, 5)
    # one step: host block 2 comes back into device block 1, and device block 5 goes out into host block 2
    cache.swap(out_device_ids=[5], out_host_ids=[2], in_host_ids=[2], in_device_ids=[1])
    assert torch.equal(block(cache, 1), swapped)
    cache.swap(out_device_ids=[], out_host_ids=[], in_host_ids=[2], in_device_ids=[7])
    assert torch.equal(block(cache, 7), other)


def test_a_request_swapped_in_and_out_in_one_step_keeps_its_bytes() -> None:
    cache = filled_cache()
    cache.swap(out_device_ids=[4], out_host_ids=[0], in_host_ids=[], in_device_ids=[])
    kept = block(cache, 4)
    cache.swap(out_device_ids=[6], out_host_ids=[1], in_host_ids=[0], in_device_ids=[6])
    cache.swap(out_device_ids=[], out_host_ids=[], in_host_ids=[1], in_device_ids=[3])
    assert torch.equal(block(cache, 3), kept)


def test_copy_blocks_copies_every_layer() -> None:
    cache = filled_cache()
    src = block(cache, 2)
    cache.copy_blocks([2], [7])
    assert torch.equal(block(cache, 7), src)
