"""The router's view of the fleet: block hash -> {replica: media}, rebuilt from the replicas' event streams.

`apply(replica, batch)` folds one `EventBatch` in (vLLM's format, see `pagedkv.events.wire`): `BlockStored`
adds a medium to each hash for that replica, `BlockRemoved` takes it away, `AllBlocksCleared` forgets every
hash of that replica. A medium of `None` is GPU, as in vLLM. The index trusts the stream: a replica's events
must be applied in sequence order (`pagedkv.events.publisher.EventSubscriber` replays gaps before it delivers).

`match(hashes)` walks a request's chain of block hashes and tells, per replica, how many blocks of its
cacheable prefix it finds on its GPU, how many it would load from its own CPU or DISK, and how many from the
REMOTE store (one store for the fleet, so any replica's REMOTE report counts); each block is taken from the
cheapest place holding it, and the walk stops at the first block held nowhere.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from pagedkv.events import wire
from pagedkv.events.wire import GPU, REMOTE, EventBatch

Replica = Hashable


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A replica's cacheable prefix of one request, `total` blocks: `gpu` of them already on its device,
    `local` to load from its CPU/DISK, `remote` to load from the shared store, and `pending` on their way
    (after those: blocks a request already sent to that replica is computing there now; the index itself
    never reports any, a router that remembers what it sent does: `pagedkv.router.live`)."""

    gpu: int = 0
    local: int = 0
    remote: int = 0
    pending: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.local + self.remote + self.pending


class ReplicaIndex:
    """Which replicas hold each block hash, on which media (the device's key <-> block index is core's
    `PrefixIndex`; this one only reads replicas' events)."""

    def __init__(self) -> None:
        self._where: dict[int, dict[Replica, set[str]]] = {}
        self._by_replica: dict[Replica, set[int]] = {}
        self._remote: dict[int, int] = {}  # hash -> how many replicas report it in REMOTE

    def apply(self, replica: Replica, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, wire.BlockStored):
                self._add(replica, event.block_hashes, event.medium or GPU)
            elif isinstance(event, wire.BlockRemoved):
                self._remove(replica, event.block_hashes, event.medium or GPU)
            elif isinstance(event, wire.AllBlocksCleared):
                self.clear(replica)

    def clear(self, replica: Replica) -> None:
        for h in self._by_replica.pop(replica, set()):
            media = self._where[h].pop(replica)
            if REMOTE in media:
                self._drop_remote(h)
            if not self._where[h]:
                del self._where[h]

    # --- queries ---------------------------------------------------------------------------------

    def media(self, block_hash: int, replica: Replica) -> frozenset[str]:
        return frozenset(self._where.get(block_hash, {}).get(replica, ()))

    def holders(self, block_hash: int) -> dict[Replica, frozenset[str]]:
        return {r: frozenset(m) for r, m in self._where.get(block_hash, {}).items()}

    def state(self, replica: Replica) -> dict[str, set[int]]:
        """Medium -> the hashes `replica` holds there (for comparing with the replica's own state)."""
        out: dict[str, set[int]] = {}
        for h in self._by_replica.get(replica, ()):
            for m in self._where[h][replica]:
                out.setdefault(m, set()).add(h)
        return out

    def __len__(self) -> int:
        return len(self._where)

    def match(self, hashes: Sequence[int], replicas: Iterable[Replica]) -> dict[Replica, PrefixMatch]:
        out: dict[Replica, PrefixMatch] = {}
        where = self._where
        for r in replicas:
            gpu = local = remote = 0
            for h in hashes:  # each block from the cheapest place that has it; stop where none does
                media = where.get(h, {}).get(r, ())
                if GPU in media:
                    gpu += 1
                elif wire.CPU in media or wire.DISK in media:
                    local += 1
                elif self._remote.get(h, 0) > 0:
                    remote += 1
                else:
                    break
            out[r] = PrefixMatch(gpu, local, remote)
        return out

    # --- internals -------------------------------------------------------------------------------

    def _add(self, replica: Replica, hashes: Iterable[int], medium: str) -> None:
        mine = self._by_replica.setdefault(replica, set())
        for h in hashes:
            media = self._where.setdefault(h, {}).setdefault(replica, set())
            if medium == REMOTE and REMOTE not in media:
                self._remote[h] = self._remote.get(h, 0) + 1
            media.add(medium)
            mine.add(h)

    def _remove(self, replica: Replica, hashes: Iterable[int], medium: str) -> None:
        for h in hashes:
            per = self._where.get(h)
            media = per.get(replica) if per is not None else None
            if per is None or media is None or medium not in media:
                continue  # a removal the index never saw stored (joined late): nothing to undo
            media.discard(medium)
            if medium == REMOTE:
                self._drop_remote(h)
            if not media:
                del per[replica]
                self._by_replica[replica].discard(h)
                if not per:
                    del self._where[h]

    def _drop_remote(self, h: int) -> None:
        left = self._remote[h] - 1
        if left:
            self._remote[h] = left
        else:
            del self._remote[h]
