"""The prefix index: which block holds which content key. The only code that touches it.

Three structures, kept in step:

    index    dict key -> block id      the block holding each published key (at most one per key)
    key_of   list block id -> key|None  the key each block holds (a list: the C hot path reads it)
    keyed    bool array by block id     key_of[b] is not None (the pool reads it: a released keyed block
                                        becomes cached-free, an unkeyed one free)

With partial reuse on (`track_children`), it also keeps each indexed block's parent key and, by parent
key, the indexed blocks that follow it (`children`), so an admission whose prompt diverges inside a block
can find a cached sibling sharing the block's first tokens; entries leave with their block's key.

It also remembers the keys it evicted lately, as two bitmaps indexed by the key's hash (a generation
each of `num_blocks` evictions; 64 bits per block, at most 2 MiB each: bits, not bytes, so the one eviction
writes to stays in cache), so a lookup can tell "evicted earlier" from "never cached" (`was_evicted`, for
the miss reasons of `misses.py`). A bitmap can answer yes for a key never evicted (another key with the
same hash bits): with at most `num_blocks` marks in 64 x `num_blocks` bits, at most about 3% of cold
misses are counted as evicted.

Invariant: `index[key] == b` if and only if `key_of[b] == key`; no entry is ever stale, because eviction
(`forget`), unpublishing (`remove`) and `clear` drop a key the moment its block stops holding it. A block
whose key another block already holds (a block computed twice concurrently) stays private: it is never
indexed, and goes straight to the free stack when released. So the index is a map and the events describe
exactly the set of keys that can hit.

With `record_events`, it also remembers, for each block a key entered the index for, what a `BlockStored`
event carries besides the key: the content key of the block before it in the sequence that published it
(None for a sequence's first block) and its token ids (`remember_origins`, `published_from`), so an event
feed reports every stored block with its exact parent, whichever manager published it. A record is read
only while its block holds a key (a later publication of the block writes a new one).

Every insertion, removal and lookup goes through the methods below or the backend functions handed
`arrays`, and this class alone emits the events a KV-aware router follows (`stored` when a key enters,
`removed` when it leaves, `cleared` on reset). The per-block loops run in `hotpath`'s backend: eviction's
`forget_keys` is run from here; the publishing loops (`publish_computed`, `publish_rows`) are run by the
prefix cache (`prefix_cache.py`), which owns the publishing rule, on `arrays`, and report the blocks they
indexed to `stored`. tests/core/test_prefix_index.py records every write to these structures at run time,
through any alias: only this module and the backend write them. Reference counts are not here: they are
the pool's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.core import hotpath
from pagedkv.core.errors import InvariantError
from pagedkv.core.prefix import Key

IntArray = npt.NDArray[np.int64]


class CacheEvent(NamedTuple):
    """What an external KV-aware router needs to track the cache: a key stored or removed, or all cleared."""

    kind: Literal["stored", "removed", "cleared"]
    key: Key | None
    block_id: int | None


class PrefixIndex:
    """Key <-> block for `num_blocks` blocks; see the module docstring for the contract."""

    def __init__(self, num_blocks: int, *, record_events: bool, hot: hotpath.Backend) -> None:
        self.index: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * num_blocks
        self.keyed = np.zeros(num_blocks, dtype=bool)
        self.record_events = record_events
        self.events: list[CacheEvent] = []
        self._hot = hot
        self.arrays = hotpath.IndexArrays(self.index, self.key_of, self.keyed)  # never reassigned: one value
        slots = 1 << max(16, min(24, (64 * num_blocks - 1).bit_length()))  # bits
        # bytearrays, not numpy: `was_evicted` reads one byte from Python (30 ns, not 500)
        self._evicted = bytearray(slots >> 3)  # keys evicted lately, by hash: the newer generation ...
        self._evicted_before = bytearray(slots >> 3)  # ... and the one before it
        self._slot_mask = slots - 1
        self._evicted_count = 0  # evictions marked in the newer generation
        self._evicted_capacity = max(num_blocks, 1024)
        self.children: dict[Key, list[int]] | None = None  # parent key -> indexed blocks after it (partial reuse)
        self._parent_of: list[Key | None] = []
        self._origins: dict[int, tuple[Key | None, list[int]]] = {}  # block id -> (parent key, token ids)

    def __len__(self) -> int:
        return len(self.index)

    # --- look up -----------------------------------------------------------------------------------

    def lookup(self, key: Key) -> int | None:
        """The block holding `key`, or None."""
        return self.index.get(key)

    def key_at(self, block_id: int) -> Key | None:
        """The key block `block_id` holds, or None (a query: for readers such as event feeds)."""
        return self.key_of[block_id]

    def was_evicted(self, key: Key) -> bool:
        """Whether `key` was (probably: see the module docstring) among the last `num_blocks` or more keys
        evicted; it may be cached again since."""
        i = hotpath.evicted_slot(key) & self._slot_mask
        return bool((self._evicted[i >> 3] | self._evicted_before[i >> 3]) >> (i & 7) & 1)

    def published_from(self, block_id: int) -> tuple[Key | None, list[int]] | None:
        """(parent content key or None, token ids) of the key block `block_id` holds now, as its publisher
        recorded them (`remember_origins`); None if it holds no key, or nothing was recorded."""
        return self._origins.get(block_id) if self.key_of[block_id] is not None else None

    def all_keys(self) -> list[Key]:
        """Every key in the index (a copy)."""
        return list(self.index)

    # --- children (partial reuse) ---------------------------------------------------------------

    def track_children(self) -> None:
        """Keep `children` from now on (for blocks linked after this call)."""
        if self.children is None:
            self.children = {}
            self._parent_of = [None] * len(self.key_of)

    def link(self, parents: Sequence[Key], keys: Sequence[Key], block_ids: Sequence[int]) -> None:
        """Record block_ids[i] as a child of parents[i], if it is indexed under keys[i] (a private duplicate
        is not) and not linked yet."""
        children, parent_of, key_of = self.children, self._parent_of, self.key_of
        if children is None:
            return
        for parent, key, b in zip(parents, keys, block_ids):
            if parent_of[b] is None and key_of[b] is not None and key_of[b] == key:
                children.setdefault(parent, []).append(b)
                parent_of[b] = parent

    def _unlink(self, block_ids: list[int]) -> None:
        children, parent_of = self.children, self._parent_of
        if children is None:
            return
        for b in block_ids:
            parent = parent_of[b]
            if parent is not None:
                siblings = children[parent]
                siblings.remove(b)
                if not siblings:
                    del children[parent]
                parent_of[b] = None

    # --- insert ------------------------------------------------------------------------------------

    def insert(self, keys: Sequence[Key], block_ids: Sequence[int]) -> list[int]:
        """Give block_ids[i] the key keys[i], unless the block holds a key or another block holds that key
        (then it stays private). Returns the blocks that entered the index."""
        index, key_of = self.index, self.key_of
        stored: list[int] = []
        for key, block_id in zip(keys, block_ids):
            if key_of[block_id] is None and key not in index:
                index[key] = block_id
                key_of[block_id] = key
                stored.append(block_id)
        self.keyed[stored] = True
        self.stored(stored)
        return stored

    def stored(self, stored: list[int]) -> None:
        """The backend's publishing (`hotpath.Backend.publish_computed`, `publish_rows`, run by the prefix
        cache on `arrays`) indexed the blocks `stored`: emit their events."""
        if stored and self.record_events:
            key_of = self.key_of
            self.events.extend(CacheEvent("stored", key_of[b], b) for b in stored)

    def remember_origins(
        self, chain: Sequence[Key], start: int, block_ids: Sequence[int], tokens: npt.NDArray[np.int32],
        stored: set[int],
    ) -> None:  # fmt: skip
        """Blocks `block_ids` hold table columns `start, start + 1, ...` of a sequence whose content keys are
        `chain` (`chain[0]` the root, `chain[j + 1]` block j's key), `tokens[i]` the token ids of
        `block_ids[i]`; those in `stored` just entered the index: remember each one's parent and tokens
        (`published_from`) and take it out of `stored` (a block two forked rows publish in one call is
        recorded once, from the first row, the one that indexed it). Nothing without `record_events`."""
        if not self.record_events:
            return
        origins = self._origins
        for i, block in enumerate(block_ids):
            if block in stored:
                stored.discard(block)
                j = start + i
                origins[block] = (chain[j] if j else None, tokens[i].tolist())

    # --- remove ------------------------------------------------------------------------------------

    def remove(self, block_id: int) -> None:
        """Drop an in-use block's key (its content is about to change); nothing if it has none."""
        key = self.key_of[block_id]
        if key is None:
            return
        if self.index.get(key) == block_id:
            del self.index[key]
        self._unlink([block_id])
        self.key_of[block_id] = None
        self.keyed[block_id] = False
        if self.record_events:
            self.events.append(CacheEvent("removed", key, block_id))

    def forget(self, block_ids: IntArray) -> None:
        """Eviction: drop the keys of `block_ids` (each holds one) at once, remembering them as evicted."""
        if self.record_events:
            key_of = self.key_of
            self.events.extend(CacheEvent("removed", key_of[b], b) for b in block_ids.tolist())
        if self.children is not None:
            self._unlink(block_ids.tolist())
        if self._evicted_count >= self._evicted_capacity:  # a new generation; the oldest is dropped
            self._evicted_before, self._evicted = self._evicted, bytearray(len(self._evicted))
            self._evicted_count = 0
        self._evicted_count += len(block_ids)
        self._hot.forget_keys(self.arrays, block_ids, self._evicted)  # also marks the keys in _evicted
        self.keyed[block_ids] = False

    def clear(self) -> int:
        """Drop every key; returns how many there were."""
        n = int(self.keyed.sum())
        self.index.clear()
        self.key_of[:] = [None] * len(self.key_of)
        self.keyed[:] = False
        if self.children is not None:
            self.children.clear()
            self._parent_of[:] = [None] * len(self._parent_of)
        self._origins.clear()
        if self.record_events:
            self.events.append(CacheEvent("cleared", None, None))
        return n

    def take_events(self) -> list[CacheEvent]:
        events = list(self.events)
        self.events.clear()
        return events

    # --- checks ------------------------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        """Everything observable, for atomicity tests."""
        return (self.keyed.tobytes(), tuple(self.key_of), tuple(sorted(self.index.items(), key=repr)), len(self.events))

    def check_invariants(self) -> None:
        has_key = np.array([k is not None for k in self.key_of], dtype=bool)
        if not np.array_equal(has_key, self.keyed):
            raise InvariantError("prefix index: keyed flags and keys disagree")
        for block_id in np.flatnonzero(self.keyed).tolist():
            key = self.key_of[block_id]
            if key is None or self.index.get(key) != block_id:
                raise InvariantError(f"prefix index: block {block_id} holds a key the index does not map back to it")
        if self.children is not None:
            linked = [(p, b) for p, blocks in self.children.items() for b in blocks]
            if len(linked) != sum(p is not None for p in self._parent_of) or any(
                self._parent_of[b] != p or self.key_of[b] is None for p, b in linked
            ):
                raise InvariantError("prefix index: a child link names an unindexed block or disagrees with its parent")
        if len(self.index) != int(self.keyed.sum()):
            raise InvariantError(
                f"prefix index: {len(self.index)} keys for {int(self.keyed.sum())} keyed blocks (a stale entry)"
            )
