"""`pagedkv simulate --replicas N`: N modelled GPUs behind a router, each with a host tier, sharing a store.

Each replica is the single-GPU simulator's own replay (`pagedkv.sim.simulator.Replay`: the real `Scheduler`
over the `paged-prefix` allocator, the roofline step model, the same KV budget, sampling and leak check) with
its own clock, fed the requests the router sends it; one replica without tiers is `simulate --allocators
paged-prefix`. All replicas share one `Arrivals` (a chat's next turn arrives after its previous one finishes,
wherever that ran). Around them:

- Events: each replica's manager records its cache events; an `EventFeed` turns them into the replica's
  `EventLog` (GPU medium) after every step, the host tier reports to the same log (CPU medium), the shared
  store to a log of its own (REMOTE), and the router's `ReplicaIndex` is fed those batches, exactly as a
  router process would be over ZMQ (in-process here, same `EventBatch`es, no sockets).
- Host tier (`host_tier_bytes` per replica, 0 = none): a block evicted from the GPU's prefix cache is written
  back to host RAM (LRU over blocks; the oldest falls out when full).
- Remote store (`remote_tier`): every block a replica publishes is written through to one store all replicas
  share (LRU when `remote_bytes` is set; unbounded by default, like a store sized for the working set).
- Router (`round-robin`, `prefix`, `cost`; see `pagedkv.router.policy`): picks a replica per request when it
  arrives, from the index, with the live router's decision (`pagedkv.router.policy.rank`: the same policy
  object, defaults and load model, `pagedkv.router.load.FleetLoad`, fed the same events). A request counts
  on its replica from when it is routed until it finishes (or is rejected).
- Loads: the blocks after the replica's GPU prefix that its host tier, then the store, hold (the chain stops
  at the first miss) are copied in before the request joins the replica's queue: host over the GPU's
  host link, store over the replica's network link, each link serving one copy at a time. A loaded prefix
  lands in the GPU prefix cache (admitted, marked computed, released), so the scheduler admits the request
  with those tokens cached. If the GPU has no room at that moment, the load is skipped and the tokens are
  recomputed (counted in `loads_skipped`).

Link bandwidths (peak, one direction): host link PCIe Gen5 x16, 64 GB/s, for H100/H200; PCIe Gen4 x16,
32 GB/s, for A100 and L4 (PCI-SIG figures); store 12.5 GB/s per replica (a 100 Gb/s NIC) plus 0.5 ms per
lookup round trip. Write-backs and write-throughs are assumed to overlap with compute (not charged).

Hit rates (fractions of prompt tokens): `gpu_hit_rate` tokens already on the replica's GPU at admission,
`host_hit_rate` and `remote_hit_rate` tokens loaded from each tier; `prefix_hit_rate` their sum. Time is
exact per replica; across replicas, arrivals are routed once every busy replica's clock has reached them, so
the router never sees the future by more than one step.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.events import CPU, GPU, REMOTE, BlockRemoved, BlockStored, EventFeed, EventLog
from pagedkv.router import ReplicaIndex, Router, request_hashes
from pagedkv.sim.kv_budget import KVBudget
from pagedkv.sim.report import table
from pagedkv.sim.run_metrics import request_metrics
from pagedkv.sim.simulator import Arrivals, Replay, SimConfig, check_budget
from pagedkv.sim.workload import Workload
from pagedkv.workloads.generators import GeneratedRequest

GB = 1e9
GIB = 1024**3
STORE = "store"  # the shared store's name in the router index (never a routing target)
PCIE_GEN5_X16 = 64e9
PCIE_GEN4_X16 = 32e9
DEFAULT_REMOTE_BANDWIDTH = 12.5e9  # 100 Gb/s
DEFAULT_REMOTE_LATENCY_S = 0.0005
# `simulate --replicas N`'s table: one row per router
_REPLICA_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("prefix hit", "prefix_hit_rate", "pct"), ("GPU", "gpu_hit_rate", "pct"), ("host", "host_hit_rate", "pct"),
    ("remote", "remote_hit_rate", "pct"), ("TTFT p50", "ttft_p50_s", "s"), ("TTFT p99", "ttft_p99_s", "s"),
    ("TPOT p50", "tpot_p50_s", "ms"), ("TPOT p99", "tpot_p99_s", "ms"), ("tok/s", "tokens_per_s", ".0f"),
    ("req/s", "requests_per_s", ".2f"),
)  # fmt: skip


def host_link_bandwidth(gpu_name: str) -> float:
    """Peak host-to-device bandwidth of the GPU's PCIe link (see the module docstring)."""
    return PCIE_GEN5_X16 if gpu_name.startswith(("h100", "h200")) else PCIE_GEN4_X16


