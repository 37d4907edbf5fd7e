"""Feeding a `PagedKVManager`'s cache events into an `EventLog` as the GPU medium.

The manager records `CacheEvent(kind, key, block_id)` (`record_events=True`) and hands them out with
`take_events()`. A `BlockStored` also wants the block's token ids and its parent's key, which `CacheEvent`
does not carry; `ManagerFeed.poll` derives them from what the manager exposes when it drains:

- token ids: the manager's mirror of each block's tokens (`block_tokens[block_id]`), valid while the block
  still holds the key (if it was evicted and reused before the poll, its removal follows in the same drain and
  the pair is dropped: the consumer never saw the key, and never needs to);
- parent: the key before it in the `BlockKeys` of a live sequence holding the block (the first block of a
  sequence has no parent); for a block whose sequence finished before the poll, the parent is searched among
  the keys recently stored and the root of an unsalted sequence (one hash each); if that fails the block is
  reported as a root. Poll between `mark_computed` and `free` (once per engine step) and every parent is exact.

`reset()` and `bump_epoch()` wrap the manager's own: both drain first, then send `AllBlocksCleared` (the log
re-announces what other media hold). Keys of an earlier epoch stay in the pool until evicted but can never
hit again; their later removals are swallowed. Do not call `manager.bump_epoch()` directly while a feed is
attached: `poll` then raises `InvalidArgumentError`, since it can no longer tell old keys from new ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.manager import PagedKVManager
from pagedkv.core.pool import CacheEvent
from pagedkv.core.prefix import Key, root_key
from pagedkv.events.group_feed import GroupFeed
from pagedkv.events.log import EventLog
from pagedkv.events.wire import GPU

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager

_RECENT = 256  # candidate parents kept for blocks whose sequence is gone


def feed_for(manager: KVManager, logs: list[EventLog], *, medium: str = GPU) -> ManagerFeed | GroupFeed:
    """The feed of `manager`'s cache events into `logs`, one log per KV cache group (`manager.num_groups`):
    the one place that knows which feed reads which manager (the engine asks the protocol only)."""
    if not manager.records_events:
        raise InvalidArgumentError(
            "kv_events need the paged or hybrid allocator with prefix caching on, built with record_events=True"
        )
    if len(logs) != manager.num_groups:
        raise InvalidArgumentError(f"a feed takes one log per KV cache group: {manager.num_groups}, got {len(logs)}")
    if isinstance(manager, HybridKVManager):
        return GroupFeed(manager, logs, medium=medium)
    if isinstance(manager, PagedKVManager):
        return ManagerFeed(manager, logs[0], medium=medium)
    raise InvalidArgumentError(f"no event feed reads a {type(manager).__name__}")


class ManagerFeed:
    def __init__(self, manager: PagedKVManager, log: EventLog, *, medium: str = GPU) -> None:
        if not manager.index.record_events:
            raise InvalidArgumentError("the manager does not record events: build it with record_events=True")
        if log.block_size != manager.block_size:
            raise InvalidArgumentError(f"log block_size {log.block_size} != manager block_size {manager.block_size}")
        self.manager = manager
        self.log = log
        self.medium = medium
        self._epoch = manager.epoch
        self._stale: set[Key] = set()  # keys of earlier epochs still in the pool
        self._recent: deque[Key] = deque(maxlen=_RECENT)
        self.orphans = 0  # blocks reported without their parent (it could not be derived)

    def poll(self, drained: list[CacheEvent] | None = None) -> int:
        """Move the manager's pending events into the log; returns how many cache events were read.

        `drained`: events another reader already took from `manager.take_events()`, in order (the engine's
        tiering is the one reader when tiers are on); None drains the manager here."""
        m = self.manager
        if m.epoch != self._epoch:
            raise InvalidArgumentError("the manager's epoch changed behind the feed: use ManagerFeed.bump_epoch()")
        events = m.take_events() if drained is None else drained
        if not events:
            return 0
        index, log = m.index, self.log
        stored_ids = [e.block_id for e in events if e.kind == "stored" and e.block_id is not None]
        parents = self._parents_in_live_rows(np.array(stored_ids, dtype=np.int64)) if stored_ids else {}
        unseen: set[Key] = set()  # stored then reused before this poll: neither end is reported
        chain: list[Key] = []  # consecutive stored blocks, each the parent of the next: one log call
        chain_parent: Key | None = None
        chain_tokens: list[int] = []
        bs = m.block_size

        def flush() -> None:
            if chain:
                log.stored(self.medium, chain, parent=chain_parent, token_ids=chain_tokens)
                self._recent.extend(chain[-_RECENT:])
                chain.clear()
                chain_tokens.clear()

        for e in events:
            if e.kind == "stored":
                assert e.key is not None and e.block_id is not None, "manager feed: a stored event without key or block"
                if index.key_at(e.block_id) != e.key:
                    unseen.add(e.key)
                    continue
                tokens = m.block_tokens[e.block_id]
                parent = self._parent_of(e.block_id, e.key, tokens, parents, chain, flush)
                if not chain or parent is None or parent != chain[-1]:
                    flush()
                    chain_parent = parent
                chain.append(e.key)
                chain_tokens.extend(tokens.tolist()[:bs])
                continue
            flush()
            self._removed_or_cleared(e, unseen)
        flush()
        return len(events)

    def _parent_of(
        self,
        block_id: int,
        key: Key,
        tokens: npt.NDArray[np.int32],
        parents: dict[int, Key | None],
        chain: list[Key],
        flush: Callable[[], None],
    ) -> Key | None:
        """A stored block's parent: its live row's previous key, else the chain being built, else a search
        of what the log holds (the chain is flushed first, so it is among the candidates)."""
        if block_id in parents:
            return parents[block_id]
        if chain and self._chains(chain[-1], key, tokens):
            return chain[-1]
        flush()
        return self._search_parent(key, tokens)

    def _removed_or_cleared(self, e: CacheEvent, unseen: set[Key]) -> None:
        """Report a removal (unless the key was never reported, or belongs to an earlier epoch) or a clear."""
        if e.kind == "cleared":
            self._stale.clear()
            self._recent.clear()
            self.log.cleared(self.medium)
            return
        assert e.key is not None, "manager feed: a removed event without its key"
        if e.key in unseen:
            unseen.discard(e.key)
        elif e.key in self._stale:
            self._stale.discard(e.key)
        else:
            self.log.removed(self.medium, [e.key])

    def device_keys(self) -> set[Key]:
        """The keys the manager's pool holds now that can still hit: its index less the keys of earlier
        epochs (they stay in the pool until evicted, and their removals are never reported)."""
        return {k for k in self.manager.index.all_keys() if k not in self._stale}

    def reset(self) -> int:
        """`manager.reset_prefix_cache()`, reported; returns how many keys were dropped."""
        self.poll()
        n = self.manager.reset_prefix_cache()
        self.poll()
        return n

    def bump_epoch(self) -> int:
        """`manager.bump_epoch()`, reported as `AllBlocksCleared` for this replica's GPU medium."""
        self.poll()
        self._stale |= set(self.log.holds(self.medium))
        epoch = self.manager.bump_epoch()
        self._epoch = epoch
        self._recent.clear()
        self.log.cleared(self.medium)
        return epoch

    # --- parents ---------------------------------------------------------------------------------

    def _parents_in_live_rows(self, ids: np.ndarray) -> dict[int, Key | None]:
        """block id -> parent key, for the blocks some live sequence holds at a position its keys cover."""
        m = self.manager
        t = m.tables
        rows = np.flatnonzero(t.on_device)
        if len(rows) == 0:
            return {}
        sub = t.table[rows]
        cols = np.arange(sub.shape[1])
        hit = (cols[None, :] < t.num_blocks[rows][:, None]) & np.isin(sub, ids)
        out: dict[int, Key | None] = {}
        index, by_row = m.index, m.prefix.by_row
        for r, c in zip(*np.nonzero(hit)):
            block = int(sub[r, c])
            keys = by_row[int(rows[r])] if int(rows[r]) < len(by_row) else None
            if keys is None or len(keys.keys) <= c + 1 or keys.keys[c + 1] != index.key_at(block):
                continue
            out[block] = keys.keys[c] if c > 0 else None
        return out

    def _chains(self, parent: Key, key: Key, tokens: np.ndarray) -> bool:
        data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        return bool(self.manager.prefix.key_fn(parent, data, b"") == key)

    def _search_parent(self, key: Key, tokens: np.ndarray) -> Key | None:
        prefix = self.manager.prefix
        data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        fn = prefix.key_fn
        if fn(root_key(fn, prefix.epoch, b"", b""), data, b"") == key:
            return None  # the first block of an unsalted sequence
        for cand in reversed(self._recent):
            if self.log.is_held(cand) and fn(cand, data, b"") == key:
                return cand
        self.orphans += 1
        return None
