"""Tier events: plain records of which block key entered or left which medium.

A KV-aware router rebuilds "which key lives where" from them (the router's event log turns them into
vLLM's `BlockStored` / `BlockRemoved` with `medium`). Contract: a tier reports `stored` when a key becomes
servable from it (after its copy completed, never at reservation) and `removed` when the last copy of the
key in that tier is gone; a key is never reported stored twice in one medium without a removal between.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Medium = Literal["GPU", "CPU", "DISK", "REMOTE"]
MEDIA: tuple[Medium, ...] = ("GPU", "CPU", "DISK", "REMOTE")


class TierEvent(NamedTuple):
    """`kind` happened to block key `key` (the raw content key, not the store key) in `medium`."""

    kind: Literal["stored", "removed"]
    key: bytes
    medium: Medium
