"""`LiveRouter`: the routing decision for live replicas (Ray Serve's `PagedKVRequestRouter` wraps it).

    router = LiveRouter()
    router.observe("r0", stats)            # a replica's `ReplicaStats`: where its events are, its sizes, its load
    ranked = router.rank(["r0", "r1"], prompt_ids, cache_salt=None)   # best first
    router.routed(request_id, ranked[0]); ...; router.completed(request_id)

It owns one `EventStreams` (the replicas' ZMQ KV events folded into a `ReplicaIndex`, exact through gaps,
restarts and dead replicas) and ranks the candidates with `pagedkv.router.policy.CostPolicy.rank`, the cost the simulator
(`pagedkv simulate --replicas`) routes with:

    cost = blocks to compute + blocks to compute that another replica holds (LIVE_WEIGHTS: computed twice)
         + 0.1 * blocks from its CPU/DISK + 0.3 * blocks from the shared store
         + queue_weight * max(queued work - blocks on their way, 0)

Blocks on their way: a request this router sent a replica credits that replica with its blocks while its
prefill runs (`PrefixMatch.pending`), so the next request sharing them (a system prompt) goes there before
the events say so: those blocks are not computed again, and the prefill computing them, already in the
replica's queued work, is not charged to the follower again (`CostPolicy.cost`).

Queued work is what this router sent the replica and has not seen complete, in blocks, as the simulator
counts it: the blocks a request had to compute there, plus one, until the replica's events show its last
cacheable block on the GPU (its prefill is done), then one (a running sequence). Replica stats (refreshed by
Ray every `request_routing_stats_period_s`) add the requests other routers sent: a new report's `num_running
+ num_waiting` beyond what this router had in flight there when it arrived, held until the next report.
(Not the report's count itself: up to a period old, at tens of requests a second it counted requests long
finished, and a replica looked busier than it was until the next report.)

A conversation's history stays where it is (`CostPolicy.rank`'s `sticky`): a request whose longest held
prefix is private to one replica (no other candidate holds as much, and its deepest block is in no other
request in flight there: a conversation's own history, not a system prompt many requests share now) goes to
that replica unless its requests in flight exceed the least loaded candidate's by more than
`imbalance_threshold`; then the cost decides. Until 2026-12-01 the cost decided every such turn: a queue a
few blocks longer moved 1-2.5% of later turns at 2 replicas in `pagedkv bench replicas` (turns 1 and 2, whose
own history is short), each recomputing its history, for a queue difference that on those replicas was a few
milliseconds of a step, within what the router's estimate of queued work can miss.

Load-imbalance fallback (`CostPolicy.rank`): for any other request, when the most and least loaded candidates
differ by more than `imbalance_threshold` requests in flight, those within the threshold of the least loaded
come first, by cost among them, whatever the others hold.
New conversations, which share a system prompt, are what the fallback moves, and they rebalance the fleet as
conversations end.

Replica stats: `pagedkv.router.replica_stats.ReplicaStats` (what `record_routing_stats` on the replica sends).

Decisions never wait for the streams' periodic check (a round trip to each replica silent for
`sync_interval_s`, `pagedkv.router.event_streams`): `rank` only applies the batches that have arrived, and
the check runs when a request completes. In `pagedkv bench replicas` (4 replicas, before 2026-12-01's change) the
opening burst's first decision, after a quiet second, waited 16 ms for one to every replica.

A replica whose `kv_events` endpoint changes (Ray restarted it elsewhere) is re-followed from scratch; one
that leaves the candidate set for good is forgotten (`forget`). Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.events.wire import GPU
from pagedkv.router.event_streams import EventStreams
from pagedkv.router.index import PrefixMatch, ReplicaIndex
from pagedkv.router.policy import (
    LIVE_IMBALANCE_THRESHOLD,
    LIVE_WEIGHTS,
    CostPolicy,
    CostWeights,
    request_hashes,
)
from pagedkv.router.replica_stats import ReplicaStats

MAX_PREDICTED = 100_000


@dataclass
class _InFlight:
    """A request this router sent: where, the prefill blocks it had to compute there, and the hash of its last
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


@dataclass
class _Replica:
    stats: ReplicaStats | None = None
    inflight: dict[Hashable, _InFlight] = field(default_factory=dict)
    sharing: dict[int, int] = field(default_factory=dict)  # hash -> requests in flight there whose prompt has it
    others: int = 0  # requests other routers sent it: its last report's count beyond this router's then


@dataclass(frozen=True)
class Ranking:
    """A decision: candidates best first, with what the index predicted for each."""

    order: list[Hashable]
    matches: dict[Hashable, PrefixMatch]
    loads: dict[Hashable, float]
    fallback: bool  # the load-imbalance fallback decided
    num_blocks: int  # the request's cacheable blocks
    hashes: dict[Hashable, list[int]]  # per candidate, the request's cacheable blocks as it names them


