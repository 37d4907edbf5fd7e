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

A hybrid model's cache (`HybridKVManager`, without tiers: the config refuses both at once) goes through
`GroupEvents`: one log per KV cache group, so copies are counted per (key, group), and every event names
its group in `group_idx`, as vLLM's hybrid cache does; the block hashes are the plain content keys a
uniform engine publishes. Its chains are sent as roots without token ids (the manager's events carry
the block, not the sequence it was published from).

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
from pagedkv.core.hybrid import HybridKVManager
from pagedkv.core.manager import PagedKVManager
from pagedkv.core.prefix import Key
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventLog, ManagerFeed
from pagedkv.events.wire import GPU, Event

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager
    from pagedkv.engine.tiering import EngineTiering


class GroupBlockStored(BlockStored, tag="BlockStored"):
    """`BlockStored` of one KV cache group: vLLM's `group_idx` trails the fields (a decoder without it
    ignores it; a uniform engine's events keep their length)."""

    group_idx: int | None = None


class GroupBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class GroupEvents:
    """A hybrid manager's GPU events, one `EventLog` per KV cache group, merged into one batch whose events
    carry `group_idx` (see the module docstring)."""

    def __init__(self, manager: HybridKVManager, block_size: int, *, data_parallel_rank: int = 0) -> None:
        if not manager.index.record_events:
            raise InvalidArgumentError("the manager does not record events: build it with record_events=True")
        self.manager = manager
        self.logs = [EventLog(block_size, data_parallel_rank=data_parallel_rank) for _ in manager.groups]
        self._events: list[Event] = []
        self._cleared = False

    def poll(self) -> None:
        for e in self.manager.take_events():
            if e.kind == "cleared":  # everything before it first, then one AllBlocksCleared for every group
                self._drain()
                for log in self.logs:
                    log.cleared(GPU)
                self._cleared = True
            elif e.key is not None and e.group is not None:
                if e.kind == "stored":
                    self.logs[e.group].stored(GPU, [e.key])
                else:
                    self.logs[e.group].removed(GPU, [e.key])
        self._drain()

    def _drain(self) -> None:
        for g, log in enumerate(self.logs):
            batch = log.take_batch()
            for ev in batch.events if batch is not None else ():
                if isinstance(ev, AllBlocksCleared):
                    if self._cleared:
                        self._events.append(ev)
                        self._cleared = False
                    continue
                group_type = GroupBlockStored if isinstance(ev, BlockStored) else GroupBlockRemoved
                self._events.append(group_type(**msgspec.structs.asdict(ev), group_idx=g))

    def take_batch(self) -> EventBatch | None:
        self.poll()
        if not self._events:
            return None
        events, self._events = self._events, []
        return EventBatch(time.time(), events, self.logs[0].data_parallel_rank)


class EngineEvents:
    def __init__(
        self, manager: KVManager, block_size: int, tiering: EngineTiering | None = None, *,
        data_parallel_rank: int = 0,
    ) -> None:  # fmt: skip
        self.groups: GroupEvents | None = None
        if isinstance(manager, HybridKVManager) and tiering is None:
            self.groups = GroupEvents(manager, block_size, data_parallel_rank=data_parallel_rank)
            self.log, self.tiering = self.groups.logs[0], None
            return
        if not isinstance(manager, PagedKVManager):
            raise InvalidArgumentError("kv_events need the paged allocator with prefix caching on")
        self.log = EventLog(block_size, data_parallel_rank=data_parallel_rank)
        self.feed = ManagerFeed(manager, self.log)
        self.tiering = tiering  # when set, built with keep_device_events=True: it drains the manager

    def poll(self) -> None:
        """Move every medium's pending events into the log."""
        if self.groups is not None:
            self.groups.poll()
            return
        tiering, log = self.tiering, self.log
        if tiering is None:
            self.feed.poll()
            return
        drained = tiering.take_device_events()
        tier_events = tiering.take_events()
        leaving = {e.key for e in drained if e.kind == "removed" and e.key is not None}
        known: dict[Key, tuple[Key | None, tuple[int, ...]]] = {}
        for key in leaving | {e.key for e in tier_events}:
            info = log.known(key)
            if info is not None:
                known[key] = info
        self.feed.poll(drained)
        for e in tier_events:  # in the order they happened
            if e.kind == "removed":
                log.removed(e.medium, [e.key])
                continue
            info = log.known(e.key) or known.get(e.key)
            if info is None:  # cannot happen: every tier copy comes from a block the device reported
                log.stored(e.medium, [e.key])
            else:
                parent, tokens = info
                log.stored(e.medium, [e.key], parent=parent, token_ids=tokens or None)

    def take_batch(self) -> EventBatch | None:
        """Every medium's events since the last call, as one batch (None if there are none)."""
        if self.groups is not None:
            return self.groups.take_batch()
        self.poll()
        return self.log.take_batch()

    def audit_remote(self) -> int:
        """Ask the remote store which of the keys this replica reported are still there (one round trip);
        those it evicted by itself are reported removed. Returns how many were gone (0 without one)."""
        remote = self.tiering.store.remote if self.tiering is not None else None
        if remote is None or not hasattr(remote, "audit"):
            return 0
        return int(remote.audit())
