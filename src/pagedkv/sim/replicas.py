"""`pagedkv simulate --replicas N`: N modelled GPUs behind a router, each with a host tier, sharing a store.

Each replica is the single-GPU simulator's machinery (the real `Scheduler` over a real `PagedKVManager` with
prefix caching, the roofline `StepTimeModel`, the same KV budget) with its own clock. Around them:

- Events: each replica's manager records its cache events; a `ManagerFeed` turns them into the replica's
  `EventLog` (GPU medium) after every step, the host tier reports to the same log (CPU medium), the shared
  store to a log of its own (REMOTE), and the router's `PrefixIndex` is fed those batches, exactly as a
  router process would be over ZMQ (in-process here, same `EventBatch`es, no sockets).
- Host tier (`host_tier_bytes` per replica, 0 = none): a block evicted from the GPU's prefix cache is written
  back to host RAM (LRU over blocks; the oldest falls out when full).
- Remote store (`remote_tier`): every block a replica publishes is written through to one store all replicas
  share (LRU when `remote_bytes` is set; unbounded by default, like a store sized for the working set).
- Router (`round-robin`, `prefix`, `cost`; see `pagedkv.router.policy`): picks a replica per request when it
  arrives, from the index. Queued work for the cost policy = the replica's prefill blocks routed but not yet
  computed + its running sequences.
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

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.sim.simulator import EOS_TOKEN_ID, SimConfig
from pagedkv.sim.workload import Workload
from pagedkv.workloads.generators import GeneratedRequest

GB = 1e9
GIB = 1024**3
STORE = "store"  # the shared store's name in the router index (never a routing target)
PCIE_GEN5_X16 = 64e9
PCIE_GEN4_X16 = 32e9
DEFAULT_REMOTE_BANDWIDTH = 12.5e9  # 100 Gb/s
DEFAULT_REMOTE_LATENCY_S = 0.0005


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
    """Block hashes in recency order, with a capacity in blocks; reports to an event log."""

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
    compute_blocks: int
    sources: list[int] = field(default_factory=list)  # per prefix block: 0 GPU, 1 host, 2 store
    backlog: int = 0  # what it adds to the replica's queued work until its first token
    release: float = 0.0


class _Replica:
    def __init__(self, name: int, config: SimConfig, tiers: TierConfig, num_blocks: int) -> None:
        from pagedkv.core import PagedKVManager
        from pagedkv.engine.scheduler import Scheduler
        from pagedkv.events import CPU, EventLog, ManagerFeed

        self.name = name
        self.bs = config.block_size
        self.manager = PagedKVManager(num_blocks, self.bs, record_events=True)
        self.scheduler = Scheduler(self.manager, config.scheduler)
        self.step_model = config.step_model()
        self.log = EventLog(self.bs)
        self.feed = ManagerFeed(self.manager, self.log)
        bytes_per_block = config.budget().bytes_per_block
        self.host = _LRU(tiers.host_tier_bytes // bytes_per_block if tiers.host_tier_bytes else 0, self.log, CPU)
        self.now = 0.0
        self.host_link_free = self.net_link_free = 0.0
        self.loading: list[tuple[float, int, _Plan]] = []  # (release time, tiebreak, plan) heap
        self.live: dict[str, _Plan] = {}
        self.backlog = 0  # prefill blocks routed here and not yet computed
        self.stalled = False  # nothing schedulable until something new arrives
        self.steps = 0

    def busy(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.loading)

    def next_time(self) -> float:
        if self.scheduler.has_unfinished() and not self.stalled:
            return self.now
        return self.loading[0][0] if self.loading else math.inf

    def load(self) -> float:
        return self.backlog + self.scheduler.num_running


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
        from pagedkv.events import REMOTE, EventLog
        from pagedkv.router import PrefixIndex, Router

        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise InvalidArgumentError(f"--replicas must be an int >= 1, got {num_replicas!r}")
        config = replace(config, allocator="paged-prefix")
        self.config, self.workload = config, workload
        self.tiers = tiers or TierConfig()
        budget = config.budget()
        if budget.num_tokens < config.max_model_len:
            raise CapacityError(
                f"the KV budget holds {budget.num_tokens} tokens, less than one request of "
                f"max_model_len={config.max_model_len}; lower --max-model-len or give the cache more memory"
            )
        self.block_bytes = budget.bytes_per_block
        self.host_bw = self.tiers.host_bandwidth or host_link_bandwidth(config.gpu.name)
        self.replicas = [_Replica(i, config, self.tiers, budget.num_blocks) for i in range(num_replicas)]
        self.router = Router(list(range(num_replicas)), router, PrefixIndex())
        self.store_log = EventLog(config.block_size)
        remote_blocks = None if self.tiers.remote_bytes is None else self.tiers.remote_bytes // self.block_bytes
        self.store = _LRU(remote_blocks if self.tiers.remote_tier else 0, self.store_log, REMOTE)
        self.progress = progress
        self.loads_skipped = 0

    # --- events ----------------------------------------------------------------------------------

    def _publish(self, r: _Replica) -> None:
        """After a step: the replica's GPU events, then what they imply for its host tier and the store."""
        from pagedkv.events import BlockRemoved, BlockStored

        r.feed.poll()
        batch = r.log.take_batch()
        if batch is None:
            return
        index = self.router.index
        index.apply(r.name, batch)
        for e in batch.events:
            if isinstance(e, BlockRemoved) and e.medium == "GPU":
                for h in e.block_hashes:  # evicted from the device: written back to host RAM
                    r.host.put([h])
            elif isinstance(e, BlockStored) and e.medium == "GPU" and self.tiers.remote_tier:
                self.store.put(e.block_hashes, e.parent_block_hash)  # written through to the shared store
        for log, name in ((r.log, r.name), (self.store_log, STORE)):
            more = log.take_batch()
            if more is not None:
                index.apply(name, more)

    # --- arrivals --------------------------------------------------------------------------------

    def _route(self, g: GeneratedRequest, t: float) -> None:
        from pagedkv.events import GPU
        from pagedkv.router import request_hashes

        hashes = request_hashes(g.prompt_token_ids, self.config.block_size)
        loads = [r.load() for r in self.replicas]
        decision = self.router.route(hashes, loads)
        r = next(x for x in self.replicas if x.name == decision.replica)
        m = decision.match
        remote = m.remote if self.tiers.remote_tier else 0
        plan = _Plan(g, t, hashes, m.gpu, m.local, remote, len(hashes) - m.gpu - m.local - remote)
        media = self.router.index.media
        plan.sources = [0 if GPU in media(h, r.name) else 1 if h in r.host else 2 for h in hashes[: m.total]]
        plan.backlog = plan.compute_blocks + 1  # + the block holding the last prompt token
        r.backlog += plan.backlog
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
        plan.release = done
        if not r.busy():
            r.now = max(r.now, t)
        heapq.heappush(r.loading, (done, g.index, plan))
        r.stalled = False

    def _release(self, r: _Replica) -> None:
        """Requests whose loads have finished by the replica's clock join its queue (loaded prefix cached)."""
        from pagedkv.engine.request import Request
        from pagedkv.sim.allocators import max_new_tokens_for

        bs = self.config.block_size
        while r.loading and r.loading[0][0] <= r.now:
            _, _, plan = heapq.heappop(r.loading)
            g = plan.g
            if plan.host or plan.remote:
                k = len(plan.sources) * bs
                adm = r.manager.admit(np.asarray(g.prompt_token_ids[:k]))
                if adm is None:
                    self.loads_skipped += 1
                    plan.sources = plan.sources[: plan.sources.index(1) if 1 in plan.sources else None]
                    plan.sources = plan.sources[: plan.sources.index(2) if 2 in plan.sources else None]
                else:
                    r.manager.mark_computed([adm.seq_id])
                    r.manager.free(adm.seq_id)
                    for h, src in zip(plan.hashes, plan.sources):
                        if src:
                            (r.host if src == 1 else self.store).touch(h)
            req = Request(
                str(g.index),
                g.prompt_token_ids,
                max_new_tokens_for("paged-prefix", g.prompt_len, g.output_len, self.config.max_model_len),
                arrival_time=plan.arrival,
                eos_token_id=EOS_TOKEN_ID,
            )
            r.live[req.request_id] = plan
            r.scheduler.add_request(req)
            r.stalled = False
        self._publish(r)

    # --- the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        wl = self.workload
        reqs = {g.index: g for g in wl.requests}
        children: dict[int, list[int]] = {}
        pending: list[tuple[float, int]] = []
        for g in wl.requests:
            if g.parent is not None and g.parent in reqs:
                children.setdefault(g.parent, []).append(g.index)
            else:
                pending.append((g.arrival_s, g.index))
        heapq.heapify(pending)
        n = len(wl.requests)
        order = {g.index: i for i, g in enumerate(wl.requests)}
        self.arrival = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.tier_tokens = np.zeros((n, 3), dtype=np.int64)  # gpu, host, remote
        self.where = np.full(n, -1, dtype=np.int64)
        self.rejected = 0
        self.preemptions = 0
        self._order, self._children, self._reqs, self._pending = order, children, reqs, pending

        while True:
            t_arr = pending[0][0] if pending else math.inf
            busy = [r for r in self.replicas if r.busy()]
            t_rep, r = min(((x.next_time(), x) for x in busy), key=lambda p: p[0], default=(math.inf, None))
            if t_arr == math.inf and t_rep == math.inf:
                if busy:
                    raise CapacityError(
                        f"simulator: {sum(x.scheduler.num_waiting for x in busy)} request(s) can never be "
                        "scheduled; the KV budget is too small for one request"
                    )
                break
            if t_arr <= t_rep:
                t, index = heapq.heappop(pending)
                self.arrival[order[index]] = t
                self._route(reqs[index], t)
                continue
            assert r is not None, "replicas: a scheduled request without its record"
            r.now = max(r.now, t_rep)
            self._release(r)
            if r.scheduler.has_unfinished():
                self._step(r)
        for r in self.replicas:
            r.manager.check_invariants()
            if r.manager.num_used_blocks:
                raise CapacityError(f"replica {r.name}: {r.manager.num_used_blocks} block(s) leaked")
        return self.summary()

    def _step(self, r: _Replica) -> None:
        sched = r.scheduler
        output = sched.schedule()
        for req in output.rejected:
            plan = r.live.pop(req.request_id)
            self.rejected += 1
            r.backlog -= plan.backlog
            self._follow(plan.g, r.now)
        chunks = output.scheduled
        if not chunks:
            r.stalled = True
            return
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        news = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        r.now += r.step_model.cost(starts, news).seconds
        self.preemptions += len(output.preempted)
        sampled: dict[str, int] = {}
        bs = self.config.block_size
        for c in chunks:
            plan = r.live[c.request.request_id]
            i = self._order[plan.g.index]
            if self.where[i] < 0:
                self.where[i] = r.name
                cached = int(c.request.num_cached_tokens)
                got = np.bincount(np.asarray(plan.sources[: cached // bs], dtype=np.int64), minlength=3) * bs
                self.tier_tokens[i] = (cached - got[1] - got[2], got[1], got[2])
            if c.produces_token:
                k = len(c.request.output_token_ids)
                g = plan.g
                sampled[c.request.request_id] = EOS_TOKEN_ID if k + 1 >= g.output_len else int(g.output_token_ids[k])
                if k == 0:
                    r.backlog -= plan.backlog
        finished = sched.update(output, sampled, r.now)
        self._publish(r)
        for req in finished:
            plan = r.live.pop(req.request_id)
            i = self._order[plan.g.index]
            self.first[i] = req.first_token_time
            self.finish[i] = req.finish_time
            self._follow(plan.g, r.now)
        if finished and self.progress is not None:
            self.progress(len(finished))
        r.steps += 1

    def _follow(self, g: GeneratedRequest, now: float) -> None:
        for child in self._children.get(g.index, ()):
            heapq.heappush(self._pending, (now + self._reqs[child].think_s, child))

    # --- metrics ---------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        wl = self.workload
        prompt = np.array([g.prompt_len for g in wl.requests], dtype=np.int64)
        output = np.array([g.output_len for g in wl.requests], dtype=np.int64)
        done = np.isfinite(self.finish)
        ttft = self.first - self.arrival
        decode = done & (output > 1)
        tpot = (self.finish[decode] - self.first[decode]) / (output[decode] - 1)
        start = float(np.nanmin(self.arrival)) if np.isfinite(self.arrival).any() else 0.0
        span = max(float(np.nanmax(self.finish)) - start, 1e-12) if done.any() else 1e-12
        total = int(prompt.sum())
        tiers = self.tier_tokens.sum(axis=0)
        per = np.bincount(self.where[self.where >= 0], minlength=len(self.replicas))

        def pct(values: np.ndarray, q: float) -> float:
            values = values[np.isfinite(values)]
            return float(np.percentile(values, q)) if values.size else float("nan")

        return {
            "router": self.router.policy.name,
            "replicas": len(self.replicas),
            "num_requests": int(done.sum()),
            "rejected": self.rejected,
            "prefix_hit_rate": float(tiers.sum() / total) if total else 0.0,
            "gpu_hit_rate": float(tiers[0] / total) if total else 0.0,
            "host_hit_rate": float(tiers[1] / total) if total else 0.0,
            "remote_hit_rate": float(tiers[2] / total) if total else 0.0,
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99),
            "tokens_per_s": float(output[done].sum()) / span,
            "requests_per_s": int(done.sum()) / span,
            "span_s": span,
            "preemptions": self.preemptions,
            "loads_skipped": self.loads_skipped,
            "requests_per_replica": per.tolist(),
            "host_evictions": sum(r.host.evictions for r in self.replicas),
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
        cols = (
            ("router", None, ""), ("prefix hit", "prefix_hit_rate", "pct"), ("GPU", "gpu_hit_rate", "pct"),
            ("host", "host_hit_rate", "pct"), ("remote", "remote_hit_rate", "pct"),
            ("TTFT p50", "ttft_p50_s", "s"), ("TTFT p99", "ttft_p99_s", "s"), ("TPOT p50", "tpot_p50_s", "ms"),
            ("TPOT p99", "tpot_p99_s", "ms"), ("tok/s", "tokens_per_s", ".0f"), ("req/s", "requests_per_s", ".2f"),
        )  # fmt: skip

        def cell(v: Any, f: str) -> str:
            if f == "pct":
                return f"{100 * v:.1f}%"
            if f == "s":
                return f"{v:.2f}s"
            if f == "ms":
                return f"{1000 * v:.1f}ms"
            return format(v, f) if f else str(v)

        rows = [[h for h, _, _ in cols]]
        rows += [[name] + [cell(res[k], f) for _, k, f in cols[1:]] for name, res in self.results.items()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = [
            f"{self.num_replicas} x {self.config.model.name} on {self.config.gpu.name}, {self.tiers.describe()}",
            f"workload: {self.workload.name}; {self.workload.notes()}",
            "",
        ]
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
        lines.append("")
        lines += [f"{name}: requests per replica {res['requests_per_replica']}" for name, res in self.results.items()]
        return "\n".join(lines)


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


# --- command line (`pagedkv simulate --replicas N ...`) ----------------------------------------------


def add_replica_arguments(parser: Any) -> None:
    from pagedkv.router import POLICIES

    def routers(text: str) -> list[str]:
        import argparse

        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names or any(n not in POLICIES for n in names):
            raise argparse.ArgumentTypeError(f"expected routers from {','.join(POLICIES)}, got {text!r}")
        return names

    r = parser.add_argument_group("replicas (scale-out: with --replicas, the paged-prefix allocator only)")
    r.add_argument("--replicas", type=int, default=0, help="simulate N GPUs behind a router (default: off)")
    r.add_argument(
        "--router", type=routers, default=list(POLICIES), metavar="LIST",
        help=f"routing policies to compare, comma-separated from {','.join(POLICIES)} (default: all)",
    )  # fmt: skip
    r.add_argument("--host-tier-gib", type=float, default=0.0, help="host-RAM KV tier per replica (GiB)")
    r.add_argument("--remote-tier", action="store_true", help="a remote store shared by the replicas")
    r.add_argument("--remote-tier-gib", type=float, help="remote store capacity (default: unbounded)")
    r.add_argument(
        "--remote-bandwidth-gbs", type=float, default=DEFAULT_REMOTE_BANDWIDTH / GB,
        help="store bandwidth per replica, GB/s (default: 12.5, a 100 Gb/s NIC)",
    )  # fmt: skip


def run_command(args: Any) -> int:
    """`pagedkv simulate --replicas N`: the table (or JSON) of every router."""
    import json
    import sys

    from pagedkv.core.errors import PagedKVError
    from pagedkv.sim.options import sim_config_from, workload_from
    from pagedkv.sim.runner import _Progress
    from pagedkv.sim.workload import build_workload

    try:
        if args.host_tier_gib < 0 or (args.remote_tier_gib is not None and args.remote_tier_gib <= 0):
            raise InvalidArgumentError("--host-tier-gib must be >= 0 and --remote-tier-gib > 0")
        config = sim_config_from(args, allocator="paged-prefix")
        tiers = TierConfig(
            host_tier_bytes=int(args.host_tier_gib * GIB),
            remote_tier=args.remote_tier or args.remote_tier_gib is not None,
            remote_bytes=None if args.remote_tier_gib is None else int(args.remote_tier_gib * GIB),
            remote_bandwidth=args.remote_bandwidth_gbs * GB,
        )
        workload = build_workload(workload_from(args), config.max_model_len)
        bar = _Progress(len(workload.requests) * len(args.router), not args.no_progress and not args.json)
        try:
            report = run_replicas(
                config, workload, num_replicas=args.replicas, routers=args.router, tiers=tiers, progress=bar
            )
        finally:
            bar.close()
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text())
    return 0
