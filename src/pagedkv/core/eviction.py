"""Eviction policies: which cached-free block an allocation takes when the free stack is empty.

The pool (`pool.py`) owns reference counts and the free stack; a policy owns only the *order* of the
cached-free blocks (ref 0, holding a published key). The pool tells it five things, and asks one:

    release(ids, priority)   ids became cached-free, a sequence's blocks tail first (the deepest first)
    take(ids)                cached-free ids left the order by a prefix hit (they are in use again)
    hit(ids)                 every prefix hit (in-use blocks too): frequency-aware policies count it
    reset(ids)               ids were allocated afresh: forget their history (a new key will follow)
    clear()                  every key dropped: returns the cached-free blocks, the order is empty
    evict(n) -> ids          the n blocks to take, in order; they leave the order

Contract (`check_invariants`): the order holds each cached-free block exactly once (`cached()`), and
`num_evictable` counts them. Every operation is O(1) or O(log n) per block, amortized:

    policy     order                                    per block         keeps
    lru        FIFO per retention priority, lowest     O(1)              today's order (the default)
               priority first; lazily deleted entries
    slru       probationary + protected FIFOs           O(1)              blocks hit since published
    lfu        heap on L + hits (LFU with dynamic       O(log n)          blocks hit often
               aging: L = the last evicted score)
    priority   FIFO per priority; a priority decays     O(log n)          a request's retention priority,
               to 0 after `retention` ticks                                for a while (TensorRT-LLM)
    cost       heap on L + hits x work(depth)           O(log n)          blocks whose hits saved the most
               (GreedyDual-Size-Frequency)                                 prefill work

Lazy deletion everywhere: a block leaving the order bumps its stamp, so its entries go stale and are
skipped (and dropped once they outnumber the live ones). Scores within one released batch never increase
from root to tail (`_chain_min`), so a chain is evicted from its tail: evicting a block makes the blocks
after it in the chain unreachable.

Only LRU's scan runs in the C hot path (`hotpath.take_live`); the other policies keep their order in
Python (heapq and deque are C underneath). They need per-block scores and two segments that the C scan
does not model, and the allocator loop spends a few percent of its time in eviction (docs/cache-policy.md
has the measured cost), so a C version of each would not pay for its second copy of the contract.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.errors import InvalidArgumentError, InvariantError

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "LRUPolicy", "eviction_policy"]

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)
COMPACT_SLACK = 1024  # stale entries tolerated beyond the live ones before a queue or heap is rebuilt
# Prefill work of a block at depth d (d blocks before it), in units of one block without context: the
# linear layers cost the same at any depth, attention grows with the context. For a 7B-class model the two
# are equal near 8k tokens of context (2 x params vs 4 x hidden x layers FLOPs per token and context token,
# with the attention kernels' lower efficiency), so work(d) = 1 + d x block_size / 8192.
COST_BALANCE_TOKENS = 8192


class EvictionPolicy:
    """The order of the cached-free blocks; see the module docstring for the contract."""

    name: ClassVar[str] = ""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_evictable = 0

    def release(self, ids: IntArray, priority: int) -> None:
        raise NotImplementedError

    def take(self, ids: IntArray) -> None:
        raise NotImplementedError

    def hit(self, ids: IntArray) -> None:
        """A prefix hit on each of `ids` (default: not counted)."""

    def reset(self, ids: IntArray) -> None:
        """`ids` were allocated afresh (default: nothing to forget)."""

    def evict(self, n: int) -> IntArray:
        raise NotImplementedError

    def clear(self) -> IntArray:
        raise NotImplementedError

    def cached(self) -> IntArray:
        """The cached-free blocks, in eviction order where the policy keeps one (checks and snapshots)."""
        raise NotImplementedError

    def snapshot(self) -> tuple[object, ...]:
        return (self.cached().tobytes(), self.num_evictable)

    def check_invariants(self) -> None:
        cached = self.cached()
        if len(np.unique(cached)) != len(cached) or len(cached) != self.num_evictable:
            raise InvariantError(f"eviction ({self.name}): the order holds a block twice, or disagrees with its count")


# --- LRU: today's order, with the C scan ----------------------------------------------------------------


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


class LRUPolicy(EvictionPolicy):
    """Least recently released first, lowest retention priority first: one FIFO queue per priority, kept as
    numpy arrays of (block id, stamp) with lazy deletion. A hit takes a block out in O(1) by bumping its
    stamp; evicting k blocks scans each queue's head for live entries (`hotpath.take_live`, one backend
    call per queue)."""

    name = "lru"

    def __init__(self, num_blocks: int, block_size: int = 16, *, hot: hotpath.Backend | None = None) -> None:
        super().__init__(num_blocks, block_size)
        self._hot = hot or hotpath.backend()
        self._queues: dict[int, _Queue] = {}  # retention priority -> eviction order
        self._stamp = np.zeros(num_blocks, dtype=np.int64)  # bumped when a block leaves cached-free

    def release(self, ids: IntArray, priority: int) -> None:
        q = self._queues.get(priority)
        if q is None:
            q = self._queues[priority] = _Queue()
        q.push(ids, self._stamp[ids])
        self.num_evictable += len(ids)

    def take(self, ids: IntArray) -> None:
        self._stamp[ids] += 1
        self.num_evictable -= len(ids)

    def evict(self, n: int) -> IntArray:
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
        self.num_evictable -= n
        return out

    def clear(self) -> IntArray:
        cached = self.cached()
        self._stamp[cached] += 1
        self._queues.clear()
        self.num_evictable = 0
        return cached

    def cached(self) -> IntArray:
        parts = [q.live(self._stamp) for _, q in sorted(self._queues.items())]
        return np.concatenate(parts) if parts else _EMPTY.copy()

    def snapshot(self) -> tuple[object, ...]:
        return tuple((p, q.live(self._stamp).tobytes()) for p, q in sorted(self._queues.items()))


# --- Python orders: stamps in a list, entries (..., block, stamp) -------------------------------------


class _Stamped(EvictionPolicy):
    """Shared bookkeeping of the Python policies: a stamp and a hit count per block, membership flags."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._stamp = [0] * num_blocks
        self._in = np.zeros(num_blocks, dtype=bool)  # cached-free, in the order
        self.hits = np.zeros(num_blocks, dtype=np.int64)  # prefix hits since the block was allocated

    def hit(self, ids: IntArray) -> None:
        self.hits[ids] += 1

    def reset(self, ids: IntArray) -> None:
        self.hits[ids] = 0

    def take(self, ids: IntArray) -> None:
        stamp = self._stamp
        for b in ids.tolist():
            stamp[b] += 1
        self._in[ids] = False
        self.num_evictable -= len(ids)

    def _leave(self, out: list[int]) -> IntArray:
        ids = np.array(out, dtype=np.int64)
        self._in[ids] = False
        self.num_evictable -= len(ids)
        return ids

    def clear(self) -> IntArray:
        cached = self.cached()
        stamp = self._stamp
        for b in cached.tolist():
            stamp[b] += 1
        self._in[cached] = False
        self.num_evictable = 0
        self._drop_all()
        return cached

    def _drop_all(self) -> None:
        raise NotImplementedError

    def cached(self) -> IntArray:
        return np.flatnonzero(self._in).astype(np.int64)

    def snapshot(self) -> tuple[object, ...]:
        return (self._in.tobytes(), self.hits.tobytes(), self.num_evictable, tuple(self._stamp))


