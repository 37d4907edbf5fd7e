"""The block pool: who owns each block, and which blocks an allocation may take.

Every usable block is in exactly one state:

    free         ref 0, no key             in the free stack          taken first
    cached-free  ref 0, holds a published  in the eviction order      taken (evicted) when free runs out,
                 prefix key                (LRU per priority)         lowest retention priority first
    in use       ref >= 1                  in neither

    free + cached-free + in-use == num_usable_blocks  (the null block, if any, is outside all three)

Allocation, release, eviction and hits are O(1) per block (O(log n) under the heap policies), and batched
where they can be: the free stack is a numpy array with a top pointer (popping k blocks is one slice); the
order of the cached-free blocks is the eviction policy's (`eviction.py`: LRU per retention priority by
default, kept as numpy FIFO queues with lazy deletion and scanned by `hotpath.take_live`; SLRU, LFU,
priority with retention, cost-aware). The pool tells the policy when a block enters or leaves cached-free,
is hit or is allocated afresh; the policy only orders. An evicted block's key leaves the prefix index at
once (`PrefixIndex.forget`), so every index entry is live.

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
from pagedkv.core.eviction import EvictionPolicy, eviction_policy
from pagedkv.core.prefix_index import CacheEvent, PrefixIndex

__all__ = ["NULL_BLOCK_ID", "BlockPool", "CacheEvent", "PoolStats"]

IntArray = npt.NDArray[np.int64]
NULL_BLOCK_ID = 0


@dataclass(slots=True)
class PoolStats:
    evictions: int = 0


class BlockPool:
    def __init__(
        self, num_blocks: int, *, null_block: bool = True, record_events: bool = False, native: bool | None = None,
        eviction: str | EvictionPolicy = "lru", block_size: int = 16,
    ) -> None:  # fmt: skip
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
        # Free stack: the top is the end; initial order hands out ascending ids.
        self._stack = np.arange(num_blocks - 1, self.first_id - 1, -1, dtype=np.int64)
        self._top = len(self._stack)
        self.policy = eviction_policy(eviction, num_blocks, block_size, hot=self._hot)  # orders cached-free blocks
        self._counts_hits = type(self.policy).hit is not EvictionPolicy.hit  # skip the calls LRU ignores
        self.stats = PoolStats()
        if null_block:
            self.ref[NULL_BLOCK_ID] = 1  # never allocated, never freed

    # --- queries --------------------------------------------------------------------------------

    @property
    def keyed(self) -> npt.NDArray[np.bool_]:
        """Whether each block holds a key (the prefix index's flags: read them; the index writes them)."""
        return self.prefix_index.keyed

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.first_id

    @property
    def num_free(self) -> int:
        """Free blocks with no content."""
        return self._top

    @property
    def num_evictable(self) -> int:
        return self.policy.num_evictable

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free plus cached-free."""
        return self._top + self.policy.num_evictable

    @property
    def num_in_use(self) -> int:
        return self.num_usable_blocks - self._top - self.policy.num_evictable

    # --- allocation -----------------------------------------------------------------------------

    def allocate(self, n: int) -> IntArray:
        """Take `n` blocks (ref 1 each): free ones first, then evict cached-free ones in the policy's order.

        The caller has checked `n <= num_available`.
        """
        if n > self._top + self.policy.num_evictable:
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
        if self._counts_hits:
            self.policy.reset(ids)
        return ids

    def _evict(self, n: int) -> IntArray:
        """The policy's first `n` cached-free blocks (LRU: the oldest, lowest priority first); their keys are
        dropped."""
        out = self.policy.evict(n)
        self.prefix_index.forget(out)
        self.stats.evictions += n
        return out

    def touch_hits(self, block_ids: IntArray) -> None:
        """Prefix hits on distinct blocks take one more reference each; cached-free ones leave the eviction
        order; the policy counts every hit."""
        ref = self.ref
        cached = block_ids[ref[block_ids] == 0]
        if len(cached):
            self.policy.take(cached)
        if self._counts_hits:
            self.policy.hit(block_ids)
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

        A block reaching zero becomes cached-free (keyed: handed to the eviction policy; under LRU appended
        to its priority's order, so the first released is the first evicted) or free (no key).
        """
        n = len(block_ids)
        if n == 0:
            return
        out = np.empty(n, dtype=np.int64)  # the blocks that become cached-free, in release order
        self._top, kept = self._hot.release_refs(
            self.ref, self.prefix_index.keyed, np.ascontiguousarray(block_ids, dtype=np.int64), self._stack, self._top, out
        )
        if kept:
            self.policy.release(out[:kept], priority)

    # --- keys -----------------------------------------------------------------------------------------

    def clear_keys(self) -> int:
        """Drop every key: cached-free blocks become free. In-use blocks keep their data, lose their key."""
        cached = self.policy.clear()
        if len(cached):
            self._stack[self._top : self._top + len(cached)] = cached
            self._top += len(cached)
        return self.prefix_index.clear()

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
            self.policy.snapshot(),
            self.stats.evictions,
        )

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"pool: {msg}")

        free = self._stack[: self._top]
        self.policy.check_invariants()
        cached = self.policy.cached()
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
        if len(np.unique(cached)) != len(cached) or len(cached) != self.policy.num_evictable:
            fail("eviction order holds a block twice, or disagrees with its count")
        if len(free) and (free.min() < first or (self.ref[free] != 0).any() or self.keyed[free].any()):
            fail("the free stack holds a null, referenced or keyed block")
        if len(cached) and ((self.ref[cached] != 0).any() or not self.keyed[cached].all()):
            fail("the eviction order holds a referenced or unkeyed block")
        if len(np.intersect1d(free, cached)):
            fail("a block is both free and cached-free")
