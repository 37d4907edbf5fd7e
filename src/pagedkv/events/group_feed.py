"""Feeding a `HybridKVManager`'s cache events into one `EventLog` per KV cache group, as the GPU medium.

The hybrid manager's `take_events()` yields `GroupCacheEvent(kind, key, block_id, group)`: the plain content
key (the one a uniform manager and a router compute) and its group. Each group's copies go to that group's
log, so copies are counted per (key, group), as vLLM's hybrid cache counts them. A `BlockStored` carries,
as `ManagerFeed`'s do for a uniform manager:

- token ids and parent: what the manager recorded when it published the block
  (`HybridKVManager.published_from`: the content key of the block before it in the publishing sequence,
  None for a sequence's first block), valid while the block still holds the key. A block stored and then
  evicted and reused before the poll is dropped with its removal (the consumer never saw the key).
- consecutive blocks of one group that chain (each the parent of the next) go out as one event, like the
  uniform feed's; the log sends a parent only while some medium of that group's log holds it (a sliding
  group's early blocks may be gone: the chain is then a root).

A `cleared` event clears every group's log (`EngineEvents` merges their batches and sends one
`AllBlocksCleared`). Log keys are the manager's content keys, so a uniform and a one-group hybrid manager
fed the same requests produce the same events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.group_keys import GroupCacheEvent, group_key, split_key
from pagedkv.core.prefix import Key
from pagedkv.events.log import EventLog
from pagedkv.events.wire import GPU

if TYPE_CHECKING:
    from pagedkv.core.hybrid import HybridKVManager


class _Chain:
    """Consecutive stored blocks of one group, each the parent of the next: one log call."""

    def __init__(self, log: EventLog, medium: str) -> None:
        self.log, self.medium = log, medium
        self.keys: list[Key] = []
        self.tokens: list[int] = []
        self.parent: Key | None = None
        self.known = True  # every block's tokens are known

    def add(self, key: Key, parent: Key | None, tokens: tuple[int, ...] | None) -> None:
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
            tokens = self.tokens if self.known else None
            self.log.stored(self.medium, self.keys, parent=self.parent, token_ids=tokens)
        self.keys, self.tokens, self.parent, self.known = [], [], None, True


class GroupFeed:
    def __init__(self, manager: HybridKVManager, logs: list[EventLog], *, medium: str = GPU) -> None:
        if not manager.index.record_events:
            raise InvalidArgumentError("the manager does not record events: build it with record_events=True")
        if len(logs) != manager.num_groups or any(log.block_size != manager.block_size for log in logs):
            raise InvalidArgumentError(f"a hybrid feed takes one log of block_size {manager.block_size} per group ({manager.num_groups})")
        self.manager = manager
        self.logs = logs
        self.medium = medium

    def device_keys(self) -> set[Key]:
        """The content keys some group's blocks hold now (the union over the groups). This feed does not
        follow the manager's epoch: after `bump_epoch` the older keys stay listed, as in the logs, until
        evicted."""
        return {split_key(k)[0] for k in self.manager.index.all_keys()}

    def poll(self, drained: list[GroupCacheEvent] | None = None) -> int:
        """Move the manager's pending events into the group logs; returns how many were read. `drained`:
        events another reader already took from `manager.take_events()`, in order (the engine's tiering)."""
        m = self.manager
        events = m.take_events() if drained is None else drained
        chains = [_Chain(log, self.medium) for log in self.logs]
        unseen: set[tuple[Key, int]] = set()  # stored then reused before this poll: neither end is reported
        for e in events:
            if e.kind == "cleared":
                for chain in chains:
                    chain.flush()
                for log in self.logs:
                    log.cleared(self.medium)
                continue
            assert e.key is not None and e.block_id is not None and e.group is not None, "group feed: an event without key, block or group"
            if e.kind == "stored":
                if m.index.key_at(e.block_id) != group_key(e.key, e.group):
                    unseen.add((e.key, e.group))
                    continue
                origin = m.published_from(e.block_id)
                parent, tokens = origin if origin is not None else (None, None)
                chains[e.group].add(e.key, parent, tokens if tokens is None or len(tokens) == m.block_size else None)
                continue
            chains[e.group].flush()
            if (e.key, e.group) in unseen:
                unseen.discard((e.key, e.group))
            else:
                self.logs[e.group].removed(self.medium, [e.key])
        for chain in chains:
            chain.flush()
        return len(events)