class _FIFO:
    """A deque of (block, stamp) with lazy deletion."""

    __slots__ = ("q",)

    def __init__(self) -> None:
        self.q: deque[tuple[int, int]] = deque()

    def pop_live(self, stamp: list[int]) -> int | None:
        q = self.q
        while q:
            b, s = q.popleft()
            if stamp[b] == s:
                return b
        return None

    def compact(self, stamp: list[int], live: int) -> None:
        if len(self.q) > 2 * live + COMPACT_SLACK:
            self.q = deque(e for e in self.q if stamp[e[0]] == e[1])


class SLRUPolicy(_Stamped):
    """Segmented LRU: a block hit since it was allocated is released into the protected segment, others into
    the probationary one; eviction takes the probationary segment's oldest first. The protected segment
    holds at most `protected_fraction` of the pool's blocks: beyond that its oldest are demoted to the
    probationary segment's newest end. One-off prompts (a long document read once) thus never flush blocks
    that were shared."""

    name = "slru"

    def __init__(self, num_blocks: int, block_size: int = 16, *, protected_fraction: float = 0.8) -> None:
        super().__init__(num_blocks, block_size)
        if not 0.0 <= protected_fraction <= 1.0:
            raise InvalidArgumentError(f"protected_fraction must be in [0, 1], got {protected_fraction!r}")
        self.protected_fraction = protected_fraction
        self._probation, self._protected = _FIFO(), _FIFO()
        self._is_protected = np.zeros(num_blocks, dtype=bool)
        self.num_protected = 0

    def release(self, ids: IntArray, priority: int) -> None:
        stamp, hot = self._stamp, self.hits[ids] > 0
        prot = self._is_protected
        prot[ids] = hot
        for b, h in zip(ids.tolist(), hot.tolist()):
            (self._protected if h else self._probation).q.append((b, stamp[b]))
        self._in[ids] = True
        self.num_evictable += len(ids)
        self.num_protected += int(hot.sum())
        cap = int(self.protected_fraction * self.num_blocks)
        while self.num_protected > cap:  # demote the oldest protected blocks
            b = self._protected.pop_live(stamp)
            assert b is not None, "eviction (slru): protected count without a live entry"
            stamp[b] += 1
            prot[b] = False
            self.num_protected -= 1
            self._probation.q.append((b, stamp[b]))
        self._probation.compact(stamp, self.num_evictable - self.num_protected)
        self._protected.compact(stamp, self.num_protected)

    def take(self, ids: IntArray) -> None:
        self.num_protected -= int(self._is_protected[ids].sum())
        self._is_protected[ids] = False
        super().take(ids)

    def evict(self, n: int) -> IntArray:
        out: list[int] = []
        stamp = self._stamp
        while len(out) < n:
            b = self._probation.pop_live(stamp)
            if b is None:
                b = self._protected.pop_live(stamp)
                if b is None:
                    raise InvariantError(f"pool: eviction found {len(out)} of {n} cached-free blocks")
                self.num_protected -= 1
                self._is_protected[b] = False
            stamp[b] += 1
            out.append(b)
        return self._leave(out)

    def _drop_all(self) -> None:
        self._probation, self._protected = _FIFO(), _FIFO()
        self._is_protected[:] = False
        self.num_protected = 0

    def check_invariants(self) -> None:
        super().check_invariants()
        if int((self._is_protected & self._in).sum()) != self.num_protected or (self._is_protected & ~self._in).any():
            raise InvariantError("eviction (slru): the protected count disagrees with the protected blocks")


