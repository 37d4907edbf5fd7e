"""Adapters from the core's numpy views: CSR <-> padded tables, cu_seqlens, device conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.protocol import CSRPages
from pagedkv.ops.metadata import (
    attention_metadata,
    block_table_to_csr,
    csr_to_block_table,
    cu_seqlens_from_lens,
    seq_lens_from_csr,
    to_device,
)


def test_block_table_to_csr_exact() -> None:
    table = np.array([[5, 9, 0, 0], [2, 0, 0, 0], [7, 3, 8, 1]], dtype=np.int32)
    csr = block_table_to_csr(table, np.array([20, 3, 49], dtype=np.int32), block_size=16)
    assert csr.indptr.tolist() == [0, 2, 3, 7]
    assert csr.indices.tolist() == [5, 9, 2, 7, 3, 8, 1]
    assert csr.last_page_len.tolist() == [4, 3, 1]
    assert csr.indptr.dtype == csr.indices.dtype == csr.last_page_len.dtype == np.int32


@pytest.mark.parametrize("seed", range(5))
def test_csr_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    block_size = int(rng.integers(1, 33))
    lens = rng.integers(1, 200, size=int(rng.integers(1, 9))).astype(np.int32)
    pages = (lens + block_size - 1) // block_size
    ids = rng.permutation(int(pages.sum()) + 5)[: int(pages.sum())].astype(np.int32) + 1
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = (lens - (pages - 1) * block_size).astype(np.int32)
    csr = CSRPages(indptr, ids, last)
    table = csr_to_block_table(csr, pad_id=0, width=int(pages.max()) + 2)
    assert (table[np.arange(table.shape[1])[None, :] >= pages[:, None]] == 0).all(), "padding must be pad_id"
    back = block_table_to_csr(table, lens, block_size)
    for a, b in zip(back, csr):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(seq_lens_from_csr(csr, block_size), lens)


def test_csr_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="narrower"):
        csr_to_block_table(CSRPages(np.array([0, 3], np.int32), np.arange(3, dtype=np.int32), np.array([1], np.int32)), width=2)
    with pytest.raises(InvalidArgumentError, match="needs 3 pages"):
        block_table_to_csr(np.zeros((1, 2), np.int32), np.array([33]), block_size=16)


def test_cu_seqlens_and_metadata() -> None:
    cu = cu_seqlens_from_lens(np.array([1, 4, 0, 2]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 1, 5, 5, 7]
    table = np.array([[1, 2], [3, 0]], dtype=np.int32)
    meta = attention_metadata(table, np.array([20, 3], np.int32), np.array([4, 1]))
    assert meta.block_table.dtype == torch.int32 and meta.block_table.tolist() == table.tolist()
    assert meta.seq_lens.tolist() == [20, 3] and meta.cu_seqlens_q.tolist() == [0, 4, 5] and meta.max_seqlen_q == 4


def test_to_device_is_zero_copy_on_host() -> None:
    arr = np.arange(6, dtype=np.int64)
    t = to_device(arr, torch.int64)
    arr[0] = 42
    assert int(t[0]) == 42, "from_numpy on the host should share memory"
