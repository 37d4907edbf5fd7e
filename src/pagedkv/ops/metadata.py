"""Adapters from the core's numpy views to what kernels take. No Python loop over sequences anywhere.

The core (`KVManager`) hands out numpy arrays: `block_table` int32 `[B, W]` (padded), `seq_lens` int32
`[B]`, `slot_mapping` int64 `[T]`, and FlashInfer-style `CSRPages(indptr, indices, last_page_len)`. Here:

- `to_device` / `attention_metadata`: `torch.from_numpy` (zero-copy on the host) then one copy to the device.
- `cu_seqlens_from_lens`: `[0, q0, q0+q1, ...]` int32, as `paged_attention` takes it.
- `csr_to_block_table` / `block_table_to_csr`: the two paged layouts, both ways. For a sequence of `n`
  tokens with `k = ceil(n / block_size)` pages, CSR keeps exactly its `k` live ids and
  `last_page_len = n - (k - 1) * block_size` (in `1..block_size`); the padded table keeps them in row
  order and fills the rest with `pad_id`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.protocol import CSRPages

ArrayLike = torch.Tensor | npt.NDArray[np.integer]


class AttentionMetadata(NamedTuple):
    """What `paged_attention` takes besides the query and caches, on one device."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int


def to_device(array: ArrayLike, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A numpy array (zero-copy via `torch.from_numpy`) or tensor as `dtype` on `device`."""
    t = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"expected a numpy array or torch tensor, got {type(array).__name__}")
    return t.to(device=device, dtype=dtype, non_blocking=True)


def cu_seqlens_from_lens(query_lens: ArrayLike, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[0, cumsum(query_lens)...]` as int32 `[B+1]`."""
    lens = to_device(query_lens, torch.int64, device)
    if lens.dim() != 1:
        raise InvalidArgumentError(f"query_lens must be 1-D, got shape {tuple(lens.shape)}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, dim=0, out=cu[1:])
    return cu


def attention_metadata(
    block_table: ArrayLike, seq_lens: ArrayLike, query_lens: ArrayLike, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Everything `paged_attention` needs for one batch, from the core's numpy arrays."""
    q_lens = np.asarray(query_lens) if not isinstance(query_lens, torch.Tensor) else query_lens.cpu().numpy()
    max_q = int(q_lens.max()) if q_lens.size else 0
    return AttentionMetadata(
        to_device(block_table, torch.int32, device),
        to_device(seq_lens, torch.int32, device),
        cu_seqlens_from_lens(q_lens, device),
        max_q,
    )


def seq_lens_from_csr(csr: CSRPages, block_size: int) -> npt.NDArray[np.int32]:
    """Token counts of the sequences a CSR layout describes: `(num_pages - 1) * block_size + last_page_len`."""
    num_pages = np.diff(np.asarray(csr.indptr, dtype=np.int64))
    lens = np.where(num_pages > 0, (num_pages - 1) * block_size + np.asarray(csr.last_page_len), 0)
    return lens.astype(np.int32)


def csr_to_block_table(csr: CSRPages, *, pad_id: int = 0, width: int | None = None) -> npt.NDArray[np.int32]:
    """Padded `[B, W]` int32 table (W = most pages of any sequence, or `width`) from CSR pages."""
    indptr = np.asarray(csr.indptr, dtype=np.int64)
    indices = np.asarray(csr.indices, dtype=np.int32)
    num_pages = np.diff(indptr)
    if (num_pages < 0).any() or indptr[0] != 0 or indptr[-1] != indices.size:
        raise InvalidArgumentError("CSR indptr must start at 0, be non-decreasing and end at len(indices)")
    needed = int(num_pages.max()) if num_pages.size else 0
    width = needed if width is None else width
    if width < needed:
        raise InvalidArgumentError(f"width={width} is narrower than the {needed} pages of the longest sequence")
    table = np.full((num_pages.size, width), pad_id, dtype=np.int32)
    rows = np.repeat(np.arange(num_pages.size), num_pages)
    cols = np.arange(indices.size) - np.repeat(indptr[:-1], num_pages)
    table[rows, cols] = indices
    return table


def block_table_to_csr(block_table: ArrayLike, seq_lens: ArrayLike, block_size: int) -> CSRPages:
    """CSR pages (live ids only, in order) from a padded table and the sequences' token counts."""
    table = np.asarray(block_table.cpu() if isinstance(block_table, torch.Tensor) else block_table)
    lens = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens, dtype=np.int64)
    if table.ndim != 2 or lens.shape != (table.shape[0],):
        raise InvalidArgumentError(f"block_table {table.shape} and seq_lens {lens.shape} must be [B, W] and [B]")
    num_pages = (lens + block_size - 1) // block_size
    if (num_pages > table.shape[1]).any():
        b = int(np.argmax(num_pages > table.shape[1]))
        raise InvalidArgumentError(
            f"seq_lens[{b}] = {lens[b]} needs {num_pages[b]} pages but the table has {table.shape[1]} columns"
        )
    live = np.arange(table.shape[1])[None, :] < num_pages[:, None]
    indptr = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    last = np.where(num_pages > 0, lens - (num_pages - 1) * block_size, 0).astype(np.int32)
    return CSRPages(indptr, table[live].astype(np.int32), last)