def _chain_min(scores: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Scores of a batch released tail first, lowered so none exceeds a block nearer the root."""
    out: npt.NDArray[np.float64] = np.minimum.accumulate(scores[::-1])[::-1]
    return out


class _HeapPolicy(_Stamped):
    """A min-heap of (score, release order, block, stamp); the smallest live score is evicted first, the
    earliest released among equals. The cache age L (the last evicted score) is added to new scores, so
    blocks scored long ago age relative to new ones (dynamic aging)."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._heap: list[tuple[float, int, int, int]] = []
        self._order = 0
        self.age = 0.0

    def scores(self, ids: IntArray) -> npt.NDArray[np.float64]:
        raise NotImplementedError

    def release(self, ids: IntArray, priority: int) -> None:
        scores = _chain_min(self.scores(ids) + self.age).tolist()
        stamp, heap, order = self._stamp, self._heap, self._order
        for i, b in enumerate(ids.tolist()):
            heapq.heappush(heap, (scores[i], order + i, b, stamp[b]))
        self._order = order + len(ids)
        self._in[ids] = True
        self.num_evictable += len(ids)
        if len(heap) > 2 * self.num_evictable + COMPACT_SLACK:
            self._heap = [e for e in heap if stamp[e[2]] == e[3]]
            heapq.heapify(self._heap)

    def evict(self, n: int) -> IntArray:
        out: list[int] = []
        stamp, heap = self._stamp, self._heap
        while len(out) < n:
            if not heap:
                raise InvariantError(f"pool: eviction found {len(out)} of {n} cached-free blocks")
            score, _, b, s = heapq.heappop(heap)
            if stamp[b] == s:
                stamp[b] += 1
                out.append(b)
                self.age = max(self.age, score)
        ids = self._leave(out)
        self.hits[ids] = 0
        return ids

    def _drop_all(self) -> None:
        self._heap = []


class LFUPolicy(_HeapPolicy):
    """Least frequently used, with dynamic aging (LFU-DA): score = L + hits since allocation. Every prefix
    hit counts (`hit`, from the pool's `touch_hits`), in-use blocks' hits included."""

    name = "lfu"

    def scores(self, ids: IntArray) -> npt.NDArray[np.float64]:
        return self.hits[ids].astype(np.float64)


class CostPolicy(_HeapPolicy):
    """Cost-aware (GreedyDual-Size-Frequency): score = L + hits x work(depth), the prefill work the block's
    hits saved (a hit at depth d saves work(d)). A block's depth is its distance from the root end of its
    release batch (the manager releases a sequence's blocks tail first). Never-hit blocks score L alone, so
    evicting them does not age the cache: with (hits + 1) instead, every one-off block evicted would raise L
    by about one hit and age shared prompts out as fast as LRU does (measured on the multi-tenant workload)."""

    name = "cost"

    def __init__(self, num_blocks: int, block_size: int = 16, *, balance_tokens: int = COST_BALANCE_TOKENS) -> None:
        super().__init__(num_blocks, block_size)
        if balance_tokens < 1:
            raise InvalidArgumentError(f"balance_tokens must be >= 1, got {balance_tokens!r}")
        self.balance_tokens = balance_tokens

    def scores(self, ids: IntArray) -> npt.NDArray[np.float64]:
        depth = np.arange(len(ids) - 1, -1, -1, dtype=np.float64)
        work = 1.0 + depth * (self.block_size / self.balance_tokens)
        out: npt.NDArray[np.float64] = self.hits[ids] * work
        return out


class PriorityPolicy(_Stamped):
    """Retention priority with a duration (TensorRT-LLM's semantics over the pool's priorities): a block
    released with priority p != 0 is evicted in priority order (lowest first, LRU within one) until
    `retention` ticks have passed; then it decays to priority 0, joining that queue's newest end. A tick is
    one block released into the order (the cache's turnover), or `clock()` when given. `retention=None`
    keeps priorities forever (today's LRU order)."""

    name = "priority"

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, retention: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(num_blocks, block_size)
        if retention is not None and not retention >= 0:
            raise InvalidArgumentError(f"retention must be >= 0 or None, got {retention!r}")
        self.retention = retention
        self._clock = clock
        self._ticks = 0
        self._queues: dict[int, _FIFO] = {}
        self._prio = np.zeros(num_blocks, dtype=np.int64)
        self._expiry: list[tuple[float, int, int]] = []  # (when, block, stamp)

    def now(self) -> float:
        return self._clock() if self._clock is not None else float(self._ticks)

    def _push(self, prio: int, ids: list[int]) -> None:
        q = self._queues.get(prio)
        if q is None:
            q = self._queues[prio] = _FIFO()
        stamp = self._stamp
        q.q.extend((b, stamp[b]) for b in ids)

    def release(self, ids: IntArray, priority: int) -> None:
        self._ticks += len(ids)
        self._decay()
        blocks = ids.tolist()
        self._push(priority, blocks)
        self._prio[ids] = priority
        self._in[ids] = True
        self.num_evictable += len(ids)
        if priority != 0 and self.retention is not None:
            when, stamp = self.now() + self.retention, self._stamp
            for b in blocks:
                heapq.heappush(self._expiry, (when, b, stamp[b]))
        for q in self._queues.values():
            q.compact(self._stamp, self.num_evictable)

    def _decay(self) -> None:
        """Blocks whose retention ran out join priority 0's newest end."""
        now, expiry, stamp = self.now(), self._expiry, self._stamp
        moved: list[int] = []
        while expiry and expiry[0][0] <= now:
            _, b, s = heapq.heappop(expiry)
            if stamp[b] == s:
                stamp[b] += 1
                moved.append(b)
        if moved:
            self._prio[moved] = 0
            self._push(0, moved)

    def evict(self, n: int) -> IntArray:
        self._decay()
        out: list[int] = []
        stamp = self._stamp
        for prio in sorted(self._queues):
            q = self._queues[prio]
            while len(out) < n:
                b = q.pop_live(stamp)
                if b is None:
                    del self._queues[prio]
                    break
                stamp[b] += 1
                out.append(b)
            if len(out) == n:
                break
        if len(out) != n:
            raise InvariantError(f"pool: eviction found {len(out)} of {n} cached-free blocks")
        return self._leave(out)

    def _drop_all(self) -> None:
        self._queues.clear()
        self._expiry.clear()

    def cached(self) -> IntArray:
        parts = [np.array([b for b, s in q.q if self._stamp[b] == s], dtype=np.int64) for _, q in sorted(self._queues.items())]
        return np.concatenate(parts) if parts else _EMPTY.copy()


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, SLRUPolicy, LFUPolicy, PriorityPolicy, CostPolicy)
}


def eviction_policy(
    name: str | EvictionPolicy, num_blocks: int, block_size: int = 16, *, hot: hotpath.Backend | None = None
) -> EvictionPolicy:
    """The policy `name` (one of `EVICTION_POLICIES`) over `num_blocks` blocks, or `name` itself if it is a
    fresh policy object."""
    if isinstance(name, EvictionPolicy):
        if name.num_blocks != num_blocks or name.num_evictable:
            raise InvalidArgumentError("an eviction policy object must be fresh and sized for this pool")
        return name
    if not isinstance(name, str) or name not in EVICTION_POLICIES:
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; choose from {', '.join(EVICTION_POLICIES)}")
    if name == "lru":
        return LRUPolicy(num_blocks, block_size, hot=hot)
    if name == "priority":  # by name: a priority lasts one pool's worth of turnover
        return PriorityPolicy(num_blocks, block_size, retention=num_blocks)
    return EVICTION_POLICIES[name](num_blocks, block_size)