class LiveRouter:
    def __init__(
        self,
        *,
        weights: CostWeights | None = None,
        imbalance_threshold: int = LIVE_IMBALANCE_THRESHOLD,
        replay_timeout_ms: int = 2000,
        sync_interval_s: float = 1.0,
    ) -> None:
        if imbalance_threshold < 0:
            raise InvalidArgumentError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        self.policy = CostPolicy(weights or LIVE_WEIGHTS)
        self.imbalance_threshold = imbalance_threshold
        self.streams = EventStreams(
            ReplicaIndex(), replay_timeout_ms=replay_timeout_ms, sync_interval_s=sync_interval_s
        )
        self._replicas: dict[Hashable, _Replica] = {}
        self._inflight: dict[Hashable, _InFlight] = {}  # request id -> where and how much
        # request id -> replica -> the entry if it is sent there
        self._predicted: dict[Hashable, dict[Hashable, _InFlight]] = {}
        self._arriving: dict[Hashable, dict[int, int]] = {}  # replica -> hash -> requests prefilling it there

    @property
    def index(self) -> ReplicaIndex:
        return self.streams.index

    def observe(self, replica: Hashable, stats: ReplicaStats | None) -> None:
        """Take a replica's latest routing stats; follow its events (again, if its endpoints changed)."""
        rec = self._replicas.setdefault(replica, _Replica())
        if stats is None:
            return
        old = rec.stats
        rec.stats = stats
        if stats != old:  # a new report: what it counts beyond this router's requests is other routers'
            rec.others = max(0, stats.load - len(rec.inflight))
        if stats.kv_events is None:
            return
        if replica in self.streams and (
            old is None or old.kv_events != stats.kv_events or old.incarnation != stats.incarnation
        ):
            self.streams.remove(replica)  # restarted elsewhere: its old history means nothing
        if replica not in self.streams:
            self.streams.add(replica, stats.kv_events, stats.kv_replay)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone: drop its stream, its index entries and its load."""
        self._replicas.pop(replica, None)
        self.streams.remove(replica)
        self._arriving.pop(replica, None)
        for rid, entry in list(self._inflight.items()):
            if entry.replica == replica:
                del self._inflight[rid]

    def rank(
        self,
        candidates: Sequence[Hashable],
        prompt_ids: Sequence[int],
        *,
        cache_salt: str | bytes | None = None,
    ) -> Ranking:
        if not candidates:
            raise InvalidArgumentError("no candidate replicas")
        self.streams.poll(sync=False)  # the periodic check runs when a request completes, not in a decision
        live = set(self.streams.live())
        salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
        by_keys: dict[tuple[Any, ...], list[int]] = {}  # replicas agree on these normally: one hashing
        matches: dict[Hashable, PrefixMatch] = {}
        per: dict[Hashable, list[int]] = {}
        num_blocks = 0
        for r in candidates:
            keys = self._keying(r)
            if keys not in by_keys:
                by_keys[keys] = request_hashes(
                    list(prompt_ids), keys[0], salt=salt, hash_fn=keys[1], epoch=keys[2]
                )
            hashes = by_keys[keys]
            num_blocks = max(num_blocks, len(hashes))
            per[r] = hashes
        self._prefills_done()
        for r in candidates:
            matches[r] = self._match(r, per[r]) if r in live else PrefixMatch()
        loads = {r: self._load(r) for r in candidates}
        holder = self._private(candidates, matches, per)
        positions, fallback = self.policy.rank(
            num_blocks, [matches[r] for r in candidates], [loads[r] for r in candidates],
            [self._requests(r) for r in candidates], self.imbalance_threshold,
            None if holder is None else candidates.index(holder),
        )  # fmt: skip
        order = [candidates[i] for i in positions]
        return Ranking(order, matches, loads, fallback, num_blocks, per)

    def predict(self, request_id: Hashable, ranking: Ranking) -> None:
        """Remember, per candidate, the work a request would queue there (committed by `routed`; kept until
        `completed`, the oldest dropped past `MAX_PREDICTED` requests never completed)."""
        n = ranking.num_blocks
        out = {}
        for r, m in ranking.matches.items():
            hashes = ranking.hashes.get(r, [])
            out[r] = _InFlight(
                r, max(n - m.total, 0), hashes[-1] if hashes else None, arriving=tuple(hashes), hashes=tuple(hashes)
            )
        self._predicted[request_id] = out
        while len(self._predicted) > MAX_PREDICTED:
            del self._predicted[next(iter(self._predicted))]

    def routed(self, request_id: Hashable, replica: Hashable) -> None:
        """The request goes to `replica`: its work and its blocks on their way count there. Called when the
        router decides (the first of its ranking) and again when Ray has placed it: a request placed elsewhere
        moves, one placed where predicted is left as it is."""
        current = self._inflight.get(request_id)
        if current is not None:
            if current.replica == replica:
                return
            self._drop(request_id, current)
        predicted = self._predicted.get(request_id, {}).get(replica)
        entry = dataclasses.replace(predicted) if predicted is not None else _InFlight(replica, 0, None)
        entry.prefilling = entry.blocks > 0
        if not entry.prefilling:
            entry.arriving = ()
        arriving = self._arriving.setdefault(replica, {})
        for h in entry.arriving:
            arriving[h] = arriving.get(h, 0) + 1
        rec = self._replicas.setdefault(replica, _Replica())
        for h in entry.hashes:
            rec.sharing[h] = rec.sharing.get(h, 0) + 1
        rec.inflight[request_id] = entry
        self._inflight[request_id] = entry

    def withdraw(self, request_id: Hashable) -> None:
        """Take back a request's placement (it is being ranked again: its own work must not count against the
        replica it was meant for)."""
        entry = self._inflight.get(request_id)
        if entry is not None:
            self._drop(request_id, entry)

    def completed(self, request_id: Hashable) -> None:
        """The request has finished; the streams' periodic check runs here when it is due (not in `rank`:
        see the module docstring)."""
        self._predicted.pop(request_id, None)
        entry = self._inflight.get(request_id)
        if entry is not None:
            self._drop(request_id, entry)
        self.streams.poll()

    # --- internals -------------------------------------------------------------------------------

    def _keying(self, replica: Hashable) -> tuple[int, str, int]:
        """(block size, hash function, epoch) the replica keys its blocks with (defaults until it reports)."""
        stats = self._replicas.get(replica, _Replica()).stats or ReplicaStats()
        return stats.block_size, stats.hash_fn, stats.epoch

    def _prefills_done(self) -> None:
        """In-flight requests whose last cacheable block the replica's events now show on its GPU have been
        prefilled: from then on they weigh as one running sequence (as in `pagedkv.sim.replicas`)."""
        media = self.index.media
        for entry in self._inflight.values():
            if (
                entry.prefilling
                and entry.last_hash is not None
                and GPU in media(entry.last_hash, entry.replica)
            ):
                entry.prefilling = False
                self._arrived(entry)

    def _drop(self, request_id: Hashable, entry: _InFlight) -> None:
        self._inflight.pop(request_id, None)
        self._arrived(entry)
        rec = self._replicas.get(entry.replica)
        if rec is not None and rec.inflight.pop(request_id, None) is not None:
            for h in entry.hashes:
                left = rec.sharing.get(h, 0) - 1
                if left > 0:
                    rec.sharing[h] = left
                else:
                    rec.sharing.pop(h, None)

    def _arrived(self, entry: _InFlight) -> None:
        """The request's blocks are no longer on their way to its replica (computed, or it ended)."""
        arriving = self._arriving.get(entry.replica, {})
        for h in entry.arriving:
            left = arriving.get(h, 0) - 1
            if left > 0:
                arriving[h] = left
            else:
                arriving.pop(h, None)
        entry.arriving = ()

    def _match(self, replica: Hashable, hashes: list[int]) -> PrefixMatch:
        """The index's match, extended by the blocks a request this router sent there is computing now
        (`pending`: the next request after a system prompt goes where the first went, before the first has
        finished)."""
        m = self.index.match(hashes, [replica])[replica]
        arriving = self._arriving.get(replica)
        if not arriving:
            return m
        more = 0
        for h in hashes[m.total :]:
            if h not in arriving:
                break
            more += 1
        return PrefixMatch(m.gpu, m.local, m.remote, more)

    def _private(
        self, candidates: Sequence[Hashable], matches: dict[Hashable, PrefixMatch], per: dict[Hashable, list[int]]
    ) -> Hashable | None:
        """The candidate holding the longest prefix of the request, if that prefix is private there: no other
        candidate holds as much, and its deepest block is in the prompt of no other request this router has
        in flight on that replica (a conversation's own history, not a system prompt many requests are
        sharing now); else None."""
        best = max(candidates, key=lambda r: matches[r].total)
        held = matches[best].total
        if held == 0 or any(matches[r].total >= held for r in candidates if r != best):
            return None
        rec = self._replicas.get(best)
        return best if rec is None or rec.sharing.get(per[best][held - 1], 0) == 0 else None

    def _requests(self, replica: Hashable) -> int:
        rec = self._replicas.get(replica, _Replica())
        return len(rec.inflight) + rec.others

    def _load(self, replica: Hashable) -> float:
        rec = self._replicas.get(replica, _Replica())
        return sum(e.work for e in rec.inflight.values()) + rec.others
