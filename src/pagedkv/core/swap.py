"""Preemption by swap: move a sequence's blocks to a host pool and back.

The host pool is a second `BlockPool` (no null block, no prefix keys). Swapping out releases the device
blocks (shared ones stay with their other holders; the sequence keeps private host copies); swapping in
takes fresh device blocks, which are re-published as the sequence's KV is marked computed again
(duplicates of blocks still cached stay private, see `prefix_index.py`). The storage layer moves the KV itself,
following the returned plan, before the next forward pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.pool import BlockPool
from pagedkv.core.protocol import BlockMoves

if TYPE_CHECKING:
    from pagedkv.core.copies import CopyLedger
    from pagedkv.core.prefix_cache import PrefixCache
    from pagedkv.core.table import BlockTables

IntArray = npt.NDArray[np.int64]




class SwapMixin:
    """Swap methods of `PagedKVManager`."""

    pool: BlockPool
    host_pool: BlockPool | None
    host_block_tokens: npt.NDArray[np.int32]
    tables: BlockTables
    prefix: PrefixCache
    enable_prefix_caching: bool
    _block_size: int
    copies: CopyLedger

    @property
    def supports_swap(self) -> bool:
        """True: this manager swaps (into its host pool; constructed without one, a swap raises)."""
        return True

    def _host(self) -> BlockPool:
        if self.host_pool is None:
            raise InvalidArgumentError("swap needs host blocks: construct the manager with num_host_blocks > 0")
        return self.host_pool

    def swap_out(self, seq_id: int) -> BlockMoves | None:
        """Move a sequence's blocks to host memory. `None` if the host pool is short."""
        host, t = self._host(), self.tables
        row = t.device_row(seq_id)
        blocks = t.blocks_of(row)
        count = -(-int(t.num_tokens[row]) // self._block_size)
        if count > host.num_available:
            return None
        host_ids = host.allocate(count)
        if self.enable_prefix_caching:
            self.host_block_tokens[host_ids] = self.prefix.block_tokens[blocks[:count]]
        src = self.copies.source_of(blocks[:count])  # a pending copy's destination: its source holds that KV
        self.pool.release(blocks[::-1], int(t.priority[row]))
        t.move_row(row, host_ids, to_host=True)
        return BlockMoves(src, host_ids)

    def swap_in(self, seq_id: int) -> BlockMoves | None:
        """Bring a swapped-out sequence back into device blocks. `None` if the device pool is short."""
        host, t = self._host(), self.tables
        row = t.row(seq_id)
        if not t.swapped[row]:
            raise InvalidArgumentError(f"sequence {seq_id} is not swapped out")
        host_ids = t.blocks_of(row)
        if len(host_ids) > self.pool.num_available:
            return None
        dst = self.pool.allocate(len(host_ids))
        if self.enable_prefix_caching:
            self.prefix.write_tokens(dst, self.host_block_tokens[host_ids])
        host.release(host_ids[::-1])
        t.move_row(row, dst, to_host=False)
        return BlockMoves(host_ids, dst)
