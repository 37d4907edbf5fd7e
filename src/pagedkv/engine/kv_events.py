"""The engine's KV events: one `EventLog` fed by every medium the engine holds blocks in.

`EngineConfig(kv_events=True)` gives the engine an `EngineEvents`; `Engine.take_event_batch()` hands out the
events since the last call as one vLLM-compatible `EventBatch` (publish it with
`pagedkv.events.publisher.ZmqEventPublisher`). Media:

- GPU: the manager's `CacheEvent`s, through a `ManagerFeed`. There is one reader of
  `manager.take_events()`: the tiering when tiers are on (it needs the evictions and publications
  itself; the engine builds it with `keep_device_events=True` and this class takes what it drained with
  `tiering.take_device_events()`), else this class.
- CPU, DISK, REMOTE: the tiers' `TierEvent`s (`tiering.take_events()`), which carry only the key. A
  block's parent and tokens are those the log recorded when a medium first reported it: a block written
  back to the host is, in the same sync, removed from the device, so `poll` reads what the log knows of
  the keys it is about to see leave (and of every key in the tier events) before feeding the device's
  removals; a key that moves from CPU to DISK keeps them too. The device's events are fed first, then the
  tiers', each in the order they happened (the per-medium sets are exact at the end of every poll).

A hybrid model's cache (`HybridKVManager`) keeps one log per KV cache group, fed by a `GroupFeed`
(`pagedkv.events.group_feed`), so copies are counted per (key, group), and every event names its group
in `group_idx`, as vLLM's hybrid cache does; the block hashes are the plain content keys a uniform engine
publishes, with their parent and token ids as a uniform engine's. With tiers, the tiers hold each group's
copy under its group-qualified key (`pagedkv.core.group_keys`): a tier event goes to that group's log, by
the same rules as above (a key's parent and tokens are what that group's log recorded).

`poll()` runs at the end of every engine step (after `tiering.after_update`) and before every
`take_batch()`. The remote tier reports the keys this replica wrote; keys Redis evicts by itself are
reported `removed` when a lookup, a write-through check or a load finds them gone, or at once by
`audit_remote()`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group_keys import GroupCacheEvent, split_key
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.manager import PagedKVManager
from pagedkv.core.prefix import Key
from pagedkv.core.prefix_index import CacheEvent
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventLog, ManagerFeed
from pagedkv.events.group_feed import GroupFeed
from pagedkv.events.wire import Event

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager
    from pagedkv.engine.tiering import EngineTiering


class GroupBlockStored(BlockStored, tag="BlockStored"):
    """`BlockStored` of one KV cache group: vLLM's `group_idx` trails the fields (a decoder without it
    ignores it; a uniform engine's events keep their length)."""

    group_idx: int | None = None


class GroupBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class EngineEvents:
    def __init__(
        self, manager: KVManager, block_size: int, tiering: EngineTiering | None = None, *,
        data_parallel_rank: int = 0,
    ) -> None:  # fmt: skip
        self.feed: ManagerFeed | GroupFeed
        if isinstance(manager, HybridKVManager):
            self.logs = [EventLog(block_size, data_parallel_rank=data_parallel_rank) for _ in manager.groups]
            self.feed = GroupFeed(manager, self.logs)
        elif isinstance(manager, PagedKVManager):
            self.logs = [EventLog(block_size, data_parallel_rank=data_parallel_rank)]
            self.feed = ManagerFeed(manager, self.logs[0])
        else:
            raise InvalidArgumentError("kv_events need the paged or hybrid allocator with prefix caching on")
        self.grouped = isinstance(manager, HybridKVManager)
        self.log = self.logs[0]
        self.tiering = tiering  # when set, built with keep_device_events=True: it drains the manager
        self._events: list[Event] = []  # a hybrid engine's merged batch so far

    def poll(self) -> None:
        """Move every medium's pending events into the log(s)."""
        tiering = self.tiering
        if tiering is None:
            self.feed.poll()
        else:
            self._poll_tiers(tiering)
        if self.grouped:
            self._merge()

    def _route(self, key: bytes) -> tuple[int, Key]:
        """The group (log index) and content key of a tier's key: a hybrid engine's tiers keep each group's
        copy under its group-qualified key (`core/group_keys.py`)."""
        if not self.grouped:
            return 0, key
        content, group = split_key(key)
        return group, content

    def _poll_tiers(self, tiering: EngineTiering) -> None:
        """The device's events (drained by the tiering), then the tiers', each in the order they happened."""
        drained = tiering.take_device_events()
        tier_events = [(e, *self._route(e.key)) for e in tiering.take_events()]
        leaving = [
            (e.group if isinstance(e, GroupCacheEvent) and e.group is not None else 0, e.key)
            for e in drained if e.kind == "removed" and e.key is not None
        ]  # fmt: skip
        known: dict[tuple[int, Key], tuple[Key | None, tuple[int, ...]]] = {}
        for g, key in leaving + [(g, key) for _, g, key in tier_events]:
            info = self.logs[g].known(key)
            if info is not None:
                known[g, key] = info
        if isinstance(self.feed, GroupFeed):
            self.feed.poll([e for e in drained if isinstance(e, GroupCacheEvent)])
        else:
            self.feed.poll([e for e in drained if isinstance(e, CacheEvent)])
        for e, g, key in tier_events:  # in the order they happened
            log = self.logs[g]
            if e.kind == "removed":
                log.removed(e.medium, [key])
                continue
            info = log.known(key) or known.get((g, key))
            if info is None:  # cannot happen: every tier copy comes from a block the device reported
                log.stored(e.medium, [key])
            else:
                parent, tokens = info
                log.stored(e.medium, [key], parent=parent, token_ids=tokens or None)

    def _merge(self) -> None:
        """A hybrid engine: every group log's events into one list, each with its `group_idx`. A clear
        clears every group's log at once: the groups' events before it, one `AllBlocksCleared`, then the
        groups' events after it (the re-announcements of what the tiers hold)."""
        segments: list[list[list[Event]]] = []
        for g, log in enumerate(self.logs):
            batch = log.take_batch()
            segs: list[list[Event]] = [[]]
            for ev in batch.events if batch is not None else ():
                if isinstance(ev, AllBlocksCleared):
                    segs.append([])
                    continue
                group_type = GroupBlockStored if isinstance(ev, BlockStored) else GroupBlockRemoved
                segs[-1].append(group_type(**msgspec.structs.asdict(ev), group_idx=g))
            segments.append(segs)
        for i in range(max(len(segs) for segs in segments)):
            if i:
                self._events.append(AllBlocksCleared())
            for segs in segments:
                self._events.extend(segs[i] if i < len(segs) else ())

    def take_batch(self) -> EventBatch | None:
        """Every medium's events since the last call, as one batch (None if there are none)."""
        self.poll()
        if not self.grouped:
            return self.log.take_batch()
        if not self._events:
            return None
        events, self._events = self._events, []
        return EventBatch(time.time(), events, self.log.data_parallel_rank)

    def audit_remote(self) -> int:
        """Ask the remote store which of the keys this replica reported are still there (one round trip);
        those it evicted by itself are reported removed. Returns how many were gone (0 without one)."""
        return self.tiering.audit_remote() if self.tiering is not None else 0
