"""`SlotIndex`: which block key sits in which slot of a fixed-size local tier (host RAM, disk). Torch-free.

Every slot is in exactly one state:

    free       no key                                   in `_free`
    reserved   a key being written (phase 1 of a put)   pinned, invisible to lookups
    ready      a key whose bytes are complete           servable; evictable when its pin count is 0

    free + reserved + ready == num_slots

LRU: one `LruClock` is shared by every local tier, so stamps compare across tiers (a block demoted from
host to disk keeps its stamp: the disk evicts in the order the blocks were last used, wherever they were
used). Eviction takes the ready, unpinned slot with the smallest stamp, via a heap with lazy deletion
(an entry is live while its stamp equals the slot's current stamp). A pinned slot (a load in flight, or a
reservation) is never evicted, so a block is never overwritten before its copy finished.

The index records `TierEvent`s: `stored` at `commit` (not at `reserve`), `removed` when a key leaves.
"""

from __future__ import annotations

import heapq

from pagedkv.core.errors import InvalidArgumentError, InvariantError
from pagedkv.tiers.events import Medium, TierEvent


class LruClock:
    """A logical clock; every touch of a block in any local tier takes the next tick."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now


class SlotIndex:
    def __init__(self, num_slots: int, medium: Medium, clock: LruClock) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidArgumentError(f"a {medium} tier needs at least one slot, got {num_slots!r}")
        self.num_slots = num_slots
        self.medium = medium
        self.clock = clock
        self.slot_of: dict[bytes, int] = {}  # reserved and ready keys
        self.key_at: list[bytes | None] = [None] * num_slots
        self.ready = [False] * num_slots
        self.pins = [0] * num_slots
        self.stamp = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out ascending slots
        self._heap: list[tuple[int, int]] = []  # (stamp, slot) of ready slots, lazily deleted
        self.events: list[TierEvent] = []

    # --- queries --------------------------------------------------------------------------------

    def get(self, key: bytes) -> int | None:
        """The slot of a ready key, else None (reserved keys are not servable yet)."""
        slot = self.slot_of.get(key)
        return slot if slot is not None and self.ready[slot] else None

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    def __len__(self) -> int:
        return sum(self.ready)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def keys(self) -> list[bytes]:
        """Ready keys, least recently used first."""
        live = [s for s in range(self.num_slots) if self.ready[s]]
        return [k for s in sorted(live, key=self.stamp.__getitem__) if (k := self.key_at[s]) is not None]

    # --- mutations ------------------------------------------------------------------------------

    def touch(self, key: bytes) -> None:
        slot = self.get(key)
        if slot is not None:
            self.stamp[slot] = self.clock.tick()
            heapq.heappush(self._heap, (self.stamp[slot], slot))

    def reserve(self, key: bytes, stamp: int | None = None) -> int | None:
        """Phase 1 of a put: a free slot for `key`, pinned and invisible. None if no slot is free (evict
        first). `stamp` keeps a demoted block's place in the LRU order."""
        if key in self.slot_of:
            raise InvalidArgumentError(
                f"{self.medium} tier: key {key.hex()[:16]}.. is already stored or being stored"
            )
        if not self._free:
            return None
        slot = self._free.pop()
        self.slot_of[key] = slot
        self.key_at[slot] = key
        self.pins[slot] = 1
        self.stamp[slot] = self.clock.tick() if stamp is None else stamp
        return slot

    def commit(self, slot: int) -> None:
        """Phase 2 of a put: the slot's bytes are complete; the key becomes servable and evictable."""
        key = self.key_at[slot]
        if key is None or self.ready[slot] or self.pins[slot] != 1:
            raise InvalidArgumentError(f"{self.medium} tier: slot {slot} is not a pending reservation")
        self.ready[slot] = True
        self.pins[slot] = 0
        heapq.heappush(self._heap, (self.stamp[slot], slot))
        self.events.append(TierEvent("stored", key, self.medium))

    def cancel(self, slot: int) -> None:
        """Give back a reservation whose write failed."""
        key = self.key_at[slot]
        if key is None or self.ready[slot]:
            raise InvalidArgumentError(f"{self.medium} tier: slot {slot} is not a pending reservation")
        self._release(slot, key)

    def pin(self, slot: int) -> None:
        if not self.ready[slot]:
            raise InvalidArgumentError(f"{self.medium} tier: only a ready slot can be pinned (slot {slot})")
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self.pins[slot] < 1 or not self.ready[slot]:
            raise InvalidArgumentError(f"{self.medium} tier: slot {slot} is not pinned")
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            heapq.heappush(self._heap, (self.stamp[slot], slot))

    def victim(self) -> tuple[bytes, int, int] | None:
        """(key, slot, stamp) of the least recently used ready, unpinned slot, or None. Does not remove it."""
        heap = self._heap
        while heap:
            stamp, slot = heap[0]
            if self.ready[slot] and self.pins[slot] == 0 and self.stamp[slot] == stamp:
                key = self.key_at[slot]
                assert key is not None, "slots: a ready slot without a key"
                return key, slot, stamp
            heapq.heappop(heap)  # stale: touched, pinned, removed or reused since
        return None

    def remove(self, key: bytes) -> bool:
        """Drop a ready, unpinned key (evicted, or found corrupt). False if it is not there."""
        slot = self.get(key)
        if slot is None:
            return False
        if self.pins[slot]:
            raise InvalidArgumentError(
                f"{self.medium} tier: cannot remove a pinned block (a load is in flight)"
            )
        self._release(slot, key)
        self.events.append(TierEvent("removed", key, self.medium))
        return True

    def _release(self, slot: int, key: bytes) -> None:
        del self.slot_of[key]
        self.key_at[slot] = None
        self.ready[slot] = False
        self.pins[slot] = 0
        self.stamp[slot] += 1  # heap entries of the old key go stale
        self._free.append(slot)

    def take_events(self) -> list[TierEvent]:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantError(f"{self.medium} slots: a slot is free twice")
        held = {s for s in range(self.num_slots) if self.key_at[s] is not None}
        if free & held or len(free) + len(held) != self.num_slots:
            raise InvariantError(f"{self.medium} slots: free + reserved + ready != num_slots")
        if {self.slot_of[k] for k in self.slot_of} != held or len(self.slot_of) != len(held):
            raise InvariantError(f"{self.medium} slots: key -> slot map disagrees with the slots")
        for key, slot in self.slot_of.items():
            if self.key_at[slot] != key:
                raise InvariantError(f"{self.medium} slots: slot {slot} holds another key")
            if not self.ready[slot] and self.pins[slot] != 1:
                raise InvariantError(f"{self.medium} slots: reservation at slot {slot} is not pinned once")
        if any(self.ready[s] or self.pins[s] for s in free):
            raise InvariantError(f"{self.medium} slots: a free slot is ready or pinned")