@dataclass(frozen=True)
class TierConfig:
    host_tier_bytes: int = 0  # per replica; 0: no host tier
    remote_tier: bool = False
    remote_bytes: int | None = None  # None: unbounded
    host_bandwidth: float | None = None  # bytes/s; None: from the GPU (`host_link_bandwidth`)
    remote_bandwidth: float = DEFAULT_REMOTE_BANDWIDTH
    remote_latency_s: float = DEFAULT_REMOTE_LATENCY_S

    def __post_init__(self) -> None:
        if self.host_tier_bytes < 0 or (self.remote_bytes is not None and self.remote_bytes <= 0):
            raise InvalidArgumentError("tier sizes must be >= 0 (host) and > 0 (remote, when given)")
        if not self.remote_bandwidth > 0 or (self.host_bandwidth is not None and not self.host_bandwidth > 0):
            raise InvalidArgumentError("tier bandwidths must be > 0")

    def describe(self) -> str:
        host = f"host tier {self.host_tier_bytes / GIB:g} GiB/replica" if self.host_tier_bytes else "no host tier"
        if not self.remote_tier:
            return f"{host}, no remote store"
        size = "unbounded" if self.remote_bytes is None else f"{self.remote_bytes / GIB:g} GiB"
        return f"{host}, remote store {size} at {self.remote_bandwidth / GB:g} GB/s per replica"


class _LRU:
    """A modelled tier: block hashes in recency order, with a capacity in blocks, reporting to an event log.
    (Not `pagedkv.core.eviction`'s LRU: that one orders a pool's block ids; a tier here holds only names.)"""

    def __init__(self, capacity: int | None, log: Any, medium: str) -> None:
        self.capacity, self.log, self.medium = capacity, log, medium
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, h: int) -> bool:
        return h in self.keys

    def put(self, hashes: Sequence[int], parent: int | None = None) -> None:
        """Insert a chain of blocks (`hashes[0]`'s parent is `parent`); those already held are touched."""
        if self.capacity == 0:
            return
        keys = self.keys
        run: list[int] = []
        prev = run_parent = parent
        for h in hashes:
            if h in keys:
                keys.move_to_end(h)
                if run:
                    self.log.stored(self.medium, run, parent=run_parent)
                    run = []
            else:
                if not run:
                    run_parent = prev
                run.append(h)
                keys[h] = None
            prev = h
        if run:
            self.log.stored(self.medium, run, parent=run_parent)
        if self.capacity is not None and len(keys) > self.capacity:
            old = [keys.popitem(last=False)[0] for _ in range(len(keys) - self.capacity)]
            self.log.removed(self.medium, old)
            self.evictions += len(old)

    def touch(self, h: int) -> None:
        if h in self.keys:
            self.keys.move_to_end(h)


@dataclass
class _Plan:
    """One request on its way to a replica: what it holds where, and when its loads finish."""

    g: GeneratedRequest
    arrival: float
    hashes: list[int]
    gpu: int
    host: int
    remote: int
    sources: list[int] = field(default_factory=list)  # per prefix block: 0 GPU, 1 host, 2 store


