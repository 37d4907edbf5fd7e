"""`PagedKVRequestRouter`: Ray Serve's pluggable request router, deciding with pagedkv's KV-aware policy.

    from ray.serve.config import RequestRouterConfig
    RequestRouterConfig(request_router_class="pagedkv.serve.ray_router:PagedKVRequestRouter",
                        request_router_kwargs={"imbalance_threshold": 16},
                        request_routing_stats_period_s=1.0)

Ray calls `choose_replicas(candidates, pending_request)` for each request; this router returns the candidates
ranked by `pagedkv.router.live.LiveRouter` (one rank each, best first: Ray sends the request to the first
that accepts it, i.e. is below `max_ongoing_requests`). The ranking is the cost policy of `pagedkv.router`
over an index fed by every replica's KV events (ZMQ, vLLM's wire format, exact through gaps, restarts and
dead replicas: `pagedkv.router.event_streams`), with a load-imbalance fallback. The replicas tell the router
where their events are, which hashing they use and their load through `record_routing_stats` (see
`pagedkv.serve.ray_app.PagedKVReplica`); Ray refreshes those every `request_routing_stats_period_s`.

A request is recognised by an argument having `prompt_token_ids` (a `ReplicaRequest`); a call with an
argument naming a replica (`ReplicaTarget`) goes to that replica; any other call goes to a random replica.
Ray's hooks keep the router's own count of work in flight per replica (`on_request_routed` /
`on_request_completed`), and forget a replica Ray removed (`update_replicas`, `on_replica_actor_died`).

The router runs in every process that holds a handle to the deployment (the ingress replicas); each keeps its
own index from the same event streams.

A ranking is for its own request: a replica found for it goes to that request (Ray's default matching by
internal request id), never to whichever request has waited longest (Ray's `FIFOMixin`, with which a
replica ranked for one conversation's history would serve another conversation's turn).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from pagedkv.events.publisher import REPLAY_TIMEOUT_MS
from pagedkv.router.live import LiveRouter
from pagedkv.router.policy import LIVE_IMBALANCE_THRESHOLD, LIVE_WEIGHTS, CostWeights
from pagedkv.router.replica_stats import ReplicaStats

logger = logging.getLogger(__name__)


def target_of(pending: PendingRequest | None) -> str | None:
    """The replica a directed call names (`ReplicaTarget.replica`: Ray's replica unique id), or None."""
    if pending is None:
        return None
    for arg in pending.args:
        target = getattr(arg, "replica", None)
        if isinstance(target, str):
            return target
    return None


def request_of(pending: PendingRequest | None) -> Any:
    """The request object of a pending call (the first argument with `prompt_token_ids`), or None."""
    if pending is None:
        return None
    for arg in pending.args:
        if hasattr(arg, "prompt_token_ids"):
            return arg
    return None


class PagedKVRequestRouter(RequestRouter):
    def initialize_state(
        self,
        imbalance_threshold: int = LIVE_IMBALANCE_THRESHOLD,
        compute_weight: float = LIVE_WEIGHTS.compute_weight,
        local_discount: float = LIVE_WEIGHTS.local_discount,
        remote_discount: float = LIVE_WEIGHTS.remote_discount,
        queue_weight: float = LIVE_WEIGHTS.queue_weight,
        duplicate_weight: float = LIVE_WEIGHTS.duplicate_weight,
        replay_timeout_ms: int = REPLAY_TIMEOUT_MS,
        sync_interval_s: float = 1.0,
    ) -> None:
        self.live = LiveRouter(
            weights=CostWeights(compute_weight, local_discount, remote_discount, queue_weight, duplicate_weight),
            imbalance_threshold=imbalance_threshold,
            replay_timeout_ms=replay_timeout_ms,
            sync_interval_s=sync_interval_s,
        )
        self.decisions = 0
        self.fallbacks = 0
        self.displaced = 0  # requests Ray placed on another replica than the first of their ranking
        self.busy_s = 0.0  # time spent ranking (in the process that holds the handle, beside the callers)
        self._first: dict[str, ReplicaID] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = request_of(pending_request)
        if request is None or pending_request is None:
            target = target_of(pending_request)
            named = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if named:
                return [named]
            return [[random.choice(candidate_replicas)]]  # other calls: spread, not all on the first
        began = time.perf_counter()
        for r in candidate_replicas:
            self.live.observe(r.replica_id, ReplicaStats.from_dict(r.routing_stats) if r.routing_stats else None)
        by_id = {r.replica_id: r for r in candidate_replicas}
        rid = pending_request.metadata.internal_request_id
        self.live.withdraw(rid)  # Ray may ask again for the same request: rank it without its own placement
        ranking = self.live.rank(list(by_id), list(request.prompt_token_ids), cache_salt=request.cache_salt)
        self.live.predict(rid, ranking)
        self.live.routed(rid, ranking.order[0])  # count it at once: Ray decides several requests concurrently
        self.decisions += 1
        self.fallbacks += ranking.fallback
        self._first[rid] = ranking.order[0]
        self.busy_s += time.perf_counter() - began
        return [[by_id[rid]] for rid in ranking.order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if request_of(pending_request) is not None:
            rid = pending_request.metadata.internal_request_id
            self.displaced += self._first.pop(rid, replica_id) != replica_id
            self.live.routed(rid, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._first.pop(internal_request_id, None)
        self.live.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in old - set(self._replica_id_set):
            self.live.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.live.forget(replica_id)
