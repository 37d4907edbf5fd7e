"""Whole blocks as byte rows: the bridge between device KV pages and the tiers below the device.

A block's row is the bytes of `data[:, :, block_id]` (`[num_layers, 2, block_size, num_kv_heads,
head_dim]`: K and V of every layer) in C order, then, for quantized storage, the bytes of its scales
`scales[:, :, block_id]` (`[num_layers, 2, S, num_kv_heads]` float32, S = block_size or 1 by the scale scheme):
`spec.bytes_per_block(block_size)` bytes in all. `read_rows` then `write_rows` into other blocks restores them bit for bit (codes and scales
included: only bytes move).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage.codes import raw_bytes
from pagedkv.storage.kv import KVStorage


def block_shape(storage: KVStorage) -> tuple[int, int, int, int, int]:
    """The shape of one block's row before flattening: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
    s = storage.data.shape
    return (int(s[0]), int(s[1]), int(s[3]), int(s[4]), int(s[5]))


def read_rows(storage: KVStorage, block_ids: Sequence[int]) -> npt.NDArray[np.uint8]:
    """`[len(block_ids), bytes_per_block]` uint8 on the CPU: one gather, one device -> host copy."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=storage.device)
    raw = raw_bytes(storage.data)
    gathered = raw.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
    rows = gathered.view(torch.uint8).reshape(len(block_ids), -1)
    if storage.scales is not None:
        scales = storage.scales.index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous()
        rows = torch.cat([rows, scales.view(torch.uint8).reshape(len(block_ids), -1)], dim=1)
    return rows.cpu().numpy()


def write_rows(storage: KVStorage, block_ids: Sequence[int], rows: npt.NDArray[np.uint8]) -> None:
    """Write `rows[i]` into block `block_ids[i]` (every layer, K and V); other blocks are untouched."""
    n = len(block_ids)
    if rows.dtype != np.uint8 or rows.shape != (n, storage.bytes_per_block):
        raise InvalidArgumentError(
            f"write_rows: expected uint8 [{n}, {storage.bytes_per_block}], got {rows.dtype} {rows.shape}"
        )
    if n == 0:
        return
    raw = raw_bytes(storage.data)
    shape = block_shape(storage)
    elem = raw.element_size()
    all_rows = torch.from_numpy(np.ascontiguousarray(rows))
    values = all_rows[:, : math.prod(shape) * elem].contiguous()
    src = values.reshape(n, *shape[:4], shape[4] * elem).view(raw.dtype)
    src = src.permute(1, 2, 0, 3, 4, 5).to(storage.device)
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=storage.device)
    raw.index_copy_(2, ids, src)
    if storage.scales is not None:
        scale_shape = (*shape[:2], *storage.scales.shape[3:])
        scales = all_rows[:, math.prod(shape) * elem :].contiguous().view(torch.float32).reshape(n, *scale_shape)
        storage.scales.index_copy_(2, ids, scales.permute(1, 2, 0, 3, 4).to(storage.device))
