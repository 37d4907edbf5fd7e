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

KV cache groups (hybrid models, `pagedkv.core.group`): with a `layer_map`, the storage holds one page of
`layers_per_block` layer slots per block id, and layer l's K/V live in slot `layer_map[l][1]` of the pages
its group `layer_map[l][0]` hands out (vLLM's layout: a block id belongs to one group at a time, so the
groups share the slots). Each step then carries one `StepBatch` per group (its own block table and slot
mapping); every layer writes and reads through its group's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group import LayerGroup, layers_per_block
from pagedkv.hf.model_spec import ModelSpec
from pagedkv.hf.sdpa import SdpaPlan
from pagedkv.hf.step_metadata import StepBatch
from pagedkv.ops.plan import AttentionPlan, plan_attention
from pagedkv.storage.block_scales import block_writes
from pagedkv.storage.kv import HostBlocks, KVStorage
from pagedkv.storage.kv_spec import KVCacheSpec, resolve_kv_cache_dtype
from pagedkv.storage.slots import check_write_args, scatter_kv

BlockIds = npt.ArrayLike
ATTENTION_BACKENDS = ("auto", "sdpa", "ops")


class PagedKVCache:
    """Device pages (`storage`) and an optional host swap pool of `num_host_blocks` blocks."""

    def __init__(
        self, storage: KVStorage, *, num_host_blocks: int = 0, attention_backend: str = "auto",
        layer_map: Sequence[tuple[int, int]] | None = None,
    ) -> None:  # fmt: skip
        if num_host_blocks < 0:
            raise InvalidArgumentError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise InvalidArgumentError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        self.storage = storage
        # layer -> (KV cache group, storage slot); None: one group, layer l in slot l
        self.layer_map = tuple(layer_map) if layer_map is not None else None
        # "sdpa": block gather + torch SDPA where it applies (pagedkv.hf.sdpa), else pagedkv.ops;
        # "ops": always pagedkv.ops (reference on CPU, Triton on CUDA); "auto": sdpa on CPU, ops elsewhere.
        if attention_backend == "auto":
            attention_backend = "sdpa" if storage.device.type == "cpu" else "ops"
        self.attention_backend = attention_backend
        shape = (*storage.data.shape[:2], num_host_blocks, *storage.data.shape[3:])
        self.host = torch.zeros(shape, dtype=storage.data.dtype, device="cpu")
        # quantized pages: the host pool keeps the blocks' scales too (pagedkv.storage.kv)
        scales = storage.scales
        self.host_scales = torch.ones((*shape[:3], *scales.shape[3:])) if scales is not None else None

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
        layer_groups: Sequence[LayerGroup] | None = None,
        kv_cache_dtype: str = "auto",
        kv_scale_scheme: str = "token",
    ) -> PagedKVCache:
        """Zeroed pages for `spec`'s layers (with `layer_groups`: one slot per layer of the largest group,
        see the module docstring), stored as `kv_cache_dtype` (`pagedkv.storage.kv_spec.KV_CACHE_DTYPES`) with
        `kv_scale_scheme`'s scales when quantized. Range checks are off: the allocator is the source of truth."""
        if num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        layer_map = group_layer_map(layer_groups, spec.num_layers) if layer_groups is not None else None
        storage = KVStorage(cache_spec(spec, layer_groups, kv_cache_dtype, kv_scale_scheme), num_blocks, block_size,
                            device, validate=False)  # fmt: skip
        return cls(storage, num_host_blocks=num_host_blocks, attention_backend=attention_backend, layer_map=layer_map)

    def locate(self, layer_idx: int) -> tuple[int, int]:
        """(KV cache group, storage slot) of a model layer."""
        return (0, layer_idx) if self.layer_map is None else self.layer_map[layer_idx]

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
            moved = self.storage.swap_out(dev)
            self.host[:, :, torch.from_numpy(host)] = moved.data.to("cpu")
            if self.host_scales is not None and moved.scales is not None:
                self.host_scales[:, :, torch.from_numpy(host)] = moved.scales.to("cpu")

    def swap_in(self, host_block_ids: BlockIds, device_block_ids: BlockIds) -> None:
        """Host block `host_block_ids[i]` -> device block `device_block_ids[i]`, every layer, bit exact."""
        dev, host = self._pair(device_block_ids, host_block_ids, "swap_in")
        if dev.size:
            idx = torch.from_numpy(host)
            scales = None if self.host_scales is None else self.host_scales[:, :, idx]
            self.storage.swap_in(HostBlocks(self.host[:, :, idx], scales), dev)

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


