"""`KVStorage`: the KV tensors of every layer, indexed by block id, and the batched moves over them.

Layout: one allocation `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; layer `l`'s caches
are the contiguous views `key_cache(l) = data[l, 0]` and `value_cache(l) = data[l, 1]`, each
`[num_blocks, block_size, num_kv_heads, head_dim]` (the layout `pagedkv.ops` reads). Keeping all layers in
one tensor makes a copy-on-write copy or a swap one indexing op for all layers, not one per layer.

Invariants and contracts:
- Block 0 is, by the allocator's convention, the null/guard block; storage treats it like any other block
  (it may be written, copied, swapped) and never assumes what it holds.
- `write`, `copy_blocks` and `swap_in` touch only the slots/blocks they are given; every other byte stays.
- `swap_out` followed by `swap_in` restores the blocks bit for bit (quantized ones included: moves are byte
  copies).
- Quantized storage (int8, fp8 e4m3/e5m2; `spec.is_quantized`) keeps a sidecar `scales`
  `[num_layers, 2, num_blocks, S, num_kv_heads]` float32 beside `data`, S = `spec.scales_per_block(block_size)`:
  the scale of each token's KV head (S = block_size, the "token" scheme) or of each block's KV head (S = 1, the
  "block" scheme); read = code * scale (`pagedkv.storage.slots`, `pagedkv.storage.block_scales`). A block is
  its codes and its scales: every move (copy, swap, byte rows for the tiers) carries both, and
  `bytes_per_block` counts both. Unwritten scales are 1.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage.codes import raw_bytes
from pagedkv.storage.kv_spec import KVCacheSpec, _check_block_size
from pagedkv.storage.slots import check_write_args, scatter_kv

BlockIds = torch.Tensor | npt.NDArray[np.integer] | list[int]


class HostBlocks(NamedTuple):
    """Blocks swapped out to host memory: `data[l, 0|1, i]` is K|V of layer l for the i-th swapped block.

    `data` is `[num_layers, 2, n, block_size, num_kv_heads, head_dim]` on the CPU (pinned when the storage
    lives on CUDA), in the storage dtype; `scales` the blocks' `[num_layers, 2, n, S, num_kv_heads]` sidecar
    for quantized storage (S as `KVStorage.scales`), None otherwise.
    """

    data: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), f"storage: {name!r} is not a torch dtype"
    return dtype


class KVStorage:
    """Per-layer K/V caches of `num_blocks` blocks of `block_size` tokens on one device.

    Build it from a byte budget with `KVStorage.from_budget(spec, budget_bytes, block_size, device)`, or
    with an explicit `num_blocks`. `validate=True` range-checks slots and block ids on every call (a host
    sync on CUDA); turn it off in a tuned serving loop once the metadata is trusted.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        validate: bool = True,
    ) -> None:
        _check_block_size(block_size)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = torch_dtype(spec.dtype)
        self.validate = validate
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=self.dtype, device=self.device)
        scale_shape = (*shape[:3], spec.scales_per_block(block_size), spec.num_kv_heads)
        self.scales: torch.Tensor | None = (
            torch.ones(scale_shape, dtype=torch.float32, device=self.device) if spec.is_quantized else None
        )

    @classmethod
    def from_budget(
        cls,
        spec: KVCacheSpec,
        budget_bytes: int,
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        validate: bool = True,
    ) -> KVStorage:
        """As many blocks as `budget_bytes` holds (`spec.num_blocks_for_budget`); raises if not one."""
        return cls(spec, spec.num_blocks_for_budget(budget_bytes, block_size), block_size, device, validate=validate)

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block(self.block_size)

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.data[self._layer(layer), 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.data[self._layer(layer), 1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(key_cache, value_cache)` of one layer, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        i = self._layer(layer)
        return self.data[i, 0], self.data[i, 1]

    def layer_scales(self, layer: int) -> torch.Tensor | None:
        """One layer's scale sidecar `[2, num_blocks, S, num_kv_heads]` (K then V; S = block_size or 1, see the
        module docstring), the `kv_scales` argument of `pagedkv.ops`; None unless the storage is quantized."""
        i = self._layer(layer)
        return None if self.scales is None else self.scales[i]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store `key[i]`/`value[i]` (`[num_tokens, num_kv_heads, head_dim]`) at slot `slot_mapping[i]`
        (quantized storage: codes and scales, see `pagedkv.storage.slots`)."""
        k_cache, v_cache = self.layer(layer)
        check_write_args(k_cache, v_cache, key, value, slot_mapping, check_range=self.validate)
        scatter_kv(k_cache, v_cache, key, value, slot_mapping, kv_scales=self.layer_scales(layer))

    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy block `src[i]` to block `dst[i]` in every layer, K and V (copy-on-write), in one op.

        All reads happen before all writes; `dst` ids must be distinct and must not appear in `src`.
        """
        src_t, dst_t = self._ids(src, "src"), self._ids(dst, "dst")
        if src_t.shape != dst_t.shape:
            raise InvalidArgumentError(f"copy_blocks: {src_t.numel()} sources for {dst_t.numel()} destinations")
        if src_t.numel() == 0:
            return
        if self.validate:
            if torch.unique(dst_t).numel() != dst_t.numel():
                raise InvalidArgumentError("copy_blocks: destination block ids must be distinct")
            if bool(torch.isin(dst_t, src_t).any()):
                raise InvalidArgumentError("copy_blocks: a block is both a source and a destination")
        raw = raw_bytes(self.data)
        raw.index_copy_(2, dst_t, raw.index_select(2, src_t))
        if self.scales is not None:
            self.scales.index_copy_(2, dst_t, self.scales.index_select(2, src_t))

    def swap_out(self, block_ids: BlockIds) -> HostBlocks:
        """Copy the given blocks (all layers, K and V) to host memory, pinned when the storage is on CUDA."""
        ids = self._ids(block_ids, "block_ids")
        host = self._to_host(raw_bytes(self.data).index_select(2, ids))
        scales = None if self.scales is None else self._to_host(self.scales.index_select(2, ids))
        return HostBlocks(host.view(self.dtype) if host.dtype != self.dtype else host, scales)

    def _to_host(self, gathered: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return gathered
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(gathered)
        return host

    def swap_in(self, host: HostBlocks, block_ids: BlockIds) -> None:
        """Write swapped-out blocks back, `host.data[:, :, i]` to block `block_ids[i]`, bit exact."""
        ids = self._ids(block_ids, "block_ids")
        expected = (*self.data.shape[:2], ids.numel(), *self.data.shape[3:])
        if tuple(host.data.shape) != expected or host.data.dtype != self.dtype:
            raise InvalidArgumentError(
                f"swap_in: host blocks {tuple(host.data.shape)} {host.data.dtype} do not match "
                f"{expected} {self.dtype} for {ids.numel()} block ids"
            )
        if self.scales is not None:
            scale_shape = (*expected[:3], *self.scales.shape[3:])
            if host.scales is None or host.scales.shape != scale_shape:
                raise InvalidArgumentError(f"swap_in: quantized storage needs the blocks' scales {scale_shape}")
        if self.validate and torch.unique(ids).numel() != ids.numel():
            raise InvalidArgumentError("swap_in: block ids must be distinct")
        src = raw_bytes(host.data).to(self.device, non_blocking=True)
        raw_bytes(self.data).index_copy_(2, ids, src)
        if self.scales is not None and host.scales is not None:
            self.scales.index_copy_(2, ids, host.scales.to(self.device, non_blocking=True))

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidArgumentError(f"layer {layer} out of range; the storage has {self.spec.num_layers} layers")
        return layer

    def _ids(self, ids: BlockIds, name: str) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(ids)) if not isinstance(ids, torch.Tensor) else ids
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} must be a 1-D integer array of block ids, got {t.dtype} {tuple(t.shape)}")
        t = t.to(device=self.device, dtype=torch.int64)
        if self.validate and t.numel() > 0:
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= self.num_blocks:
                raise InvalidArgumentError(
                    f"{name} holds block ids in [{lo}, {hi}] but the storage has blocks [0, {self.num_blocks})"
                )
        return t

    def __repr__(self) -> str:
        return (
            f"KVStorage({self.spec}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"device={self.device}, bytes_per_block={self.bytes_per_block})"
        )
