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
block's key leaves the index at once (`hotpath.forget_keys`), so every index entry is live. The pool owns the
key <-> block index (`index` and `key_of`, a list so that the C hot path can read it), because a block's
state depends on having a key.

At most one block holds a given key (the index is a map). A block computed twice concurrently stays
private in its second copy: it is never published, and goes straight to the free stack when released.
Events (`stored` when a key enters the index, `removed` when it leaves, `cleared` on reset) therefore
describe exactly the set of keys that can hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
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
        self.keyed = np.zeros(num_blocks, dtype=bool)
        self.key_of: list[Key | None] = [None] * num_blocks  # the block's key, or None (a list: C reads it)
        self.index: dict[Key, int] = {}  # key -> the block holding it
        self._hot = hotpath.backend(native)
        # Free stack: the top is the end; initial order hands out ascending ids.
        self._stack = np.arange(num_blocks - 1, self.first_id - 1, -1, dtype=np.int64)
        self._top = len(self._stack)
        self._queues: dict[int, _Queue] = {}  # retention priority -> eviction order
        self._stamp = np.zeros(num_blocks, dtype=np.int64)  # bumped when a block leaves cached-free
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
        block_id = self.index.get(key)
        if block_id is None or self.key_of[block_id] != key:
            return None
        return block_id

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
        if self.record_events:
            key_of = self.key_of
            self.events.extend(CacheEvent("removed", key_of[b], b) for b in out.tolist())
        self._hot.forget_keys(self.index, self.key_of, out)
        self.keyed[out] = False
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

    # --- keys -----------------------------------------------------------------------------------

    def publish(self, block_id: int, key: Key) -> bool:
        """Give an in-use, full block its content key. False if another block already holds the key."""
        if self.lookup(key) is not None or self.key_of[block_id] is not None:
            return False
        self.index[key] = block_id
        self.key_of[block_id] = key
        self.keyed[block_id] = True
        if self.record_events:
            self.events.append(CacheEvent("stored", key, block_id))
        return True

    def unpublish(self, block_id: int) -> None:
        """Remove an in-use block's key (its content is about to change)."""
        key = self.key_of[block_id]
        if key is None:
            return
        if self.index.get(key) == block_id:
            del self.index[key]
        self.key_of[block_id] = None
        self.keyed[block_id] = False
        if self.record_events:
            self.events.append(CacheEvent("removed", key, block_id))

    def clear_keys(self) -> int:
        """Drop every key: cached-free blocks become free. In-use blocks keep their data, lose their key."""
        n = int(self.keyed.sum())
        cached = self._cached_free()
        self._stamp[cached] += 1
        self._queues.clear()
        self._num_evictable = 0
        if len(cached):
            self._stack[self._top : self._top + len(cached)] = cached
            self._top += len(cached)
        self.index.clear()
        self.key_of[:] = [None] * self.num_blocks
        self.keyed[:] = False
        if self.record_events:
            self.events.append(CacheEvent("cleared", None, None))
        return n

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
        live = {k: b for k, b in self.index.items() if self.key_of[b] == k}
        return (
            self.ref.tobytes(),
            self.pins.tobytes(),
            self.keyed.tobytes(),
            tuple(self.key_of),
            tuple(sorted(live.items(), key=repr)),
            self._stack[: self._top].tobytes(),
            tuple((p, q.live(self._stamp).tobytes()) for p, q in sorted(self._queues.items())),
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
        has_key = np.array([k is not None for k in self.key_of], dtype=bool)
        if not np.array_equal(has_key, self.keyed):
            fail("keyed flags and keys disagree")
        for block_id in np.flatnonzero(self.keyed).tolist():
            key = self.key_of[block_id]
            if key is None or self.index.get(key) != block_id:
                fail(f"block {block_id} holds a key the index does not map back to it")
        if len(self.index) != int(self.keyed.sum()):
            fail(f"the index holds {len(self.index)} keys for {int(self.keyed.sum())} keyed blocks (a stale entry)")
        if self.has_null_block and (self.keyed[NULL_BLOCK_ID] or self.ref[NULL_BLOCK_ID] != 1):
            fail("the null block was touched")