class _Replica(Replay):
    """One modelled GPU behind the router: the simulator's replay plus its event feed, host tier, links, the
    requests on their way to it (`loading`); `done(request_id)` is called when a request routed here ends."""

    def __init__(
        self, name: int, config: SimConfig, workload: Workload, budget: KVBudget, arrivals: Arrivals,
        tiers: TierConfig, done: Callable[[str], None],
    ) -> None:  # fmt: skip
        super().__init__(config, workload, budget, arrivals=arrivals, record_events=True)
        self.name = name
        self.log = EventLog(config.block_size)
        self.feed = EventFeed(self.manager, [self.log])
        host_blocks = tiers.host_tier_bytes // budget.bytes_per_block if tiers.host_tier_bytes else 0
        self.host = _LRU(host_blocks, self.log, CPU)
        self.host_link_free = self.net_link_free = 0.0
        self.loading: list[tuple[float, int, _Plan]] = []  # (release time, tiebreak, plan) heap
        self.plans: dict[str, _Plan] = {}  # request id -> its plan, for every request routed here
        self.done = done
        self.stalled = False  # nothing schedulable until something new arrives

    def busy(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.loading)

    def next_time(self) -> float:
        if self.scheduler.has_unfinished() and not self.stalled:
            return self.now
        return self.loading[0][0] if self.loading else math.inf

    def drop_rejected(self, output: Any) -> None:
        for req in getattr(output, "rejected", ()):
            self.done(req.request_id)
        super().drop_rejected(output)

    def run_step(self, output: Any, progress: Callable[[int], None] | None) -> None:
        before = set(self.live)
        super().run_step(output, progress)
        for rid in before.difference(self.live):  # finished this step
            self.done(rid)

    def tier_tokens(self) -> np.ndarray:
        """Prompt tokens its requests found at first admission: (on its GPU, loaded from host, from the store)."""
        bs = self.config.block_size
        out = np.zeros(3, dtype=np.int64)
        for rid in self.seen:
            cached = int(self.cached[self.order[int(rid)]])
            got = np.bincount(np.asarray(self.plans[rid].sources[: cached // bs], dtype=np.int64), minlength=3) * bs
            out += (cached - got[1] - got[2], got[1], got[2])
        return out


class ReplicaSimulation:
    """Replays one workload over `num_replicas` replicas under one router policy; `run()` returns metrics."""

    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        *,
        num_replicas: int,
        router: str,
        tiers: TierConfig | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise InvalidArgumentError(f"--replicas must be an int >= 1, got {num_replicas!r}")
        config = replace(config, allocator="paged-prefix")
        self.config, self.workload = config, workload
        self.tiers = tiers or TierConfig()
        budget = config.budget()
        check_budget(config, budget)
        self.block_bytes = budget.bytes_per_block
        self.host_bw = self.tiers.host_bandwidth or host_link_bandwidth(config.gpu.name)
        self.arrivals = Arrivals(workload)
        self.router = Router(list(range(num_replicas)), router, ReplicaIndex())
        done = self.router.load.release
        self.replicas = [
            _Replica(i, config, workload, budget, self.arrivals, self.tiers, done) for i in range(num_replicas)
        ]
        self.store_log = EventLog(config.block_size)
        remote_blocks = None if self.tiers.remote_bytes is None else self.tiers.remote_bytes // self.block_bytes
        self.store = _LRU(remote_blocks if self.tiers.remote_tier else 0, self.store_log, REMOTE)
        self.progress = progress
        self.loads_skipped = 0
        self.order = {g.index: i for i, g in enumerate(workload.requests)}
        self.arrival = np.full(len(workload.requests), np.nan)  # when each request reached the router

    # --- events ----------------------------------------------------------------------------------

    def _publish(self, r: _Replica) -> None:
        """After a step: the replica's GPU events, then what they imply for its host tier and the store."""
        r.feed.poll()
        batch = r.log.take_batch()
        if batch is None:
            return
        index = self.router.index
        index.apply(r.name, batch)
        for e in batch.events:
            if isinstance(e, BlockRemoved) and e.medium == GPU:
                for h in e.block_hashes:  # evicted from the device: written back to host RAM
                    r.host.put([h])
            elif isinstance(e, BlockStored) and e.medium == GPU and self.tiers.remote_tier:
                self.store.put(e.block_hashes, e.parent_block_hash)  # written through to the shared store
        for log, name in ((r.log, r.name), (self.store_log, STORE)):
            more = log.take_batch()
            if more is not None:
                index.apply(name, more)

    # --- arrivals --------------------------------------------------------------------------------

    def _route(self, g: GeneratedRequest, t: float) -> None:
        """Pick `g`'s replica; its loads from host RAM and the store are queued on that replica's links."""
        hashes = request_hashes(g.prompt_token_ids, self.config.block_size)
        decision = self.router.route(str(g.index), hashes)
        r = next(x for x in self.replicas if x.name == decision.replica)
        m = decision.match
        remote = m.remote if self.tiers.remote_tier else 0
        plan = _Plan(g, t, hashes, m.gpu, m.local, remote)
        media = self.router.index.media
        held = m.gpu + m.local + m.remote  # not the blocks on their way (`pending`): those are computed there
        plan.sources = [0 if GPU in media(h, r.name) else 1 if h in r.host else 2 for h in hashes[:held]]
        r.plans[str(g.index)] = plan
        done = t
        if plan.host:
            start = max(t, r.host_link_free)
            r.host_link_free = done_host = start + plan.host * self.block_bytes / self.host_bw
            done = max(done, done_host)
        if plan.remote:
            start = max(t, r.net_link_free)
            r.net_link_free = done_net = (
                start + self.tiers.remote_latency_s + plan.remote * self.block_bytes / self.tiers.remote_bandwidth
            )
            done = max(done, done_net)
        if not r.busy():
            r.now = max(r.now, t)
        heapq.heappush(r.loading, (done, g.index, plan))
        r.stalled = False

    def _release(self, r: _Replica) -> None:
        """Requests whose loads have finished by the replica's clock join its queue (loaded prefix cached)."""
        while r.loading and r.loading[0][0] <= r.now:
            _, _, plan = heapq.heappop(r.loading)
            if plan.host or plan.remote:
                self._load(r, plan)
            r.add(plan.g, plan.arrival)
            r.stalled = False
        self._publish(r)

    def _load(self, r: _Replica, plan: _Plan) -> None:
        """The loaded prefix lands in the GPU's prefix cache (admitted, computed, released); no room: skipped,
        and the request recomputes what was to come from the tiers."""
        k = len(plan.sources) * self.config.block_size
        adm = r.manager.admit(np.asarray(plan.g.prompt_token_ids[:k]))
        if adm is None:
            self.loads_skipped += 1
            plan.sources = plan.sources[: plan.sources.index(1) if 1 in plan.sources else None]
            plan.sources = plan.sources[: plan.sources.index(2) if 2 in plan.sources else None]
            return
        r.manager.mark_computed([adm.seq_id])
        r.manager.free(adm.seq_id)
        for h, src in zip(plan.hashes, plan.sources):
            if src:
                (r.host if src == 1 else self.store).touch(h)

    # --- the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Advance whichever comes first, the next arrival (routed) or the replica whose clock is earliest
        (released loads, one step); at the end every replica's pool must be whole and empty."""
        arrivals = self.arrivals
        while True:
            t_arr = arrivals.next_s()
            busy = [r for r in self.replicas if r.busy()]
            t_rep, r = min(((x.next_time(), x) for x in busy), key=lambda p: p[0], default=(math.inf, None))
            if t_arr == math.inf and t_rep == math.inf:
                if busy:
                    raise busy[0].stuck()
                break
            if t_arr <= t_rep:
                t, g = arrivals.pop()
                self.arrival[self.order[g.index]] = t
                self._route(g, t)
                continue
            assert r is not None, "replicas: a busy replica without a next time"
            r.now = max(r.now, t_rep)
            self._release(r)
            if r.scheduler.has_unfinished():
                r.stalled = not r.step(self.progress)
                if not r.stalled:
                    self._publish(r)
        for r in self.replicas:
            r.finish()  # the pool whole and empty (a leak is an InvariantError)
        return self.summary()

    # --- metrics ---------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The fleet's metrics: `pagedkv.sim.run_metrics.request_metrics` over every replica's requests, hit
        rates by tier, and what the router and tiers did."""
        wl, reps = self.workload, self.replicas
        first = np.fmax.reduce([r.first_token for r in reps])  # each request ran on one replica (NaN elsewhere)
        finish = np.fmax.reduce([r.finish_time for r in reps])
        output = np.array([g.output_len for g in wl.requests], dtype=np.int64)
        req = request_metrics(self.arrival, first, finish, output)
        total = int(sum(g.prompt_len for g in wl.requests))
        tiers = np.sum([r.tier_tokens() for r in reps], axis=0)

        def rate(tokens: Any) -> float:
            return float(tokens / total) if total else 0.0

        return {
            "router": self.router.policy.name,
            "replicas": len(reps),
            "num_requests": req["num_requests"],
            "rejected": sum(r.out.rejected for r in reps),
            "prefix_hit_rate": rate(tiers.sum()),
            "gpu_hit_rate": rate(tiers[0]),
            "host_hit_rate": rate(tiers[1]),
            "remote_hit_rate": rate(tiers[2]),
            **{k: req[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")},
            **{k: req[k] for k in ("tokens_per_s", "requests_per_s", "span_s")},
            "preemptions": sum(r.out.preemptions for r in reps),
            "loads_skipped": self.loads_skipped,
            "requests_per_replica": [len(r.seen) for r in reps],
            "host_evictions": sum(r.host.evictions for r in reps),
            "remote_evictions": self.store.evictions,
            "remote_blocks": len(self.store.keys),
        }


@dataclass
class ReplicaReport:
    """One workload under several routers (same replicas, tiers and requests)."""

    config: SimConfig
    workload: Workload
    num_replicas: int
    tiers: TierConfig
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.config.model.name,
            "gpu": self.config.gpu.name,
            "replicas": self.num_replicas,
            "tiers": self.tiers.describe(),
            "workload": self.workload.name,
            "workload_notes": self.workload.notes(),
            "block_size": self.config.block_size,
            "max_model_len": self.config.max_model_len,
            "routers": self.results,
        }

    def text(self) -> str:
        """`simulate --replicas N`'s table: what ran where, then one row per router and its requests per
        replica."""
        c = self.config
        out = [
            f"{self.num_replicas} x {c.model.name} on {c.gpu.name}, {self.tiers.describe()}",
            f"workload: {self.workload.name}; {self.workload.notes()}",
            "",
            *table(self.results, "router", _REPLICA_COLUMNS),
            "",
        ]
        out += [f"{name}: requests per replica {res['requests_per_replica']}" for name, res in self.results.items()]
        return "\n".join(out)


def run_replicas(
    config: SimConfig,
    workload: Workload,
    *,
    num_replicas: int,
    routers: Sequence[str],
    tiers: TierConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplicaReport:
    """The workload over `num_replicas` replicas under each router in turn."""
    from pagedkv.router import POLICIES

    bad = [r for r in routers if r not in POLICIES]
    if bad or not routers:
        raise InvalidArgumentError(f"unknown router(s) {bad or routers!r}; choose from {', '.join(POLICIES)}")
    tiers = tiers or TierConfig()
    report = ReplicaReport(config, workload, num_replicas, tiers)
    for name in routers:
        sim = ReplicaSimulation(config, workload, num_replicas=num_replicas, router=name, tiers=tiers, progress=progress)
        report.results[name] = sim.run()
    return report
