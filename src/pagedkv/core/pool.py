"""The block pool: who owns each block, and which blocks an allocation may take.

Every usable block is in exactly one state:

    free         ref 0, no key             in the free stack          taken first
    cached-free  ref 0, holds a published  in the eviction order      taken (evicted) when free runs out,
                 prefix key                (LRU per priority)         lowest retention priority first
    in use       ref >= 1                  in neither

    free + cached-free + in-use == num_usable_blocks  (the null block, if any, is outside all three)

Allocation, release, eviction and hits are O(1) per block, and batched where they can be: the free stack
is a numpy array with a top pointer (popping k blocks is one slice); the eviction order is one FIFO queue
per retention priority, kept as numpy arrays of (block id, stamp) with lazy deletion: a hit takes a
block out of the order in O(1) by bumping the block's stamp (its queue entry goes stale), and evicting k
blocks scans the queue head for live entries (`hotpath.take_live`, one backend call per queue). An evicted
block's key leaves the prefix index at once (`PrefixIndex.forget`), so every index entry is live.

The pool holds the prefix index (`prefix_index.py`: key <-> block, and the events), because a block's state
depends on having a key, but never writes it except through that class's methods. Reference counts change
only here: `allocate`, `touch_hits`, `share`, `release`, `pin` and `unpin`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.errors import InvalidArgumentError, InvariantError
from pagedkv.core.prefix_index import CacheEvent, PrefixIndex

__all__ = ["NULL_BLOCK_ID", "BlockPool", "CacheEvent", "PoolStats"]

IntArray = npt.NDArray[np.int64]
NULL_BLOCK_ID = 0


@dataclass(slots=True)
class PoolStats:
    evictions: int = 0


class _Queue:
    """A FIFO of (block id, stamp) entries; an entry is live while the block's stamp is unchanged."""

    __slots__ = ("ids", "stamps", "head", "tail")

    def __init__(self, capacity: int = 256) -> None:
        self.ids = np.empty(capacity, dtype=np.int64)
        self.stamps = np.empty(capacity, dtype=np.int64)
        self.head = self.tail = 0

    def push(self, ids: IntArray, stamps: IntArray) -> None:
        n = len(ids)
        if self.tail + n > len(self.ids):
            live = self.tail - self.head
            capacity = max(2 * (live + n), 256)
            grown_ids, grown_stamps = np.empty(capacity, np.int64), np.empty(capacity, np.int64)
            grown_ids[:live] = self.ids[self.head : self.tail]
            grown_stamps[:live] = self.stamps[self.head : self.tail]
            self.ids, self.stamps, self.head, self.tail = grown_ids, grown_stamps, 0, live
        self.ids[self.tail : self.tail + n] = ids
        self.stamps[self.tail : self.tail + n] = stamps
        self.tail += n

    def live(self, stamp: npt.NDArray[np.int64]) -> IntArray:
        ids = self.ids[self.head : self.tail]
        live: IntArray = ids[stamp[ids] == self.stamps[self.head : self.tail]]
        return live


