"""Prefix keys and cache events per KV cache group.

Every group of a hybrid model computes its own KV for the same tokens, so one content key (the chain of
`prefix.py`) names a different block in each group. The one prefix index of the shared pool holds them as
group-qualified keys: the content key with the group appended (one byte after a SHA-256 digest, or
`key * 256 + group` for the process-local integer keys), as vLLM's hybrid allocator keys its cache by
(block hash, group id). `split_key` recovers both, so the cache's events carry the plain content key (the
one a uniform manager and an external router compute) and the group.

`BlockOrigins` remembers, for each block the index took a key for, the content key of the block before it
in the sequence that published it and its token ids: what a `BlockStored` event carries besides the hash
(`pagedkv.events.group_feed`). A record is valid while the block holds that key; the caller checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.hotpath import MAX_GROUPS, group_key
from pagedkv.core.prefix import Key
from pagedkv.core.prefix_index import CacheEvent

__all__ = ["MAX_GROUPS", "BlockOrigins", "GroupCacheEvent", "check_num_groups", "group_events", "group_key", "split_key"]


def split_key(qualified: Key) -> tuple[Key, int]:
    """(content key, group) of a group-qualified key."""
    if isinstance(qualified, bytes):
        return qualified[:-1], qualified[-1]
    key, group = divmod(qualified, MAX_GROUPS)
    return key, group


class GroupCacheEvent(NamedTuple):
    """A cache event of one group: a content key stored or removed in `group`, or everything cleared
    (`key`, `block_id` and `group` None)."""

    kind: Literal["stored", "removed", "cleared"]
    key: Key | None
    block_id: int | None
    group: int | None


def group_events(events: list[CacheEvent]) -> list[GroupCacheEvent]:
    """The prefix index's events with the group split out of each key."""
    out: list[GroupCacheEvent] = []
    for e in events:
        if e.key is None:
            out.append(GroupCacheEvent(e.kind, None, e.block_id, None))
        else:
            key, group = split_key(e.key)
            out.append(GroupCacheEvent(e.kind, key, e.block_id, group))
    return out


def check_num_groups(n: int) -> None:
    if not 1 <= n <= MAX_GROUPS:
        raise InvalidArgumentError(f"a hybrid manager takes 1 to {MAX_GROUPS} KV cache groups, got {n}")


class BlockOrigins:
    """block id -> (parent content key or None for a sequence's first block, its token ids), as published."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_block: dict[int, tuple[Key | None, tuple[int, ...]]] = {}

    def remember(
        self, chain: Sequence[Key], tokens: Sequence[int], start: int, block_ids: Sequence[int], stored: Sequence[int]
    ) -> None:
        """Blocks `block_ids` hold table columns `start, start + 1, ...` of a sequence whose content keys are
        `chain` (`chain[0]` the root, `chain[j + 1]` block j's key) over `tokens`; `stored`: those that
        entered the index."""
        bs, new = self.block_size, set(stored)
        for j, block in enumerate(block_ids, start):
            if block in new:
                self._by_block[block] = (chain[j] if j else None, tuple(tokens[j * bs : (j + 1) * bs]))

    def get(self, block_id: int) -> tuple[Key | None, tuple[int, ...]] | None:
        return self._by_block.get(block_id)
