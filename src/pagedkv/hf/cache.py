"""`PagedKVCache`: the K/V pages a transformers model reads and writes through pagedkv, plus a host pool.

Device side: a `pagedkv.storage.KVStorage` (per layer `[num_blocks, block_size, num_kv_heads, head_dim]` for
K and V, indexed by the block ids the allocator hands out; block 0 is the null block that padding entries
of block tables point at). Host side, for preemption by swap: `num_host_blocks` blocks in CPU memory,
indexed by the host block ids the allocator's swap pool hands out.

The cache holds no per-sequence state: which blocks belong to whom lives in the allocator, and each forward
receives it as a `StepBatch`. It is deliberately not a `transformers.Cache` subclass: transformers' cache
API is built around dense per-layer tensors that grow with each call. Here the attention function is the one
place that writes (through the slot mapping) and reads (through the block tables), and the model runs with
`use_cache=False`, so transformers never builds a cache of its own.

Order within a step (the engine's runner keeps it): swap-ins, then swap-outs (`swap`: the order in which
the scheduler decides them), then copy-on-write copies, then the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf.metadata import StepBatch
from pagedkv.hf.model_spec import ModelSpec
from pagedkv.storage.kv import HostBlocks, KVStorage

BlockIds = npt.ArrayLike
ATTENTION_BACKENDS = ("auto", "sdpa", "ops")


class PagedKVCache:
    """Device pages (`storage`) and an optional host swap pool of `num_host_blocks` blocks."""

    def __init__(
        self, storage: KVStorage, *, num_host_blocks: int = 0, attention_backend: str = "auto"
    ) -> None:
        if num_host_blocks < 0:
            raise InvalidArgumentError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise InvalidArgumentError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        self.storage = storage
        # "sdpa": block gather + torch SDPA where it applies (pagedkv.hf.sdpa), else pagedkv.ops;
        # "ops": always pagedkv.ops (reference on CPU, Triton on CUDA); "auto": sdpa on CPU, ops elsewhere.
        if attention_backend == "auto":
            attention_backend = "sdpa" if storage.device.type == "cpu" else "ops"
        self.attention_backend = attention_backend
        shape = (*storage.data.shape[:2], num_host_blocks, *storage.data.shape[3:])
        self.host = torch.zeros(shape, dtype=storage.data.dtype, device="cpu")

    @classmethod
    def for_model(
        cls,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
    ) -> PagedKVCache:
        """Zeroed pages for `spec`'s layers. Range checks are off: the allocator is the source of truth."""
        if num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        storage = KVStorage(spec.kv_cache_spec(), num_blocks, block_size, device, validate=False)
        return cls(storage, num_host_blocks=num_host_blocks, attention_backend=attention_backend)

    @property
    def num_blocks(self) -> int:
        return self.storage.num_blocks

    @property
    def block_size(self) -> int:
        return self.storage.block_size

    @property
    def num_host_blocks(self) -> int:
        return int(self.host.shape[2])

    @property
    def bytes_per_block(self) -> int:
        return self.storage.bytes_per_block

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(key_cache, value_cache)` of one layer."""
        return self.storage.layer(layer_idx)

    def layer_kv(self, layer_idx: int) -> torch.Tensor:
        """One layer's K and V pages as one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        self.storage.layer(layer_idx)  # range check
        return self.storage.data[layer_idx]

    def write(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `key[i]`/`value[i]` (`[T, num_kv_heads, head_dim]`) at `slot_mapping[i]` of one layer."""
        self.storage.write(layer_idx, key, value, slot_mapping)

    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy-on-write: block `src[i]` -> `dst[i]`, every layer, K and V."""
        self.storage.copy_blocks(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))

    def swap_out(self, device_block_ids: BlockIds, host_block_ids: BlockIds) -> None:
        """Device block `device_block_ids[i]` -> host block `host_block_ids[i]`, every layer."""
        dev, host = self._pair(device_block_ids, host_block_ids, "swap_out")
        if dev.size:
            self.host[:, :, torch.from_numpy(host)] = self.storage.swap_out(dev).data.to("cpu")

    def swap_in(self, host_block_ids: BlockIds, device_block_ids: BlockIds) -> None:
        """Host block `host_block_ids[i]` -> device block `device_block_ids[i]`, every layer, bit exact."""
        dev, host = self._pair(device_block_ids, host_block_ids, "swap_in")
        if dev.size:
            self.storage.swap_in(HostBlocks(self.host[:, :, torch.from_numpy(host)]), dev)

    def swap(
        self,
        out_device_ids: BlockIds,
        out_host_ids: BlockIds,
        in_host_ids: BlockIds,
        in_device_ids: BlockIds,
    ) -> None:
        """One step's swaps, in the order the scheduler decides them: swap-ins, then swap-outs.

        Within a step the scheduler brings swapped requests back before it preempts, so a swap-out may take
        host blocks a swap-in has just released, and may even swap out a request swapped in this very step
        (reading the device blocks the swap-in fills). Both are right only in that order.
        """
        self.swap_in(in_host_ids, in_device_ids)
        self.swap_out(out_device_ids, out_host_ids)

    def _pair(
        self, device_ids: BlockIds, host_ids: BlockIds, what: str
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        dev = np.asarray(device_ids, dtype=np.int64).reshape(-1)
        host = np.asarray(host_ids, dtype=np.int64).reshape(-1)
        if dev.shape != host.shape:
            raise InvalidArgumentError(f"{what}: {dev.size} device blocks but {host.size} host blocks")
        if host.size and (host.min() < 0 or host.max() >= self.num_host_blocks):
            raise InvalidArgumentError(
                f"{what}: host block ids in [{host.min()}, {host.max()}] but the host pool has "
                f"{self.num_host_blocks} blocks; build the cache with num_host_blocks >= the allocator's host pool"
            )
        return dev, host


@dataclass(frozen=True, slots=True)
class PagedStep:
    """What the attention function receives through the forward's kwargs: the pages and this step's batch."""

    cache: PagedKVCache
    batch: StepBatch