class BlockPool:
    def __init__(
        self, num_blocks: int, *, null_block: bool = True, record_events: bool = False, native: bool | None = None
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < (2 if null_block else 1):
            raise InvalidArgumentError(
                f"num_blocks must be an int >= {2 if null_block else 1} (one is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.first_id = 1 if null_block else 0
        self.has_null_block = null_block
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.pins = np.zeros(num_blocks, dtype=np.int32)
        self._hot = hotpath.backend(native)
        self.prefix_index = PrefixIndex(num_blocks, record_events=record_events, hot=self._hot)
        self.keyed = self.prefix_index.keyed  # read only here: written by the prefix index alone
        # Free stack: the top is the end; initial order hands out ascending ids.
        self._stack = np.arange(num_blocks - 1, self.first_id - 1, -1, dtype=np.int64)
        self._top = len(self._stack)
        self._queues: dict[int, _Queue] = {}  # retention priority -> eviction order
        self._stamp = np.zeros(num_blocks, dtype=np.int64)  # bumped when a block leaves cached-free
        self._num_evictable = 0
        self.stats = PoolStats()
        if null_block:
            self.ref[NULL_BLOCK_ID] = 1  # never allocated, never freed

    # --- queries --------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.first_id

    @property
    def num_free(self) -> int:
        """Free blocks with no content."""
        return self._top

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free plus cached-free."""
        return self._top + self._num_evictable

    @property
    def num_in_use(self) -> int:
        return self.num_usable_blocks - self._top - self._num_evictable

    # --- allocation -----------------------------------------------------------------------------

    def allocate(self, n: int) -> IntArray:
        """Take `n` blocks (ref 1 each): free ones first, then evict cached-free ones in LRU order.

        The caller has checked `n <= num_available`.
        """
        if n > self._top + self._num_evictable:
            raise InvariantError(f"pool: allocate({n}) with only {self.num_available} available")
        top = self._top
        if top == 0:  # a full pool: every block comes from the eviction order
            ids = self._evict(n)
        else:
            take = min(n, top)
            ids = self._stack[top - take : top][::-1].copy()
            self._top = top - take
            if take < n:
                ids = np.concatenate([ids, self._evict(n - take)])
        self.ref[ids] = 1
        return ids

    def _evict(self, n: int) -> IntArray:
        """The `n` oldest cached-free blocks, lowest priority first; their keys are dropped."""
        out = np.empty(n, dtype=np.int64)
        filled = 0
        queues = self._queues
        for prio in sorted(queues):
            q = queues[prio]  # taken entries' stamps are bumped: they go stale in the queue
            q.head, filled = self._hot.take_live(q.ids, q.stamps, q.head, q.tail, self._stamp, out, filled)
            if q.head == q.tail:
                del queues[prio]
            if filled == n:
                break
        if filled != n:
            raise InvariantError(f"pool: eviction found {filled} of {n} cached-free blocks")
        self.prefix_index.forget(out)
        self._num_evictable -= n
        self.stats.evictions += n
        return out

    def touch_hits(self, block_ids: IntArray) -> None:
        """Prefix hits on distinct blocks take one more reference each; cached-free ones leave the eviction
        order (their stamp is bumped, so their queue entries go stale)."""
        ref = self.ref
        cached = block_ids[ref[block_ids] == 0]
        if len(cached):
            self._stamp[cached] += 1
            self._num_evictable -= len(cached)
        ref[block_ids] += 1

    def share(self, block_ids: IntArray) -> None:
        """One more reference on each (distinct) in-use block: a fork's child, or a pending copy's hold."""
        self.ref[block_ids] += 1

    def unshare(self, block_ids: IntArray) -> None:
        """One reference less on each block (repeats allowed) that another holder keeps in use: a writer
        moving off a shared block to its copy. No block changes state."""
        np.subtract.at(self.ref, block_ids, 1)

    def release(self, block_ids: IntArray, priority: int = 0) -> None:
        """Drop one reference from each (distinct) block, in the given order (give tail blocks first).

        A block reaching zero becomes cached-free (keyed: appended to its priority's LRU order, so the
        first released is the first evicted) or free (no key).
        """
        if len(block_ids) == 0:
            return
        ref = self.ref
        ref[block_ids] -= 1
        zero = block_ids[ref[block_ids] == 0]
        if len(zero) == 0:
            return
        keyed = self.keyed[zero]
        plain = zero[~keyed]
        if len(plain):
            top = self._top
            self._stack[top : top + len(plain)] = plain[::-1]  # first released is taken first
            self._top = top + len(plain)
        if len(plain) != len(zero):
            cached = zero[keyed]
            q = self._queues.get(priority)
            if q is None:
                q = self._queues[priority] = _Queue()
            q.push(cached, self._stamp[cached])
            self._num_evictable += len(cached)

    # --- keys -----------------------------------------------------------------------------------------

    def clear_keys(self) -> int:
        """Drop every key: cached-free blocks become free. In-use blocks keep their data, lose their key."""
        cached = self._cached_free()
        self._stamp[cached] += 1
        self._queues.clear()
        self._num_evictable = 0
        if len(cached):
            self._stack[self._top : self._top + len(cached)] = cached
            self._top += len(cached)
        return self.prefix_index.clear()

    def _cached_free(self) -> IntArray:
        parts = [q.live(self._stamp) for _, q in sorted(self._queues.items())]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    # --- pins -----------------------------------------------------------------------------------

    def pin(self, block_id: int) -> None:
        self.touch_hits(np.array([block_id], dtype=np.int64))
        self.pins[block_id] += 1

    def unpin(self, block_id: int, priority: int = 0) -> None:
        self.pins[block_id] -= 1
        self.release(np.array([block_id], dtype=np.int64), priority)

    # --- checks ---------------------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        """Everything observable, for atomicity tests."""
        return (
            self.ref.tobytes(),
            self.pins.tobytes(),
            self.prefix_index.snapshot(),
            self._stack[: self._top].tobytes(),
            tuple((p, q.live(self._stamp).tobytes()) for p, q in sorted(self._queues.items())),
            self.stats.evictions,
        )

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"pool: {msg}")

        free = self._stack[: self._top]
        cached = self._cached_free()
        self._check_orders(free, cached, fail)
        in_use = int((self.ref[self.first_id :] > 0).sum())
        if in_use + len(free) + len(cached) != self.num_usable_blocks:
            fail(f"conservation: {len(free)} free + {len(cached)} cached + {in_use} in use != {self.num_usable_blocks}")
        if (self.ref < 0).any() or (self.pins < 0).any() or (self.pins > np.maximum(self.ref, 0)).any():
            fail("negative ref count or pins above ref count")
        self.prefix_index.check_invariants()
        if self.has_null_block and (self.keyed[NULL_BLOCK_ID] or self.ref[NULL_BLOCK_ID] != 1):
            fail("the null block was touched")

    def _check_orders(
        self, free: IntArray, cached: IntArray, fail: Callable[[str], None]
    ) -> None:
        """The free stack and the eviction order: each block at most once, only blocks of the right state."""
        first = self.first_id
        if len(np.unique(free)) != len(free):
            fail("a block is twice in the free stack")
        if len(np.unique(cached)) != len(cached) or len(cached) != self._num_evictable:
            fail("eviction order holds a block twice, or disagrees with its count")
        if len(free) and (free.min() < first or (self.ref[free] != 0).any() or self.keyed[free].any()):
            fail("the free stack holds a null, referenced or keyed block")
        if len(cached) and ((self.ref[cached] != 0).any() or not self.keyed[cached].all()):
            fail("the eviction order holds a referenced or unkeyed block")
        if len(np.intersect1d(free, cached)):
            fail("a block is both free and cached-free")
