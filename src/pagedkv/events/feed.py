"""Feeding a manager's cache events into one `EventLog` per KV cache group, as the GPU medium.

`EventFeed` is the one feed for every manager that records events (`KVManager.records_events`): a uniform
model is one group and one log, a hybrid one has a log per group. Each group's copies go to that group's
log, so copies are counted per (key, group), as vLLM's hybrid cache counts them; the log keys are the plain
content keys (the ones a router computes), so a uniform and a one-group hybrid manager fed the same
requests produce the same events. A stored block's parent and token ids are what its publisher recorded in
the prefix index (`PrefixIndex.published_from`: the content key of the block before it in the publishing
sequence, None for a sequence's first block), exact whether or not that sequence is still alive at the
poll; a block without a record is sent as a root without tokens and counted in `orphans`.

A record is read while the block still holds the key: a block stored and then evicted and reused before the
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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.core.errors import InvalidArgumentError, InvariantError
from pagedkv.core.group_keys import GroupCacheEvent, group_key, split_key
from pagedkv.core.prefix import Key
from pagedkv.events.log import EventLog
from pagedkv.events.wire import GPU

if TYPE_CHECKING:
    from pagedkv.core.prefix_index import CacheEvent
    from pagedkv.core.protocol import KVManager


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
        self.keys, self.tokens, self.parent, self.known = [], [], None, True


class EventFeed:
    """A manager's GPU medium, one log per KV cache group; see the module docstring."""

    def __init__(self, manager: KVManager, logs: list[EventLog], *, medium: str = GPU) -> None:
        index = manager.index
        if index is None or not manager.records_events:
            raise InvalidArgumentError(
                "kv_events need a manager with prefix caching on, built with record_events=True"
            )
        bs, n = manager.block_size, manager.num_groups
        if len(logs) != n or any(log.block_size != bs for log in logs):
            got = [log.block_size for log in logs]
            raise InvalidArgumentError(f"a feed takes one log of block_size {bs} per KV cache group ({n}); got {got}")
        self.manager = manager
        self.index = index
        self.logs = logs
        self.medium = medium
        self.grouped = manager.grouped_events  # events name their group; the index holds group-qualified keys
        self._epoch = manager.epoch
        self._stale: set[tuple[int, Key]] = set()  # (group, key) of earlier epochs still in the pool
        self.orphans = 0  # blocks reported without their parent (no origin recorded)

    @property
    def log(self) -> EventLog:
        """The log of a one-group manager (a uniform model)."""
        if len(self.logs) != 1:
            raise InvalidArgumentError(f"this feed has {len(self.logs)} logs, one per KV cache group: read feed.logs")
        return self.logs[0]

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
        chains = [Chain(self, g) for g in range(len(self.logs))]
        unseen: set[tuple[int, Key]] = set()  # stored then reused before this poll: neither end is reported
        for e in events:
            if e.kind == "cleared":
                for chain in chains:
                    chain.flush()
                self._cleared()
                continue
            g = e.group if isinstance(e, GroupCacheEvent) else 0
            if e.key is None or e.block_id is None or g is None:
                raise InvariantError(f"event feed: the manager's {e.kind} event has no key, block or group")
            if e.kind == "stored":
                if not self._stored(chains[g], e.key, e.block_id):
                    unseen.add((g, e.key))
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

    def _stored(self, chain: Chain, key: Key, block_id: int) -> bool:
        """Add a stored block to its group's chain, with the parent and tokens its publisher recorded; False
        (nothing added) when the block no longer holds the key (stored then reused before this poll)."""
        index = self.index
        if index.key_at(block_id) != (group_key(key, chain.group) if self.grouped else key):
            return False
        origin = index.published_from(block_id)
        if origin is None:
            self.orphans += 1
            chain.add(key, None, None)
        else:
            chain.add(key, origin[0], origin[1])
        return True

    def _cleared(self) -> None:
        self._stale.clear()
        for log in self.logs:
            log.cleared(self.medium)

    def device_keys(self) -> set[Key]:
        """The content keys the manager's pool holds now that can still hit (in some group): its index less
        the keys of earlier epochs (they stay in the pool until evicted, and their removals are never
        reported)."""
        out: set[Key] = set()
        for k in self.index.all_keys():
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
        for log in self.logs:
            log.cleared(self.medium)
        return epoch
