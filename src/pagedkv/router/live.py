"""`LiveRouter`: the routing decision for live replicas (Ray Serve's `PagedKVRequestRouter` wraps it).

    router = LiveRouter()
    router.observe("r0", stats)            # a replica's `ReplicaStats`: where its events are, its sizes, its load
    ranking = router.rank(["r0", "r1"], prompt_ids, cache_salt=None)   # ranking.order: best first
    router.predict(request_id, ranking); router.routed(request_id, ranking.order[0]); ...
    router.completed(request_id)

It owns one `EventStreams` (the replicas' ZMQ KV events folded into a `ReplicaIndex`, exact through gaps,
restarts and dead replicas) and one `FleetLoad` (`pagedkv.router.load`: what it sent and has not seen
complete), and decides with `pagedkv.router.policy.rank` and `CostRouting`: the decision, policy object,
defaults and load model the simulator (`pagedkv simulate --replicas`) runs. What is its own:

- the request's block hashes per candidate, as each replica names them (`ReplicaStats` block size, hash
  function, epoch); a replica whose events it does not follow yet matches nothing;
- other routers' requests: a new report's `num_running + num_waiting` beyond what this router had in flight
  there when it arrived (`FleetLoad.report`), held until the next report (the report's own count is up to a
  stats period old, and at tens of requests a second counted requests long finished);
- a pick counts at once (`predict` then `routed`), since Ray ranks several requests concurrently; it is taken
  back if Ray ranks the request again (`withdraw`) and moved if Ray places it elsewhere.

Decisions never wait for the streams' periodic check (a round trip to each replica silent for
`sync_interval_s`, `pagedkv.router.event_streams`): `rank` only applies the batches that have arrived, and
the check runs when a request completes (its cost: docs/scale-out.md, "Events that never lie").

A replica whose `kv_events` endpoint changes (Ray restarted it elsewhere) is re-followed from scratch; one
that leaves the candidate set for good is forgotten (`forget`). Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.intake import salt_bytes
from pagedkv.events.publisher import REPLAY_TIMEOUT_MS
from pagedkv.router.event_streams import EventStreams
from pagedkv.router.index import ReplicaIndex
from pagedkv.router.load import FleetLoad, Placement, placement
from pagedkv.router.policy import (
    LIVE_IMBALANCE_THRESHOLD,
    CostRouting,
    CostWeights,
    Ranking,
    rank,
    request_hashes,
)
from pagedkv.router.replica_stats import ReplicaStats

MAX_PREDICTED = 100_000


class LiveRouter:
    """The live replicas' router: their event streams, the load this router sent them, the cost policy."""

    def __init__(
        self,
        *,
        weights: CostWeights | None = None,
        imbalance_threshold: int = LIVE_IMBALANCE_THRESHOLD,
        replay_timeout_ms: int = REPLAY_TIMEOUT_MS,
        sync_interval_s: float = 1.0,
    ) -> None:
        self.policy = CostRouting(weights, imbalance_threshold)
        self.streams = EventStreams(
            ReplicaIndex(), replay_timeout_ms=replay_timeout_ms, sync_interval_s=sync_interval_s
        )
        self.load = FleetLoad()
        self._stats: dict[Hashable, ReplicaStats] = {}
        # request id -> replica -> what it queues if it is sent there
        self._predicted: dict[Hashable, dict[Hashable, Placement]] = {}

    @property
    def index(self) -> ReplicaIndex:
        return self.streams.index

    @property
    def imbalance_threshold(self) -> int:
        return self.policy.imbalance_threshold

    def observe(self, replica: Hashable, stats: ReplicaStats | None) -> None:
        """Take a replica's latest routing stats; follow its events (again, if its endpoints changed)."""
        if stats is None:
            return
        old = self._stats.get(replica)
        self._stats[replica] = stats
        if stats != old:  # a new report: what it counts beyond this router's requests is other routers'
            self.load.report(replica, stats.load)
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
        self._stats.pop(replica, None)
        self.streams.remove(replica)
        self.load.forget(replica)

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
        salt = salt_bytes(cache_salt)  # as the engine reads it, or its one-line refusal
        by_keys: dict[tuple[Any, ...], list[int]] = {}  # replicas agree on these normally: one hashing
        per: dict[Hashable, list[int]] = {}
        for r in candidates:
            keys = self._keying(r)
            if keys not in by_keys:
                by_keys[keys] = request_hashes(
                    list(prompt_ids), keys[0], salt=salt, hash_fn=keys[1], epoch=keys[2]
                )
            per[r] = by_keys[keys]
        return rank(self.policy, self.index, self.load, candidates, per, set(self.streams.live()))

    def predict(self, request_id: Hashable, ranking: Ranking) -> None:
        """Remember, per candidate, the work a request would queue there (committed by `routed`; kept until
        `completed`, the oldest dropped past `MAX_PREDICTED` requests never completed)."""
        self._predicted[request_id] = {
            r: placement(r, ranking.hashes.get(r, []), m) for r, m in ranking.matches.items()
        }
        while len(self._predicted) > MAX_PREDICTED:
            del self._predicted[next(iter(self._predicted))]

    def routed(self, request_id: Hashable, replica: Hashable) -> None:
        """The request goes to `replica`: its work and its blocks on their way count there. Called when the
        router decides (the first of its ranking) and again when Ray has placed it: a request placed elsewhere
        moves, one placed where predicted is left as it is."""
        if self.load.where(request_id) == replica:
            return
        predicted = self._predicted.get(request_id, {}).get(replica)
        self.load.place(request_id, predicted if predicted is not None else Placement(replica, 0, None))

    def withdraw(self, request_id: Hashable) -> None:
        """Take back a request's placement (it is being ranked again: its own work must not count against the
        replica it was meant for)."""
        self.load.release(request_id)

    def completed(self, request_id: Hashable) -> None:
        """The request has finished; the streams' periodic check runs here when it is due (not in `rank`:
        see the module docstring)."""
        self._predicted.pop(request_id, None)
        self.load.release(request_id)
        self.streams.poll()

    def _keying(self, replica: Hashable) -> tuple[int, str, int]:
        """(block size, hash function, epoch) the replica keys its blocks with (defaults until it reports)."""
        stats = self._stats.get(replica) or ReplicaStats()
        return stats.block_size, stats.hash_fn, stats.epoch
