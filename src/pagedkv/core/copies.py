"""The copy ledger: block copies a paged manager recorded and has not handed out yet, and the pool queries
every manager over a `BlockPool` answers alike.

A copy src -> dst is recorded when a writer moves off a shared block (copy-on-write) or a prompt starts
from a cached block's leading tokens (partial reuse); the storage layer performs the copies handed out by
`take` before the next forward pass (`protocol.py`, the order of a step's block moves). Until then:

- both ends are held, one reference each (`held`), so no allocation, swap-in or later copy reuses them;
- a copy whose source is itself a pending destination copies from that one's source instead (`pending`
  maps each destination to its source), since the destination holds nothing before the copies run;
- `take` hands out every copy recorded, in order, and releases the holds (tail first).

Invariant (`check`): `pending`'s keys are exactly the destinations recorded; `held` blocks hold one
reference each in the pool on top of the tables' (`check_references` counts it, for every manager over a
pool: the paged one's one table, the hybrid one's table per group). The ledger changes reference counts
only through the pool's verbs (`share`, `touch_hits`, `release`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError, InvariantError, PinError
from pagedkv.core.pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.protocol import BlockMoves

if TYPE_CHECKING:
    from pagedkv.core.table import BlockTables

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)


class PinHandle(NamedTuple):
    """The blocks a `pin` call pinned; give it back to `unpin`."""

    block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class CopyLedger:
    """Pending copies over `pool`; see the module docstring for the contract."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.src: list[IntArray] = []
        self.dst: list[IntArray] = []
        self.pending: dict[int, int] = {}  # destination of a copy not handed out yet -> its source
        self.held = np.zeros(pool.num_blocks, dtype=bool)  # blocks a pending copy holds a reference on

    def source_of(self, block_ids: IntArray) -> IntArray:
        """The blocks holding the KV of `block_ids` until the copies run (a pending destination reads its
        source)."""
        pending = self.pending
        if not pending:
            return block_ids
        return np.array([pending.get(b, b) for b in block_ids.tolist()], dtype=np.int64)

    def hold_source(self, block_id: int) -> None:
        """Hold a (possibly cached-free) block that a copy recorded later will read: it must not be evicted
        in between."""
        if not self.held[block_id]:
            self.held[block_id] = True
            self.pool.touch_hits(np.array([block_id], dtype=np.int64))

    def record(self, src: IntArray, dst: IntArray) -> None:
        """Copies src[i] -> dst[i] (fresh, distinct destinations): both ends held until `take`."""
        src = self.source_of(src)
        self.pending.update(zip(dst.tolist(), src.tolist()))
        moved = np.unique(np.concatenate([src, dst]))
        hold = moved[~self.held[moved]]
        self.held[hold] = True
        self.pool.share(hold)
        self.src.append(src)
        self.dst.append(dst)

    def take(self) -> BlockMoves:
        """The copies recorded since the last call, `src[i] -> dst[i]` (distinct destinations, no destination
        is a source); their blocks, held until now, become reusable."""
        if not self.src:
            return BlockMoves(_EMPTY, _EMPTY)
        out = BlockMoves(np.concatenate(self.src), np.concatenate(self.dst))
        self.src.clear()
        self.dst.clear()
        self.pending.clear()
        held = np.flatnonzero(self.held)
        self.held[held] = False
        self.pool.release(held[::-1])
        return out

    def snapshot(self) -> tuple[object, ...]:
        return (len(self.src), tuple(self.pending.items()), self.held.tobytes())

    def check(self, owner: str) -> None:
        if set(self.pending) != set(np.concatenate(self.dst).tolist() if self.dst else []):
            raise InvariantError(f"{owner}: pending copies disagree with the copies not handed out")


def check_references(
    pool: BlockPool, host_pool: BlockPool | None, tables: Sequence[BlockTables], copies: CopyLedger, owner: str
) -> None:
    """The invariants every manager over `pool` keeps, with one table per KV cache group (`tables`, rows in
    lockstep; one for a uniform model): the pool's, the host pool's and each table's own, and the holds:

    - each block's reference count is the entries naming it in every table's live, on-device rows, plus its
      pins, plus a pending copy's hold (the null block: exactly 1);
    - a keyed block is full: a row may see it partial only after rolling back into it, and then it must
      copy first (`cow_risk`);
    - a row not marked copy-before-write writes its partial blocks in place: they are its own (one
      reference, a pending copy's hold aside);
    - the pending copies agree with the ledger (`CopyLedger.check`).
    """
    pool.check_invariants()
    if host_pool is not None:
        host_pool.check_invariants()
    for t in tables:
        t.check_invariants()
    refs = np.zeros(pool.num_blocks, dtype=np.int64)
    partials: list[tuple[npt.NDArray[np.bool_], BlockTables]] = []
    for t in tables:
        cols = np.arange(t.table.shape[1])
        held = (cols < t.num_blocks[:, None]) & (t.alive & ~t.swapped)[:, None]
        refs += np.bincount(t.table[held], minlength=pool.num_blocks)
        partials.append((held & ((cols + 1) * t.block_size > t.num_tokens[:, None]), t))
    if pool.has_null_block:
        refs[NULL_BLOCK_ID] = 1
    expected = refs + pool.pins + copies.held
    if not np.array_equal(expected, pool.ref):
        bad = np.nonzero(expected != pool.ref)[0][:8].tolist()
        raise InvariantError(f"{owner}: ref counts differ from table references + pins + pending copies at blocks {bad}")
    for partial, t in partials:
        blocks = t.table[partial & ~t.cow_risk[:, None]]  # on the device: swapped rows are not held
        if pool.keyed[blocks].any():
            raise InvariantError(f"{owner}: a keyed block is partial in a sequence that may write into it")
        if (pool.ref[blocks] - copies.held[blocks] != 1).any():
            raise InvariantError(f"{owner}: a sequence writes in place into a block it shares")
    copies.check(owner)


class PoolQueries:
    """The pool-backed queries, `unpin` and the copy hand-out of both paged managers (`manager.py`, `hybrid.py`)."""

    pool: BlockPool
    copies: CopyLedger

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_available

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_in_use

    def unpin(self, handle: PinHandle) -> None:
        """Release a prefix `pin` returned (its blocks become evictable again once no pin holds them)."""
        if not isinstance(handle, PinHandle) or not isinstance(handle.block_ids, tuple):
            raise InvalidArgumentError("unpin takes the PinHandle that pin returned")
        size = self.pool.num_blocks
        ids = handle.block_ids
        if not all(isinstance(b, int | np.integer) and not isinstance(b, bool) and 0 <= b < size for b in ids):
            raise InvalidArgumentError(f"unpin: block ids must be ints in [0, {size}); pass the PinHandle pin returned")
        if (np.bincount(np.asarray(ids, dtype=np.int64), minlength=size) > self.pool.pins).any():
            raise PinError("these blocks are not pinned (unpinned twice, or reset since?)")
        for block_id in reversed(ids):
            self.pool.unpin(block_id)

    def take_copies(self) -> BlockMoves:
        """The copies recorded since the last call, `src[i] -> dst[i]` (distinct destinations, no destination
        is a source). Run them after this step's swaps and before the next forward (`protocol.py`). Their
        blocks, held until now, become reusable."""
        return self.copies.take()
