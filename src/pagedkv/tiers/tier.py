"""The interface every tier below the device speaks, and the fixed-slot base of the local ones.

    contains(keys)        -> [bool]           which keys are present (one round trip)
    lookup(keys)          -> n                the longest present prefix of a key chain (one round trip)
    get(keys, out)        -> [reason | None]  copy values into the caller's rows `out[i]`; None = loaded
    put(keys, values)     -> Spill            store a batch; what had to make room comes back
    remove(keys)          -> n
    touch(keys)                               mark as recently used
    take_events()         -> [TierEvent]

Keys are raw block keys (bytes); values are `uint8` rows of `layout.nbytes` (a block's K and V of every
layer). A `get` that fails for a key reports why ("evicted", "checksum", "timeout", "error") and leaves its
row unspecified; the caller must then stop the chain there and recompute. A corrupt entry is deleted
by the `get` that finds it. Torch-free.

A local tier's medium may fail (a full disk: `ENOSPC`, a file past the size limit: `EFBIG`, an I/O error:
`EIO`). A failed write is a block not stored (its reservation is given back, `Spill.failed` counts it by
errno name); a failed read is a miss reported "error" and the entry is dropped. Neither raises: a tier's
failure costs hits, never the engine's service.
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.tiers.events import Medium, TierEvent
from pagedkv.tiers.slot_index import LruClock, SlotIndex
from pagedkv.tiers.value import BlockLayout

Rows = npt.NDArray[np.uint8]


class Spill(NamedTuple):
    """A put's side effects: how many keys were stored, the blocks evicted to make room (with their LRU
    stamps and, from a tier that can hand them on, their bytes), and the writes the medium refused, by
    errno name (those blocks are not stored)."""

    num_stored: int
    evicted: list[bytes]
    stamps: list[int]
    values: Rows | None
    failed: Mapping[str, int] = {}  # read only


def errno_name(err: OSError) -> str:
    """`ENOSPC`, `EFBIG`, `EIO`, ... (or `OSError` when the error carries no errno)."""
    return errno.errorcode.get(err.errno, "OSError") if err.errno is not None else "OSError"


class Tier(Protocol):
    medium: Medium
    layout: BlockLayout

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...
    def lookup(self, keys: Sequence[bytes]) -> int: ...
    def get(self, keys: Sequence[bytes], out: Rows) -> list[str | None]: ...
    def put(self, keys: Sequence[bytes], values: Rows, stamps: Sequence[int] | None = None) -> Spill: ...
    def remove(self, keys: Sequence[bytes]) -> int: ...
    def touch(self, keys: Sequence[bytes]) -> None: ...
    def take_events(self) -> list[TierEvent]: ...


def check_rows(layout: BlockLayout, rows: Rows, n: int, what: str) -> None:
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] < n or rows.shape[1] != layout.nbytes:
        raise InvalidArgumentError(
            f"{what}: expected uint8 rows [{n}, {layout.nbytes}], got {rows.dtype} {tuple(rows.shape)}"
        )


class LocalTier:
    """A tier of `num_blocks` fixed-size slots on this machine; subclasses move the bytes."""

    medium: Medium = "CPU"
    keeps_evicted_bytes = False  # whether put's Spill carries the evicted blocks' bytes

    def __init__(self, num_blocks: int, layout: BlockLayout, clock: LruClock) -> None:
        self.layout = layout
        self.index = SlotIndex(num_blocks, self.medium, clock)

    @property
    def num_blocks(self) -> int:
        return self.index.num_slots

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.index for k in keys]

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.index:
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes], out: Rows) -> list[str | None]:
        check_rows(self.layout, out, len(keys), f"{self.medium} get")
        reasons: list[str | None] = []
        for i, key in enumerate(keys):
            slot = self.index.get(key)
            if slot is None:
                reasons.append("evicted")
                continue
            try:
                reason = self._read(slot, key, out[i])
            except OSError:
                reason = "error"  # the medium failed: a miss, and the entry cannot be trusted
            if reason is not None:
                self.index.remove(key)  # a corrupt entry is deleted, never served
            reasons.append(reason)
        return reasons

    def put(self, keys: Sequence[bytes], values: Rows, stamps: Sequence[int] | None = None) -> Spill:
        check_rows(self.layout, values, len(keys), f"{self.medium} put")
        evicted: list[bytes] = []
        ev_stamps: list[int] = []
        ev_values: list[Rows] = []
        failed: Counter[str] = Counter()
        stored = 0
        for i, key in enumerate(keys):
            if key in self.index.slot_of:
                self.index.touch(key)
                continue
            if self.index.num_free == 0:
                victim = self.index.victim()
                if victim is None:
                    continue  # every slot is pinned: this block is not kept here
                vkey, vslot, vstamp = victim
                if self.keeps_evicted_bytes:
                    row = np.empty(self.layout.nbytes, dtype=np.uint8)
                    if self._read(vslot, vkey, row) is None:
                        ev_values.append(row)
                        evicted.append(vkey)
                        ev_stamps.append(vstamp)
                else:
                    evicted.append(vkey)
                    ev_stamps.append(vstamp)
                self.index.remove(vkey)
            slot = self.index.reserve(key, None if stamps is None else stamps[i])
            assert slot is not None, f"{self.medium} tier: no slot after eviction"
            try:
                self._write(slot, key, values[i])
            except OSError as err:  # a full or failing medium: this block is not stored here
                self.index.cancel(slot)
                failed[errno_name(err)] += 1
                continue
            self.index.commit(slot)
            stored += 1
        spilled = np.stack(ev_values) if ev_values else None
        return Spill(stored, evicted, ev_stamps, spilled, failed)

    def remove(self, keys: Sequence[bytes]) -> int:
        return sum(self.index.remove(k) for k in keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.index.touch(k)

    def take_events(self) -> list[TierEvent]:
        return self.index.take_events()

    def check_invariants(self) -> None:
        self.index.check_invariants()

    def _read(self, slot: int, key: bytes, out: Rows) -> str | None:
        raise NotImplementedError

    def _write(self, slot: int, key: bytes, value: Rows) -> None:
        raise NotImplementedError
