"""The engine's KV events: one `EventLog` fed by every medium the engine holds blocks in.

`EngineConfig(kv_events=True)` gives the engine an `EngineEvents`; `Engine.take_event_batch()` hands out the
events since the last call as one vLLM-compatible `EventBatch` (publish it with
`pagedkv.events.publisher.ZmqEventPublisher`). Media:

- GPU: the manager's cache events, through its feed (`events.feed.EventFeed`). One reader of
  `manager.take_events()`: the tiering when tiers are on (it needs the evictions and publications
  itself; the engine builds it with `keep_device_events=True` and this class takes what it drained with
  `tiering.take_device_events()`), else this class.
- CPU, DISK, REMOTE: the tiers' `TierEvent`s (`tiering.take_events()`), which carry only the key. A
  block's parent and tokens are those the log recorded when a medium first reported it: a block written
  back to the host is, in the same sync, removed from the device, so `poll` reads what the log knows of
  the keys it is about to see leave (and of every key in the tier events) before feeding the device's
  removals; a key that moves from CPU to DISK keeps them too. The device's events are fed first, then the
  tiers', in the order they happened except that a block's store waits for its parent's last store in the
  same poll (`_parents_first`: write-backs come tail first), so a block goes out with its parent whenever
  the parent reaches some medium in that poll (the per-medium sets are exact at the end of every poll).
  With `hash_fn="fast"` the device's keys are ints and the tiers hold them as 8 bytes: a tier event's key
  is turned back into the int (`int_keys`).

A hybrid model's cache (`KVManager.grouped_events`) keeps one log per KV cache group, fed by the same `EventFeed`
(`pagedkv.events.feed`), so copies are counted per (key, group), and every event names its group
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

import heapq
import time
from typing import TYPE_CHECKING

import msgspec

from pagedkv.core.group_keys import GroupCacheEvent, split_key
from pagedkv.core.prefix import Key
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventLog
from pagedkv.events.feed import EventFeed
from pagedkv.events.wire import Event

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager
    from pagedkv.engine.tiering import EngineTiering
    from pagedkv.tiers.events import TierEvent


class GroupBlockStored(BlockStored, tag="BlockStored"):
    """`BlockStored` of one KV cache group: vLLM's `group_idx` trails the fields (a decoder without it
    ignores it; a uniform engine's events keep their length)."""

    group_idx: int | None = None


class GroupBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class EngineEvents:
    def __init__(
        self, manager: KVManager, block_size: int, tiering: EngineTiering | None = None, *,
        data_parallel_rank: int = 0, int_keys: bool = False,
    ) -> None:  # fmt: skip
        # one log per KV cache group; a grouped manager's events name their group (`group_idx`)
        self.logs = [EventLog(block_size, data_parallel_rank=data_parallel_rank) for _ in range(manager.num_groups)]
        self.feed = EventFeed(manager, self.logs)
        self.grouped = manager.grouped_events
        self.log = self.logs[0]
        self.tiering = tiering  # when set, built with keep_device_events=True: it drains the manager
        # the manager's keys are ints (hash_fn "fast"): the tiers hold them as 8 big-endian bytes
        # (`pagedkv.tiers.keys.key_bytes`), and a tier event's key is turned back into the device's int, so
        # the log finds the parent and tokens the device reported for it
        self.int_keys = int_keys
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
            return 0, int.from_bytes(key, "big", signed=True) if self.int_keys else key
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
        self.feed.poll(drained)
        for e, g, key in _parents_first(tier_events, self.logs, known):  # as they happened, parents first
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


def _parents_first(
    events: list[tuple[TierEvent, int, Key]],
    logs: list[EventLog],
    known: dict[tuple[int, Key], tuple[Key | None, tuple[int, ...]]],
) -> list[tuple[TierEvent, int, Key]]:
    """The tier events in the order they happened, except that a block's store waits for its parent's last
    store in the same poll. A sync writes back evicted blocks tail first (the manager evicts a chain's tail
    first), and the log names a block's parent only while some medium holds it: in that order every block of
    a chain but its head went out with no parent, as if it began one (and a block moving from the host to
    the disk reached the disk while its parent, off the host already, was not there yet). Events on one key
    in one medium keep their order; events on different keys commute (the media's final contents are the
    same)."""
    n = len(events)
    after: list[list[int]] = [[] for _ in range(n)]  # i -> the events that must wait for i
    waits = [0] * n
    last: dict[tuple[int, Key, str], int] = {}  # (group, key, medium) -> its latest event so far
    last_store: dict[tuple[int, Key], int] = {}
    for i, (e, g, key) in enumerate(events):
        prev = last.get((g, key, e.medium))
        if prev is not None:
            after[prev].append(i)
            waits[i] += 1
        last[g, key, e.medium] = i
        if e.kind == "stored":
            last_store[g, key] = i
    for i, (e, g, key) in enumerate(events):
        if e.kind != "stored":
            continue
        info = logs[g].known(key) or known.get((g, key))
        parent = last_store.get((g, info[0])) if info is not None and info[0] is not None else None
        if parent is not None and parent != i:  # earlier too: its own parent may hold it back
            after[parent].append(i)
            waits[i] += 1
    ready = [i for i in range(n) if waits[i] == 0]
    heapq.heapify(ready)
    out: list[tuple[TierEvent, int, Key]] = []
    while ready:
        i = heapq.heappop(ready)
        out.append(events[i])
        for j in after[i]:
            waits[j] -= 1
            if waits[j] == 0:
                heapq.heappush(ready, j)
    if len(out) < n:  # a cycle cannot happen with chained keys; never drop an event
        done = {id(item) for item in out}
        out += [item for item in events if id(item) not in done]
    return out
