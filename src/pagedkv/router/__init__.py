"""pagedkv.router: a prefix-aware router over replicas that publish KV events (torch-free).

- `ReplicaIndex` (`index.py`): block hash -> {replica: media}, fed with `EventBatch`es from each replica.
- `Router` and the policies (`policy.py`): round-robin, pure longest-prefix, and the cost model
  `compute_weight * blocks to compute + discounts * blocks to load + queue_weight * queued work`.
- `request_hashes`: a prompt's block hashes, as the replicas' events name them.
- `ReplicaStats` (`replica_stats.py`): the routing message a replica reports (its events' endpoints, its
  block naming, its pool and load).
- `EventStreams` (`streams.py`, needs pyzmq): the replicas' ZMQ event streams folded into one `ReplicaIndex`,
  exact through gaps, restarts and dead replicas.

Real replicas publish with `EngineConfig(kv_events=True)` and `Engine.take_event_batch()`;
`LiveRouter` (`live.py`) ranks live replicas for `pagedkv.serve.ray_router.PagedKVRequestRouter` (Ray Serve),
with the decision (`rank`), policy object (`CostRouting`) and load model (`FleetLoad`, `load.py`) the simulator
(`pagedkv simulate --replicas`) runs.
"""

from pagedkv.router.index import PrefixMatch, ReplicaIndex
from pagedkv.router.load import FleetLoad, Placement
from pagedkv.router.policy import (
    LIVE_IMBALANCE_THRESHOLD,
    LIVE_WEIGHTS,
    POLICIES,
    CostRouting,
    CostWeights,
    Decision,
    LongestPrefix,
    Ranking,
    RoundRobin,
    Router,
    make_policy,
    rank,
    request_hashes,
)
from pagedkv.router.replica_stats import EngineGauges, ReplicaStats

__all__ = [
    "LIVE_IMBALANCE_THRESHOLD", "LIVE_WEIGHTS", "POLICIES", "CostRouting", "CostWeights", "Decision", "EngineGauges", "FleetLoad", "LongestPrefix", "Placement", "ReplicaIndex", "PrefixMatch",
    "Ranking", "ReplicaStats", "RoundRobin", "Router", "make_policy", "rank", "request_hashes",
]  # fmt: skip
