"""Feeding a `PagedKVManager`'s cache events into an `EventLog` as the GPU medium: the one feed
(`group_feed.EventFeed`) over one group, with parents and tokens derived from the manager's rows.

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

`reset()`, `bump_epoch()` and the epoch rules are `EventFeed`'s (`group_feed.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.manager import PagedKVManager
from pagedkv.core.prefix import Key, root_key
from pagedkv.events.group_feed import Chain, EventFeed, GroupFeed, Origin
from pagedkv.events.log import EventLog
from pagedkv.events.wire import GPU

if TYPE_CHECKING:
    from pagedkv.core.group_keys import GroupCacheEvent
    from pagedkv.core.prefix_index import CacheEvent
    from pagedkv.core.protocol import KVManager


def feed_for(manager: KVManager, logs: list[EventLog], *, medium: str = GPU) -> EventFeed:
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


class ManagerFeed(EventFeed):
    """A `PagedKVManager`'s GPU medium: one group, one log (`log`); parents derived as the module says."""

    manager: PagedKVManager

    def __init__(self, manager: PagedKVManager, log: EventLog, *, medium: str = GPU) -> None:
        super().__init__(manager, [log], medium=medium)
        self.log = log
        self._parents: dict[int, Key | None] = {}

    def _prepare(self, events: Sequence[CacheEvent | GroupCacheEvent]) -> None:
        stored = [e.block_id for e in events if e.kind == "stored" and e.block_id is not None]
        self._parents = self._parents_in_live_rows(np.array(stored, dtype=np.int64)) if stored else {}

    def _origin(self, block_id: int, key: Key, chain: Chain) -> Origin:
        """A stored block's tokens (the manager's mirror) and parent: its live row's previous key, else the
        chain being built, else a search of what the log holds (the chain is flushed first, so it is among
        the candidates)."""
        tokens = self.manager.block_tokens[block_id]
        if block_id in self._parents:
            parent = self._parents[block_id]
        elif chain.keys and self._chains(chain.keys[-1], key, tokens):
            parent = chain.keys[-1]
        else:
            chain.flush()
            parent = self._search_parent(key, tokens)
        return parent, tokens.tolist()[: self.manager.block_size]

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
        for cand in reversed(self.recent):
            if self.log.is_held(cand) and fn(cand, data, b"") == key:
                return cand
        self.orphans += 1
        return None
