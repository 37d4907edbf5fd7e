"""The block pool: who owns each block, and which blocks an allocation may take.

Every usable block is in exactly one state:

    free         ref 0, no key             in the free stack          taken first
    cached-free  ref 0, holds a published  in the eviction order      taken (evicted) when free runs out,
                 prefix key                (LRU per priority)         lowest retention priority first
    in use       ref >= 1                  in neither

    free + cached-free + in-use == num_usable_blocks  (the null block, if any, is outside all three)

Allocation, release, eviction and hits are O(1) per block: the free stack is a numpy array with a top
pointer (popping k blocks is one slice), the eviction order is one `OrderedDict` per retention priority
(removing a hit block from the middle is O(1), unlike a deque), ref counts are numpy so batch releases are
vectorised. The pool owns the key <-> block index, because a block's state depends on having a key.

At most one block holds a given key (the index is a map). A block computed twice concurrently stays
private in its second copy: it is never published, and goes straight to the free stack when released.
Events (`stored` when a key enters the index, `removed` when it leaves, `cleared` on reset) therefore
describe exactly the set of keys that can hit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError, InvariantError
from pagedkv.core.prefix import Key

IntArray = npt.NDArray[np.int64]
NULL_BLOCK_ID = 0


class CacheEvent(NamedTuple):
    """What an external KV-aware router needs to track the cache: a key stored or removed, or all cleared."""

    kind: Literal["stored", "removed", "cleared"]
    key: Key | None
    block_id: int | None


@dataclass(slots=True)
class PoolStats:
    evictions: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, *, null_block: bool = True, record_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < (2 if null_block else 1):
            raise InvalidArgumentError(
                f"num_blocks must be an int >= {2 if null_block else 1} (one is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.first_id = 1 if null_block else 0
        self.has_null_block = null_block
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.pins = np.zeros(num_blocks, dtype=np.int32)
        self.keyed = np.zeros(num_blocks, dtype=bool)
        self.key_of: list[Key | None] = [None] * num_blocks
        self.index: dict[Key, int] = {}
        # Free stack: the top is the end; initial order hands out ascending ids.
        self._stack = np.arange(num_blocks - 1, self.first_id - 1, -1, dtype=np.int64)
        self._top = len(self._stack)
        self._evictable: dict[int, OrderedDict[int, None]] = {}
        self._prio_of = np.zeros(num_blocks, dtype=np.int64)  # cached-free block -> its priority level
        self._num_evictable = 0
        self.stats = PoolStats()
        self.record_events = record_events
        self.events: list[CacheEvent] = []
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

    def lookup(self, key: Key) -> int | None:
        return self.index.get(key)

    # --- allocation -----------------------------------------------------------------------------

    def allocate(self, n: int) -> IntArray:
        """Take `n` blocks (ref 1 each): free ones first, then evict cached-free ones in LRU order.

        The caller has checked `n <= num_available`.
        """
        if n > self._top + self._num_evictable:
            raise InvariantError(f"pool: allocate({n}) with only {self.num_available} available")
        take = min(n, self._top)
        top = self._top
        ids = self._stack[top - take : top][::-1].copy()
        self._top = top - take
        if take < n:
            ids = np.concatenate([ids, self._evict(n - take)])
        self.ref[ids] = 1
        return ids

    def _evict(self, n: int) -> IntArray:
        out: list[int] = []
        index, key_of = self.index, self.key_of
        events = self.events if self.record_events else None
        for prio in sorted(self._evictable):
            order = self._evictable[prio]
            take = min(n - len(out), len(order))
            for _ in range(take):
                block_id = order.popitem(last=False)[0]
                key = key_of[block_id]
                del index[key]  # type: ignore[arg-type]
                key_of[block_id] = None
                out.append(block_id)
                if events is not None:
                    events.append(CacheEvent("removed", key, block_id))
            if not order:
                del self._evictable[prio]
            if len(out) == n:
                break
        ids = np.array(out, dtype=np.int64)
        self.keyed[ids] = False
        self._num_evictable -= n
        self.stats.evictions += n
        return ids

    def touch_hit(self, block_id: int) -> None:
        """A prefix hit takes one more reference; a cached-free block leaves the eviction order."""
        if self.ref[block_id] == 0:
            prio = int(self._prio_of[block_id])
            order = self._evictable[prio]
            del order[block_id]
            if not order:
                del self._evictable[prio]
            self._num_evictable -= 1
        self.ref[block_id] += 1

    def release(self, block_ids: IntArray, priority: int = 0) -> None:
        """Drop one reference from each block, in the given order (give tail blocks first).

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
        if keyed.any():
            order = self._evictable.get(priority)
            if order is None:
                order = self._evictable[priority] = OrderedDict()
            cached = zero[keyed]
            order.update(dict.fromkeys(cached.tolist()))
            self._prio_of[cached] = priority
            self._num_evictable += len(cached)

    # --- keys -----------------------------------------------------------------------------------

    def publish(self, block_id: int, key: Key) -> bool:
        """Give an in-use, full block its content key. False if another block already holds the key."""
        if key in self.index:
            return False
        self.index[key] = block_id
        self.key_of[block_id] = key
        self.keyed[block_id] = True
        if self.record_events:
            self.events.append(CacheEvent("stored", key, block_id))
        return True

    def unpublish(self, block_id: int) -> None:
        """Remove an in-use block's key (its content is about to change)."""
        if self.keyed[block_id]:
            self._drop_key(block_id)

    def _drop_key(self, block_id: int) -> None:
        key = self.key_of[block_id]
        del self.index[key]  # type: ignore[arg-type]
        self.key_of[block_id] = None
        self.keyed[block_id] = False
        if self.record_events:
            self.events.append(CacheEvent("removed", key, block_id))

    def clear_keys(self) -> int:
        """Drop every key: cached-free blocks become free. In-use blocks keep their data, lose their key."""
        n = len(self.index)
        for block_id in self.index.values():
            self.key_of[block_id] = None
        self.keyed[:] = False
        self.index.clear()
        cached = self._cached_free()
        self._evictable.clear()
        self._num_evictable = 0
        if len(cached):
            self._stack[self._top : self._top + len(cached)] = cached
            self._top += len(cached)
        if self.record_events:
            self.events.append(CacheEvent("cleared", None, None))
        return n

    def _cached_free(self) -> IntArray:
        ids = [b for order in self._evictable.values() for b in order]
        return np.array(ids, dtype=np.int64)

    # --- pins -----------------------------------------------------------------------------------

    def pin(self, block_id: int) -> None:
        self.touch_hit(block_id)
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
            self.keyed.tobytes(),
            tuple(self.key_of),
            tuple(sorted(self.index.items(), key=repr)),
            self._stack[: self._top].tobytes(),
            tuple((p, tuple(o)) for p, o in sorted(self._evictable.items())),
            self._prio_of.tobytes(),
            self.stats.evictions,
            len(self.events),
        )

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"pool: {msg}")

        first = self.first_id
        free = self._stack[: self._top]
        cached = self._cached_free()
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
        in_use = int((self.ref[first:] > 0).sum())
        if in_use + len(free) + len(cached) != self.num_usable_blocks:
            fail(f"conservation: {len(free)} free + {len(cached)} cached + {in_use} in use != {self.num_usable_blocks}")
        if (self.ref < 0).any() or (self.pins < 0).any() or (self.pins > np.maximum(self.ref, 0)).any():
            fail("negative ref count or pins above ref count")
        if int(self.keyed.sum()) != len(self.index):
            fail("keyed blocks and index size disagree")
        for key, block_id in self.index.items():
            if self.key_of[block_id] != key:
                fail(f"index maps a key to block {block_id}, which holds another key")
        if self.has_null_block and (self.keyed[NULL_BLOCK_ID] or self.ref[NULL_BLOCK_ID] != 1):
            fail("the null block was touched")
