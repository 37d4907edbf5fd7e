"""Feeding a manager's cache events into one `EventLog` per KV cache group, as the GPU medium.

`EventFeed` is the one feed: a uniform manager is one group (`ManagerFeed`, `manager_feed.py`), a hybrid
one has a log per group (`GroupFeed`, here). Each group's copies go to that group's log, so copies are
counted per (key, group), as vLLM's hybrid cache counts them; the log keys are the plain content keys (the
ones a uniform manager and a router compute), so a uniform and a one-group hybrid manager fed the same
requests produce the same events. What differs between managers is only where a stored block's parent and
token ids come from (`_origin`):

- `GroupFeed`: what the hybrid manager recorded when it published the block
  (`HybridKVManager.published_from`: the content key of the block before it in the publishing sequence,
  None for a sequence's first block);
- `ManagerFeed`: derived from the paged manager's live rows and token mirror (see `manager_feed.py`).

Both are valid while the block still holds the key: a block stored and then evicted and reused before the
poll is dropped with its removal (the consumer never saw the key). Consecutive stored blocks of one group
that chain (each the parent of the next) go out as one event; the log sends a parent only while some
medium of that group's log holds it (a sliding group's early blocks may be gone: the chain is a root).

A `cleared` event clears every group's log (`EngineEvents` merges their batches and sends one
`AllBlocksCleared`). `reset()` and `bump_epoch()` wrap the manager's own: both drain first, then send
`AllBlocksCleared` (the log re-announces what other media hold). Keys of an earlier epoch stay in the pool
until evicted but can never hit again; their later removals are swallowed. Do not call
`manager.bump_epoch()` directly while a feed is attached: `poll` then raises `InvalidArgumentError`, since
it can no longer tell old keys from new ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group_keys import GroupCacheEvent, group_key, split_key
from pagedkv.core.prefix import Key
from pagedkv.events.log import EventLog
from pagedkv.events.wire import GPU

if TYPE_CHECKING:
    from pagedkv.core.hybrid import HybridKVManager
    from pagedkv.core.prefix_index import CacheEvent, PrefixIndex
    from pagedkv.core.protocol import KVManager

    class FeedSource(KVManager, Protocol):
        """A manager whose events a feed reads: the protocol, and the index it keys blocks in."""

        @property
        def index(self) -> PrefixIndex: ...


RECENT = 256  # candidate parents kept for blocks whose sequence is gone (`ManagerFeed`'s search)
Origin = tuple[Key | None, Sequence[int] | None]  # a stored block's (parent key, token ids); None: unknown


class Chain:
    """Consecutive stored blocks of one group, each the parent of the next: one log call."""

    def __init__(self, feed: EventFeed, group: int) -> None:
        self.feed, self.group = feed, group
        self.keys: list[Key] = []
        self.tokens: list[int] = []
        self.parent: Key | None = None
        self.known = True  # every block's tokens are known

    def add(self, key: Key, parent: Key | None, tokens: Sequence[int] | None) -> None:
        if not self.keys or parent is None or parent != self.keys[-1]:
            self.flush()
            self.parent = parent
        self.keys.append(key)
        if tokens is None:
            self.known = False
        else:
            self.tokens.extend(tokens)

    def flush(self) -> None:
        if self.keys:
            feed = self.feed
            feed.logs[self.group].stored(
                feed.medium, self.keys, parent=self.parent, token_ids=self.tokens if self.known else None
            )
            feed.recent.extend(self.keys[-RECENT:])
        self.keys, self.tokens, self.parent, self.known = [], [], None, True


class EventFeed:
    """A manager's GPU medium, one log per KV cache group; see the module docstring."""

    def __init__(self, manager: FeedSource, logs: list[EventLog], *, medium: str = GPU) -> None:
        if not manager.records_events:
            raise InvalidArgumentError("the manager does not record events: build it with record_events=True")
        bs, n = manager.block_size, manager.num_groups
        if len(logs) != n or any(log.block_size != bs for log in logs):
            got = [log.block_size for log in logs]
            raise InvalidArgumentError(f"a feed takes one log of block_size {bs} per KV cache group ({n}); got {got}")
        self.manager = manager
        self.logs = logs
        self.medium = medium
        self.grouped = manager.grouped_events  # events name their group; the index holds group-qualified keys
        self._epoch = manager.epoch
        self._stale: set[tuple[int, Key]] = set()  # (group, key) of earlier epochs still in the pool
        self.recent: deque[Key] = deque(maxlen=RECENT)  # keys stored lately (`ManagerFeed`'s parent search)
        self.orphans = 0  # blocks reported without their parent (it could not be derived)

    # --- what a subclass says: where a stored block's parent and tokens come from ---------------------

    def _prepare(self, events: Sequence[CacheEvent | GroupCacheEvent]) -> None:
        """Called once per poll with its events, before `_origin` (a batched lookup may go here)."""

    def _origin(self, block_id: int, key: Key, chain: Chain) -> Origin:
        raise NotImplementedError

    # --- the feed ------------------------------------------------------------------------------------

    def poll(self, drained: Sequence[CacheEvent | GroupCacheEvent] | None = None) -> int:
        """Move the manager's pending events into the logs; returns how many cache events were read.

        `drained`: events another reader already took from `manager.take_events()`, in order (the engine's
        tiering is the one reader when tiers are on); None drains the manager here."""
        m = self.manager
        if m.epoch != self._epoch:
            raise InvalidArgumentError("the manager's epoch changed behind the feed: use the feed's bump_epoch()")
        events = m.take_events() if drained is None else drained
        if not events:
            return 0
        self._prepare(events)
        chains = [Chain(self, g) for g in range(len(self.logs))]
        unseen: set[tuple[int, Key]] = set()  # stored then reused before this poll: neither end is reported
        key_at, grouped = m.index.key_at, self.grouped
        for e in events:
            if e.kind == "cleared":
                for chain in chains:
                    chain.flush()
                self._cleared()
                continue
            g = e.group if isinstance(e, GroupCacheEvent) else 0
            assert e.key is not None and e.block_id is not None and g is not None, "feed: an event without key, block or group"
            if e.kind == "stored":
                if key_at(e.block_id) != (group_key(e.key, g) if grouped else e.key):
                    unseen.add((g, e.key))
                    continue
                parent, tokens = self._origin(e.block_id, e.key, chains[g])
                chains[g].add(e.key, parent, tokens)
                continue
            chains[g].flush()
            if (g, e.key) in unseen:
                unseen.discard((g, e.key))
            elif (g, e.key) in self._stale:
                self._stale.discard((g, e.key))
            else:
                self.logs[g].removed(self.medium, [e.key])
        for chain in chains:
            chain.flush()
        return len(events)

    def _cleared(self) -> None:
        self._stale.clear()
        self.recent.clear()
        for log in self.logs:
            log.cleared(self.medium)

    def device_keys(self) -> set[Key]:
        """The content keys the manager's pool holds now that can still hit (in some group): its index less
        the keys of earlier epochs (they stay in the pool until evicted, and their removals are never
        reported)."""
        out: set[Key] = set()
        for k in self.manager.index.all_keys():
            content, g = split_key(k) if self.grouped else (k, 0)
            if (g, content) not in self._stale:
                out.add(content)
        return out

    def reset(self) -> int:
        """`manager.reset_prefix_cache()`, reported; returns how many keys were dropped."""
        self.poll()
        n = self.manager.reset_prefix_cache()
        self.poll()
        return n

    def bump_epoch(self) -> int:
        """`manager.bump_epoch()`, reported as `AllBlocksCleared` for this replica's GPU medium."""
        self.poll()
        self._stale |= {(g, k) for g, log in enumerate(self.logs) for k in log.holds(self.medium)}
        epoch = self.manager.bump_epoch()
        self._epoch = epoch
        self.recent.clear()
        for log in self.logs:
            log.cleared(self.medium)
        return epoch


class GroupFeed(EventFeed):
    """A `HybridKVManager`'s GPU medium: parents and tokens as the manager recorded them at publishing."""

    manager: HybridKVManager

    def __init__(self, manager: HybridKVManager, logs: list[EventLog], *, medium: str = GPU) -> None:
        super().__init__(manager, logs, medium=medium)

    def _origin(self, block_id: int, key: Key, chain: Chain) -> Origin:
        origin = self.manager.published_from(block_id)
        if origin is None:
            return None, None
        parent, tokens = origin
        return parent, tokens if len(tokens) == self.manager.block_size else None
