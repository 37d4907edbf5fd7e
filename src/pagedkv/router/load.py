"""`FleetLoad`: the router's load model, the requests it sent each replica and has not seen complete.

One model for the live router (`pagedkv.router.live`) and the simulator (`pagedkv.sim.replicas`):

- Queued work, in blocks: a request weighs the blocks it had to compute there plus one (the block holding its
  last prompt token) while its prefill runs, then one (a running sequence), until it completes. Its prefill is
  done once the replica's events show its last cacheable block on the GPU (`prefills_done`), or at once when
  it had nothing to compute. Plus `others`: requests other routers sent (a replica's report, live only).
- Requests in flight per replica (`requests`): what the imbalance threshold of `CostRouting.rank` compares.
- Blocks on their way (`match`): a request still prefilling credits its replica with its blocks
  (`PrefixMatch.pending`), so the next request sharing them goes there before the events say so.
- A request's own history (`private`): the candidate holding its longest prefix, when no other holds as much
  and that prefix's deepest block is in no other request in flight there (a conversation's earlier turns, not
  a system prompt many requests share now): `CostRouting.rank`'s `sticky`.

Invariants: every request id is placed on at most one replica; `sharing` and `arriving` count exactly the
placed requests' hashes (arriving: only those still prefilling).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pagedkv.router.index import PrefixMatch


@dataclass
class Placement:
    """A request sent to `replica`: the prefill blocks it had to compute there and the hash of its last
    cacheable block (the prefill is done once the replica's events show that block on its GPU)."""

    replica: Hashable
    blocks: int
    last_hash: int | None
    prefilling: bool = True
    arriving: tuple[int, ...] = ()  # its block hashes, credited to the replica until its prefill is done
    hashes: tuple[int, ...] = ()  # all its cacheable blocks, until it completes

    @property
    def work(self) -> float:
        return self.blocks + 1.0 if self.prefilling else 1.0


def placement(replica: Hashable, hashes: Sequence[int], match: PrefixMatch) -> Placement:
    """What a request of cacheable blocks `hashes` would queue on `replica`, given its match there."""
    h = tuple(hashes)
    return Placement(replica, max(len(h) - match.total, 0), h[-1] if h else None, arriving=h, hashes=h)


@dataclass
class _ReplicaLoad:
    inflight: dict[Hashable, Placement] = field(default_factory=dict)
    sharing: dict[int, int] = field(default_factory=dict)  # hash -> requests in flight there whose prompt has it
    others: int = 0  # requests other routers sent it (live: its last report's count beyond this router's then)


class FleetLoad:
    def __init__(self) -> None:
        self._replicas: dict[Hashable, _ReplicaLoad] = {}
        self._placed: dict[Hashable, Placement] = {}  # request id -> where and how much
        self._arriving: dict[Hashable, dict[int, int]] = {}  # replica -> hash -> requests prefilling it there

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._placed

    def where(self, request_id: Hashable) -> Hashable | None:
        entry = self._placed.get(request_id)
        return None if entry is None else entry.replica

    def place(self, request_id: Hashable, entry: Placement) -> None:
        """The request goes to `entry.replica` (a request placed elsewhere before moves)."""
        if request_id in self._placed:
            self.release(request_id)
        entry = dataclasses.replace(entry)
        entry.prefilling = entry.blocks > 0
        if not entry.prefilling:
            entry.arriving = ()
        arriving = self._arriving.setdefault(entry.replica, {})
        for h in entry.arriving:
            arriving[h] = arriving.get(h, 0) + 1
        rec = self._replicas.setdefault(entry.replica, _ReplicaLoad())
        for h in entry.hashes:
            rec.sharing[h] = rec.sharing.get(h, 0) + 1
        rec.inflight[request_id] = entry
        self._placed[request_id] = entry

    def release(self, request_id: Hashable) -> None:
        """The request completed (or is taken back): nothing of it counts any more."""
        entry = self._placed.pop(request_id, None)
        if entry is None:
            return
        self._arrived(entry)
        rec = self._replicas.get(entry.replica)
        if rec is not None and rec.inflight.pop(request_id, None) is not None:
            for h in entry.hashes:
                left = rec.sharing.get(h, 0) - 1
                if left > 0:
                    rec.sharing[h] = left
                else:
                    rec.sharing.pop(h, None)

    def report(self, replica: Hashable, num_requests: int) -> None:
        """A replica reports `num_requests` in flight: those beyond this router's count as other routers'."""
        rec = self._replicas.setdefault(replica, _ReplicaLoad())
        rec.others = max(0, num_requests - len(rec.inflight))

    def forget(self, replica: Hashable) -> None:
        """The replica is gone: its requests and load with it."""
        self._replicas.pop(replica, None)
        self._arriving.pop(replica, None)
        for rid, entry in list(self._placed.items()):
            if entry.replica == replica:
                del self._placed[rid]

    def prefills_done(self, on_gpu: Callable[[int, Hashable], bool]) -> None:
        """Requests whose last cacheable block `on_gpu(hash, replica)` says is on their replica's GPU have been
        prefilled: from then on they weigh as one running sequence."""
        for entry in self._placed.values():
            if entry.prefilling and entry.last_hash is not None and on_gpu(entry.last_hash, entry.replica):
                entry.prefilling = False
                self._arrived(entry)

    def load(self, replica: Hashable) -> float:
        rec = self._replicas.get(replica)
        return 0.0 if rec is None else sum(e.work for e in rec.inflight.values()) + rec.others

    def requests(self, replica: Hashable) -> int:
        rec = self._replicas.get(replica)
        return 0 if rec is None else len(rec.inflight) + rec.others

    def match(self, replica: Hashable, found: PrefixMatch, hashes: Sequence[int]) -> PrefixMatch:
        """The index's match, extended by the blocks a request placed there is computing now (`pending`)."""
        arriving = self._arriving.get(replica)
        if not arriving:
            return found
        more = 0
        for h in hashes[found.total :]:
            if h not in arriving:
                break
            more += 1
        return PrefixMatch(found.gpu, found.local, found.remote, found.pending + more)

    def private(
        self, candidates: Sequence[Hashable], matches: dict[Hashable, PrefixMatch], hashes: dict[Hashable, list[int]]
    ) -> Hashable | None:
        """The candidate holding the request's own history (see the module docstring), else None."""
        best = max(candidates, key=lambda r: matches[r].total)
        held = matches[best].total
        if held == 0 or any(matches[r].total >= held for r in candidates if r != best):
            return None
        rec = self._replicas.get(best)
        return best if rec is None or rec.sharing.get(hashes[best][held - 1], 0) == 0 else None

    def check_invariants(self) -> None:
        """The per-replica records and the hash counts agree with the placed requests (see the module docstring)."""
        sharing: dict[Hashable, dict[int, int]] = {}
        arriving: dict[Hashable, dict[int, int]] = {}
        for rid, entry in self._placed.items():
            rec = self._replicas.get(entry.replica)
            assert rec is not None and rec.inflight.get(rid) is entry, f"load: {rid!r} not recorded on its replica"
            assert entry.prefilling or not entry.arriving, f"load: {rid!r} is done but its blocks still arrive"
            for counts, hashes in ((sharing, entry.hashes), (arriving, entry.arriving)):
                mine = counts.setdefault(entry.replica, {})
                for h in hashes:
                    mine[h] = mine.get(h, 0) + 1
        for r, rec in self._replicas.items():
            assert set(rec.inflight) == {rid for rid, e in self._placed.items() if e.replica == r}, (
                f"load: replica {r!r} records requests not placed there"
            )
            assert rec.sharing == sharing.get(r, {}), f"load: replica {r!r}'s shared-hash counts drifted"
        for r, on_way in self._arriving.items():
            assert on_way == arriving.get(r, {}), f"load: replica {r!r}'s blocks on their way drifted"

    def _arrived(self, entry: Placement) -> None:
        """The request's blocks are no longer on their way to its replica (computed, or it ended)."""
        arriving = self._arriving.get(entry.replica, {})
        for h in entry.arriving:
            left = arriving.get(h, 0) - 1
            if left > 0:
                arriving[h] = left
            else:
                arriving.pop(h, None)
        entry.arriving = ()
