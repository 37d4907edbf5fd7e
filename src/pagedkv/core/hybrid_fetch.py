"""`HybridKVManager.fetch_blocks`: a tier hit over KV cache groups.

A tier below the device (host RAM, disk, a remote store) holds blocks under the group-qualified keys the
device's prefix index publishes (`group_keys.py`), so each group's copy of a block is its own entry. A fetch
for the full blocks of `[start, end)` asks the source for their keys block by block, every group's key of a
block before the next block's:

    keys  | b0.g0 b0.g1 | b1.g0 b1.g1 | b2.g0 ...         the source returns the leading run it holds
    fill  |  n = run // groups whole blocks, every group's  (a block some group misses ends the hit)

Only blocks every group holds privately and unpublished are asked for (past the computed tokens they are
unwritten), so the fill is their one writer this step; `mark_computed` publishes them afterwards like
computed blocks, and windowed groups then release what their window has passed. The scheduler advances a
chunk by `len(fill.dst) // num_groups` blocks (`num_blocks_filled`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group_keys import group_key
from pagedkv.core.protocol import BlockFill, BlockSource
from pagedkv.core.validate import as_count

if TYPE_CHECKING:
    from pagedkv.core.hybrid_state import SeqState
    from pagedkv.core.pool import BlockPool
    from pagedkv.core.prefix import BlockKeys, Key
    from pagedkv.core.table import BlockTables
    from pagedkv.core.token_rows import TokenRows

IntArray = npt.NDArray[np.int64]


class HybridFetch:
    """`fetch_blocks` of `HybridKVManager` (see the module docstring)."""

    pool: BlockPool
    tables: list[BlockTables]
    tokens: TokenRows
    seqs: dict[int, SeqState]
    enable_prefix_caching: bool
    _block_size: int
    _epoch: int

    def _content_keys(self, tokens: npt.NDArray[np.int32], keys: BlockKeys, start: int, stop: int) -> list[Key]:
        raise NotImplementedError

    def fetch_blocks(
        self, seq_id: int, start: int, end: int, source: BlockSource, tag: object = None
    ) -> BlockFill | None:
        """A tier hit (`protocol.py`): every group's blocks of the full blocks inside `[start, end)` but the
        block of token `end - 1`, for the longest leading run the source holds in every group."""
        row = self.tables[0].device_row(seq_id)
        seq, bs = self.seqs[row], self._block_size
        start, end = as_count(start, "start"), as_count(end, "end")
        computed, length = int(self.tables[0].num_computed[row]), int(self.tokens.length[row])
        if start % bs or start < computed or end > length:
            raise InvalidArgumentError(
                f"fetch_blocks: start {start} must be a block boundary at or past the {computed} "
                f"computed tokens and end {end} at most the {length} tokens of sequence {seq_id}"
            )
        keys = seq.keys
        if not self.enable_prefix_caching or keys is None:
            return None
        first = start // bs
        hashable = int(self.tables[0].hashable_tokens[row])
        last = min((end - 1) // bs, hashable // bs, *(int(t.num_tokens[row]) // bs for t in self.tables))
        last = first + self._private_run(row, first, last)
        if last <= first:
            return None
        content = self._content_keys(self.tokens.of(row), keys, first, last)  # binds the manager's epoch
        groups = len(self.tables)
        n_keys, rows = source.fetch([group_key(c, g) for c in content for g in range(groups)], first, tag)
        n = n_keys // groups
        if not n:
            return None
        dst = np.array([self.tables[g].blocks_of(row)[first + j] for j in range(n) for g in range(groups)], dtype=np.int64)
        return BlockFill(dst, rows[: n * groups])

    def _private_run(self, row: int, first: int, last: int) -> int:
        """How many blocks from `first` (up to `last`) every group holds alone and unpublished."""
        run = max(last - first, 0)
        for t in self.tables:
            blocks = t.blocks_of(row)[first:last]
            own = (self.pool.ref[blocks] == 1) & ~self.pool.keyed[blocks]
            run = min(run, run if own[:run].all() else int(np.argmin(own[:run])))
        return run