class PagedStep:
    """What the attention function receives through the forward's kwargs: the pages and this step's batch,
    plus everything the layers' attention calls share, computed once per step and reused by every layer.

    Per step (at the first layer that needs it): the write's argument checks and backend; per attention
    group, the `pagedkv.ops` plan (validation, dispatch, query tiles, split count and buffers) or the
    `pagedkv.hf.sdpa` plan (gather ids, masks per window). Per layer, `write` and the attention call only
    launch their kernels. A step object serves one forward pass: build a new one for the next step.
    """

    __slots__ = ("_ops_plans", "_sdpa_plans", "_writes", "batch", "batches", "cache")

    def __init__(self, cache: PagedKVCache, batch: StepBatch, batches: Sequence[StepBatch] | None = None) -> None:
        self.cache = cache
        self.batch = batch
        self.batches = tuple(batches) if batches is not None else (batch,)  # one per KV cache group
        self._writes: dict[int, Callable[[int, torch.Tensor, torch.Tensor], None]] = {}
        self._ops_plans: dict[tuple[int, int], AttentionPlan] = {}
        self._sdpa_plans: dict[tuple[int, int], SdpaPlan] = {}

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store this step's new K/V (`[T, num_kv_heads, head_dim]`) of one layer at its group's slots."""
        group, slot = self.cache.locate(layer_idx)
        write = self._writes.get(group)
        if write is None:
            write = self._writes[group] = self._make_write(key, value, group)
        write(slot, key, value)

    def _make_write(
        self, key: torch.Tensor, value: torch.Tensor, group: int = 0
    ) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        from pagedkv.ops.dispatch import choose_backend

        storage = self.cache.storage
        k0, v0 = storage.layer(0)
        slots = self.batches[group].slot_mapping
        check_write_args(k0, v0, key, value, slots, check_range=storage.validate)
        data = storage.data
        scales = storage.scales  # quantized pages: codes and their scales in one pass
        if scales is not None and storage.spec.block_scales:  # the reference's block rule, on any device
            writes = block_writes(slots, storage.block_size)  # once for every layer of the step
            return lambda i, k, v: scatter_kv(data[i, 0], data[i, 1], k, v, slots, kv_scales=scales[i], writes=writes)
        backend = choose_backend(k0.device, cache_dtype=k0.dtype, op="write", scaled=scales is not None)
        if backend == "triton" and scales is not None:
            from pagedkv.ops.triton_kernels import write_kv_codes_triton

            return lambda i, k, v: write_kv_codes_triton(data[i, 0], data[i, 1], k, v, slots, scales[i])
        if backend == "triton":
            from pagedkv.ops.triton_kernels import write_kv_triton

            return lambda i, k, v: write_kv_triton(data[i, 0], data[i, 1], k, v, slots)
        if scales is not None:
            return lambda i, k, v: scatter_kv(data[i, 0], data[i, 1], k, v, slots, kv_scales=scales[i])
        return lambda i, k, v: scatter_kv(data[i, 0], data[i, 1], k, v, slots)

    def ops_plan(
        self, group_idx: int, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        kv_group: int = 0,
    ) -> AttentionPlan:  # fmt: skip
        """The `pagedkv.ops` plan of attention group `group_idx` of KV cache group `kv_group` (made at its
        first call in this step)."""
        plan = self._ops_plans.get((kv_group, group_idx))
        if plan is None:
            g = self.batches[kv_group].groups[group_idx]
            plan = plan_attention(
                query,
                key_cache,
                value_cache,
                g.block_table,
                g.seq_lens,
                g.cu_seqlens_q,
                max_seqlen_q=g.max_seqlen_q,
                max_seqlen_k=g.max_seqlen_k,
            )
            self._ops_plans[(kv_group, group_idx)] = plan
        return plan

    def sdpa_plan(self, group_idx: int, kv_group: int = 0) -> SdpaPlan:
        """The `pagedkv.hf.sdpa` plan of attention group `group_idx` of KV cache group `kv_group` (made at
        its first call in this step)."""
        plan = self._sdpa_plans.get((kv_group, group_idx))
        if plan is None:
            g = self.batches[kv_group].groups[group_idx]
            plan = SdpaPlan.build(g.block_table, g.seq_lens, g.max_seqlen_q, g.max_seqlen_k, self.cache.block_size)
            self._sdpa_plans[(kv_group, group_idx)] = plan
        return plan


def group_layer_map(groups: Sequence[LayerGroup], num_layers: int) -> tuple[tuple[int, int], ...]:
    """layer -> (group, slot): a group's i-th layer uses storage slot i."""
    where = {layer: (g, slot) for g, group in enumerate(groups) for slot, layer in enumerate(group.layers)}
    if sorted(where) != list(range(num_layers)):
        raise InvalidArgumentError(f"layer groups must cover layers 0..{num_layers - 1} once each")
    return tuple(where[layer] for layer in range(num_layers))


def cache_spec(
    spec: ModelSpec, layer_groups: Sequence[LayerGroup] | None, kv_cache_dtype: str = "auto",
    kv_scale_scheme: str = "token",
) -> KVCacheSpec:
    """The storage shape: every layer, or (with groups) the layer slots of one page, in the storage dtype
    `kv_cache_dtype` names ("auto": the model's), quantized ones with `kv_scale_scheme`'s scales."""
    base = spec.kv_cache_spec()
    num_layers = base.num_layers if layer_groups is None else layers_per_block(layer_groups)
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, base.dtype)
    return KVCacheSpec(num_layers, base.num_kv_heads, base.head_dim, dtype, kv_scale_scheme)
