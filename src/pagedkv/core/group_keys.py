"""Prefix keys and cache events per KV cache group.

Every group of a hybrid model computes its own KV for the same tokens, so one content key (the chain of
`prefix.py`) names a different block in each group. The one prefix index of the shared pool holds them as
group-qualified keys: the content key with the group appended (one byte after a SHA-256 digest, or
`key * 256 + group` for the process-local integer keys), as vLLM's hybrid allocator keys its cache by
(block hash, group id). `split_key` recovers both, so the cache's events carry the plain content key (the
one a uniform manager and an external router compute) and the group.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.hotpath import MAX_GROUPS, group_key
from pagedkv.core.prefix import Key
from pagedkv.core.prefix_index import CacheEvent

__all__ = ["MAX_GROUPS", "GroupCacheEvent", "check_num_groups", "group_events", "group_key", "split_key"]


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
