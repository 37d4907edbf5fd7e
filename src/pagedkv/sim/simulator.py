"""Discrete-event replay: the real scheduler and a real allocator, with a roofline model for the forward pass.

The loop, per step (simulated time `now`, in seconds):

    1. requests whose arrival time has come are added to the scheduler (a multi-turn turn arrives
       `think_s` after its previous turn finishes);
    2. `schedule()` picks chunks `(start, num_new_tokens)` under the token budget, admitting and
       preempting through the allocator exactly as the engine does;
    3. the step takes `StepTimeModel.step_seconds(starts, num_new_tokens)`, plus, with `SimConfig.realloc`,
       the time to copy (read and write at HBM bandwidth) the KV of each sequence whose contiguous buffer
       must grow (`realloc_copy_tokens`), plus the block copies the allocator asked for (partial-block
       reuse, copy-on-write: one block of KV read and written each); `now` advances by it;
    4. each chunk that completes its request's tokens samples the request's next output token, or the
       end-of-sequence id once the request has produced its true output length; `update(..., now)` appends
       them, finishes requests and frees their blocks.

When nothing is running and nothing can be scheduled, time jumps to the next arrival. A request that can
never be admitted (the allocator cannot hold it even empty) is an error, not a hang. Nothing here is random:
the same workload and configuration give the same numbers. At the end every block must be back in the pool
(a leak is an `InvariantError`).

`Replay` is one GPU's state and phases; `simulate` drives one of them with its own `Arrivals`.
`pagedkv.sim.replicas` drives N of them (one per replica, sharing one `Arrivals`) behind a router: a replica
is this replay, fed the requests the router sends it (`Replay.add`) and stepped by `Replay.step`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import CapacityError, InvalidArgumentError, InvariantError
from pagedkv.core.eviction import EVICTION_POLICIES
from pagedkv.core.protocol import KVManager, ManagerStats
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.sim.allocators import (
    CONTIGUOUS,
    check_allocator,
    is_hybrid_allocator,
    manager_for,
    max_new_tokens_for,
)
from pagedkv.sim.catalog import GPUSpec, ModelShape
from pagedkv.sim.hybrid_kv import HybridKVBudget, manager_groups
from pagedkv.sim.kv_budget import KVBudget, activation_reserve_bytes
from pagedkv.sim.speculation import Drafter, SpecSim, verified
from pagedkv.sim.step_time import StepTimeModel
from pagedkv.sim.workload import Workload
from pagedkv.workloads.generators import GeneratedRequest

EOS_TOKEN_ID = 50_000  # outside the synthetic vocabulary [0, 50000): sampled only to end a request
REALLOC_MODES = ("none", "doubling", "concat")
REALLOC_MIN_CAPACITY = 16  # tokens: the first buffer of a doubling cache
# The simulator's scheduler: `SchedulerConfig`'s defaults except a serving deployment's token budget of
# 8192 per step (vLLM V1's default) and vLLM's greedy admission (no growth reserve, `admission_lookahead`
# 0; no request held back for a prefix another one computes in the same step, `hold_shared_prefix` off),
# what `pagedkv simulate` / `plan` and `SimConfig` have always used; `--admission-lookahead` and
# `--hold-shared-prefix` model the engine's defaults.
SIM_SCHEDULER = SchedulerConfig(max_num_batched_tokens=8192, admission_lookahead=0, hold_shared_prefix=False)


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment: model on GPU(s), allocator, block size and scheduler limits."""

    model: ModelShape
    gpu: GPUSpec
    allocator: str = "paged"
    block_size: int = 16
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    scheduler: SchedulerConfig = SIM_SCHEDULER  # preemption by recompute only (no host pool is modelled)
    step_overhead_s: float = 0.002
    tensor_parallel: int = 1
    activation_bytes: int | None = None  # None: the profile estimate of budget.activation_reserve_bytes
    # How a contiguous allocator's per-sequence buffer grows (time only; see `realloc_copy_tokens`):
    # "none": reserved once at admission; "doubling": a buffer of the next power of two that is copied to
    # one twice as large when full; "concat": the whole sequence copied every step (transformers'
    # DynamicCache). The copy is charged at HBM bandwidth (read + write) on top of the step.
    realloc: str = "none"
    # The prefix cache's eviction policy (pagedkv.core.eviction) and partial-block reuse (paged-prefix only).
    eviction: str = "lru"
    partial_reuse: bool = False
    # Speculative decoding (pagedkv.sim.speculation): k, acceptance rate, draft cost; paged allocators only
    # (the contiguous ones cannot roll rejected drafts back, as in the engine), None: off.
    speculation: SpecSim | None = None

    def __post_init__(self) -> None:
        check_allocator(self.allocator)
        if self.eviction not in EVICTION_POLICIES:
            raise InvalidArgumentError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.realloc not in REALLOC_MODES:
            raise InvalidArgumentError(f"realloc must be one of {REALLOC_MODES}, got {self.realloc!r}")
        if self.realloc != "none" and self.allocator not in CONTIGUOUS:
            raise InvalidArgumentError(
                f"realloc={self.realloc!r} models a contiguous buffer; allocator {self.allocator!r} is paged"
            )
        if not isinstance(self.scheduler, SchedulerConfig) or self.scheduler.preemption_mode != "recompute":
            raise InvalidArgumentError(
                f"scheduler must be a SchedulerConfig preempting by recompute, got {self.scheduler!r}"
            )
        for f in ("block_size", "max_model_len", "tensor_parallel"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{f} must be an int >= 1, got {value!r}")
        if self.speculation is not None and not isinstance(self.speculation, SpecSim):
            raise InvalidArgumentError(f"speculation must be a SpecSim or None, got {self.speculation!r}")
        if self.max_model_len > self.model.max_model_len:
            raise InvalidArgumentError(
                f"max_model_len={self.max_model_len} exceeds {self.model.name}'s context length "
                f"{self.model.max_model_len}"
            )

    def budget(self) -> KVBudget:
        act = self.activation_bytes
        if act is None:
            sched = self.scheduler
            act = activation_reserve_bytes(self.model, sched.max_num_batched_tokens, sched.max_num_seqs)
        # hybrid allocators: the same KV bytes in pages of one KV cache group's layers (sim/hybrid_kv.py)
        cls = HybridKVBudget if is_hybrid_allocator(self.allocator) else KVBudget
        return cls(self.model, self.gpu, self.gpu_memory_utilization, self.block_size, act, self.tensor_parallel)

    def step_model(self) -> StepTimeModel:
        return StepTimeModel(self.model, self.gpu, self.step_overhead_s, self.tensor_parallel)


@dataclass
class SimTrace:
    """What happened: one row per step, one row per request (arrays, ready for metrics and plots)."""

    config: SimConfig
    budget: KVBudget
    workload_name: str
    step_end_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    batched_tokens: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    stored_tokens: list[int] = field(default_factory=list)  # tokens whose KV occupies a slot
    empty_slots: list[int] = field(default_factory=list)  # reserved slots holding no token
    preemptions: int = 0
    rejected: int = 0  # requests the allocator could never hold (the scheduler rejects them)
    bytes_moved: float = 0.0  # HBM traffic the step model charged, summed over steps
    flops: float = 0.0
    page_table_bytes: float = 0.0  # block-table entries the attention kernels read (paged allocators)
    realloc_bytes: float = 0.0  # KV bytes copied by buffer reallocation (SimConfig.realloc), summed
    realloc_s: list[float] = field(default_factory=list)  # per step: seconds of it spent copying
    final_used_blocks: int = -1  # blocks still in use after the last request finished (0: nothing leaked)
    block_copies: int = 0  # device block copies the allocator asked for (partial reuse, copy-on-write)
    # per step: KV bytes the pool holds, and those some query will still read (the running requests' tokens
    # from each layer's first needed one: every token for full attention, the window for sliding layers)
    held_bytes: list[float] = field(default_factory=list)
    live_bytes: list[float] = field(default_factory=list)
    manager_stats: ManagerStats | None = None  # the allocator's counters at the end (hits, misses, evictions)
    arrival_s: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    first_token_s: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    finish_s: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    prompt_len: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    output_len: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cached_tokens: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # speculative decoding (SimConfig.speculation): verifications with drafts, draft tokens, accepted ones,
    # and the seconds the draft model's forwards took
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    draft_s: float = 0.0


def realloc_copy_tokens(mode: str, capacity: int, start: int, end: int) -> tuple[int, int]:
    """(tokens copied, new capacity) when a sequence holding `start` tokens in a buffer of `capacity` grows
    to `end` tokens under reallocation `mode`. A sequence restarting from 0 (admission, recompute) gets a
    fresh buffer and copies nothing."""
    if mode == "none" or end <= start:
        return 0, capacity
    if mode == "concat":
        return start, end
    if start == 0:
        capacity = 0
    if end <= capacity:
        return 0, capacity
    new = max(capacity, REALLOC_MIN_CAPACITY)
    while new < end:
        new *= 2
    return (start if capacity else 0), new


def simulate(
    config: SimConfig,
    workload: Workload,
    *,
    progress: Callable[[int], None] | None = None,
    check_every: int = 0,
    drafter: Drafter | None = None,
) -> SimTrace:
    """Replay `workload` under `config`; `progress(n)` is called with each batch of finished requests.

    `check_every > 0` runs the allocator's `check_invariants()` every that many steps (tests). `drafter`
    draws the drafts' acceptance under `config.speculation` (default: `Drafter(config.speculation)`).
    """
    budget = config.budget()
    check_budget(config, budget)
    replay = Replay(config, workload, budget, drafter=drafter)
    steps = 0
    while replay.arrivals.pending or replay.scheduler.has_unfinished():
        replay.admit_arrivals()
        if not replay.step(progress):
            replay.wait_or_fail()
            continue
        steps += 1
        if check_every and steps % check_every == 0:
            replay.manager.check_invariants()
    return replay.finish()


def check_budget(config: SimConfig, budget: KVBudget) -> None:
    """Refuse a KV budget that cannot hold one request of `max_model_len` tokens (`CapacityError`)."""
    if not _fits(budget, config.max_model_len):
        raise CapacityError(
            f"the KV budget of {budget.kv_budget_bytes / 2**30:.3f} GiB holds {budget.num_tokens} tokens "
            f"({budget.num_blocks} blocks of {config.block_size}), less than one request of "
            f"max_model_len={config.max_model_len}; lower --max-model-len or give the cache more memory"
        )


class Arrivals:
    """When each request of a workload arrives: a first turn at its trace time, a chat's next turn `think_s`
    after its previous turn finishes (or is refused: the chat goes on). One per run, shared by its replays."""

    def __init__(self, workload: Workload) -> None:
        self.reqs = {r.index: r for r in workload.requests}
        self.children: dict[int, list[int]] = {}
        self.pending: list[tuple[float, int]] = []  # (arrival, index) heap of requests whose arrival is known
        for r in workload.requests:
            if r.parent is not None and r.parent in self.reqs:
                self.children.setdefault(r.parent, []).append(r.index)
            else:
                self.pending.append((r.arrival_s, r.index))
        heapq.heapify(self.pending)

    def next_s(self) -> float:
        """The next known arrival time (inf: none)."""
        return self.pending[0][0] if self.pending else math.inf

    def pop(self) -> tuple[float, GeneratedRequest]:
        t, index = heapq.heappop(self.pending)
        return t, self.reqs[index]

    def follow(self, index: int, now: float) -> None:
        """Request `index` is done at `now`: its chat's next turns arrive after their think time."""
        for child in self.children.get(index, ()):
            heapq.heappush(self.pending, (now + self.reqs[child].think_s, child))


class Replay:
    """One GPU's run, advanced one scheduler step at a time by its phases: admit the requests that have
    arrived, drop the ones the allocator can never hold, charge the step's time, sample, measure KV use,
    then retire finished requests (releasing the next turns of their chats through `arrivals`).
    `record_events`: the manager records its cache events (a replica behind a router)."""

    def __init__(
        self, config: SimConfig, workload: Workload, budget: KVBudget, *, arrivals: Arrivals | None = None,
        record_events: bool = False, drafter: Drafter | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.workload = workload
        self.budget = budget
        self.hybrid = is_hybrid_allocator(config.allocator)
        self.manager = manager_for(
            config.allocator, budget.num_blocks, config.block_size, eviction=config.eviction,
            partial_reuse=config.partial_reuse, groups=manager_groups(config.model) if self.hybrid else None,
            record_events=record_events,
        )  # fmt: skip
        self.windows: dict[int | None, int] = {}  # layers per window (None: full attention)
        for w in config.model.layer_windows:
            self.windows[w] = self.windows.get(w, 0) + 1
        # speculation: the engine's scheduler path (draft slots, rollback of the rejected); paged only
        spec = config.speculation if config.allocator not in CONTIGUOUS else None
        self.drafter = (drafter or Drafter(spec)) if spec is not None else None
        self._draft_starts: list[int] = []  # context of each request that proposed since the last step
        self._draft_forwards = 0  # draft forwards of those proposals (the longest one's length)
        self._drafted = 0  # draft tokens of those proposals
        self._base_tokens = 0  # the last step's scored tokens besides drafts (the draft budget's base)
        self.scheduler = Scheduler(self.manager, config.scheduler, num_lookahead_tokens=spec.k if spec else 0)
        self.step_model = config.step_model()
        self.arrivals = arrivals or Arrivals(workload)
        n = len(workload.requests)
        self.order = {r.index: i for i, r in enumerate(workload.requests)}
        self.arrival = np.zeros(n)
        self.first_token = np.full(n, np.nan)
        self.finish_time = np.full(n, np.nan)
        self.cached = np.zeros(n, dtype=np.int64)
        self.seen: set[str] = set()
        self.live: dict[str, tuple[GeneratedRequest, object]] = {}
        self.out = SimTrace(config, budget, workload.name)
        self.paged = config.allocator not in CONTIGUOUS
        self.now = 0.0
        self.capacity: dict[str, int] = {}  # realloc: each sequence's buffer, in tokens

    def admit_arrivals(self) -> None:
        """Jump over idle time to the next arrival, then hand every request that has arrived to the scheduler."""
        arrivals = self.arrivals
        if not self.scheduler.has_unfinished() and arrivals.next_s() > self.now:
            self.now = arrivals.next_s()  # idle: jump to the next arrival
        while arrivals.next_s() <= self.now:
            t, g = arrivals.pop()
            self.add(g, t)

    def add(self, g: GeneratedRequest, arrival_s: float) -> None:
        """Request `g`, which arrived at `arrival_s`, joins the scheduler's queue."""
        config = self.config
        req = Request(
            str(g.index),
            g.prompt_token_ids,
            max_new_tokens_for(config.allocator, g.prompt_len, g.output_len, config.max_model_len),
            arrival_time=arrival_s,
            eos_token_id=EOS_TOKEN_ID,
        )
        self.arrival[self.order[g.index]] = arrival_s
        self.live[req.request_id] = (g, req)
        self.scheduler.add_request(req)

    def step(self, progress: Callable[[int], None] | None) -> bool:
        """One scheduler step; False when nothing could be scheduled (the clock has not moved)."""
        if self.drafter is not None:
            self._propose(self.drafter)
        output = self.scheduler.schedule()
        self.drop_rejected(output)
        if not output.scheduled:
            return False
        self.run_step(output, progress)
        return True

    def drop_rejected(self, output: Any) -> None:
        """Requests that can never fit finish without a token; a chat goes on even if one turn was refused."""
        for req in getattr(output, "rejected", ()):
            g, _ = self.live.pop(req.request_id)
            if self.drafter is not None:
                self.drafter.forget(req.request_id)
            self.out.rejected += 1
            self.arrivals.follow(g.index, self.now)

    def wait_or_fail(self) -> None:
        """Nothing was scheduled: wait for the next arrival, or fail when nothing can ever run."""
        if not self.scheduler.has_unfinished():
            return
        if self.arrivals.pending:
            self.now = max(self.now, self.arrivals.next_s())
            return
        raise self.stuck()

    def stuck(self) -> CapacityError:
        """The error for waiting requests that nothing will ever let run."""
        config = self.config
        return CapacityError(
            f"simulator: {self.scheduler.num_waiting} request(s) can never be scheduled with allocator "
            f"{config.allocator!r} ({self.budget.num_blocks} blocks of {config.block_size} tokens, "
            f"max_model_len {config.max_model_len}); the budget is too small for one request"
        )

    def run_step(self, output: Any, progress: Callable[[int], None] | None) -> None:
        chunks = output.scheduled
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        news = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        dt = self._charge_time(chunks, starts, news) + self._charge_copies(len(output.copies.src))
        self.out.preemptions += len(output.preempted)
        sampled = self._sample(chunks)
        num_running = len(self.scheduler.running)
        finished = self.scheduler.update(output, sampled, self.now)
        self._record_step(dt, num_running, int(news.sum()))
        for req in finished:
            g, _ = self.live.pop(req.request_id)
            if self.drafter is not None:
                self.drafter.forget(req.request_id)
            i = self.order[g.index]
            self.first_token[i] = req.first_token_time
            self.finish_time[i] = req.finish_time
            self.arrivals.follow(g.index, self.now)
        if finished and progress is not None:
            progress(len(finished))

    def _charge_time(
        self, chunks: Any, starts: npt.NDArray[np.int64], news: npt.NDArray[np.int64]
    ) -> float:
        """Advance the clock by the step model's cost plus any reallocation copies; add the step's traffic."""
        config, out = self.config, self.out
        cost = self.step_model.cost(starts, news)
        dt = cost.seconds
        draft_s = 0.0
        if self._draft_forwards:  # the draft model's k forwards over the proposing requests, before this step
            assert self.config.speculation is not None, "simulator: drafts without speculation"
            ones = np.ones(len(self._draft_starts), dtype=np.int64)
            draft_s = self.config.speculation.draft_cost * self._draft_forwards * self.step_model.step_seconds(
                self._draft_starts, ones
            )
            out.draft_s += draft_s
            dt += draft_s
        if self.drafter is not None:  # the engine's draft budget fits its step cost to what steps took
            verifying = [len(c.draft_token_ids) for c in chunks if c.draft_token_ids]
            self.drafter.observe(int(news.sum()), len(verifying), cost.seconds, self._drafted, draft_s)
            self._base_tokens = int(news.sum()) - sum(verifying)
        self._draft_starts, self._draft_forwards, self._drafted = [], 0, 0
        copy_s = 0.0
        if config.realloc != "none":
            copied = 0
            for c in chunks:
                rid = c.request.request_id
                n, self.capacity[rid] = realloc_copy_tokens(
                    config.realloc, self.capacity.get(rid, 0), c.start, c.start + c.num_new_tokens
                )
                copied += n
            if copied:  # read and write every copied byte
                copy_bytes = float(copied) * config.model.kv_bytes_per_token
                out.realloc_bytes += copy_bytes
                copy_s = 2 * copy_bytes / (config.tensor_parallel * config.gpu.hbm_bandwidth_bytes_per_s)
                dt += copy_s
        out.realloc_s.append(copy_s)
        self.now += dt
        out.bytes_moved += cost.bytes_moved
        out.flops += cost.flops
        if self.paged:  # the attention kernel reads one int32 block id per context block, per layer
            bs = config.block_size
            out.page_table_bytes += float((-(-(starts + news) // bs)).sum()) * 4 * config.model.num_layers
        return dt

    def _charge_copies(self, num_copies: int) -> float:
        """The step's block copies (run before its forward): one block of KV read and written each."""
        if not num_copies:
            return 0.0
        config = self.config
        copy_bytes = float(num_copies) * config.block_size * config.model.kv_bytes_per_token
        self.out.block_copies += num_copies
        self.out.bytes_moved += 2 * copy_bytes
        dt = 2 * copy_bytes / (config.tensor_parallel * config.gpu.hbm_bandwidth_bytes_per_s)
        self.now += dt
        return dt

    def _sample(self, chunks: Any) -> dict[str, int | list[int]]:
        """The workload's next token for every chunk that produces one (EOS at the request's output length);
        records each request's prefix-cache hit the first time it is scheduled."""
        sampled: dict[str, int | list[int]] = {}
        for c in chunks:
            rid = c.request.request_id
            if rid not in self.seen:
                self.seen.add(rid)
                self.cached[self.order[int(rid)]] = int(c.request.num_cached_tokens)
            if c.produces_token:
                g = self.live[rid][0]
                k = len(c.request.output_token_ids)
                if c.draft_token_ids:  # verify: the drafts that match the true continuation, then the next
                    kept = verified(c.draft_token_ids, _truth(g, k, len(c.draft_token_ids) + 1))
                    self.out.spec_drafts += 1
                    self.out.spec_draft_tokens += len(c.draft_token_ids)
                    self.out.spec_accepted_tokens += len(kept) - 1
                    assert self.drafter is not None, "simulator: a verification without speculation"
                    self.drafter.record(rid, len(c.draft_token_ids), len(kept) - 1)
                    sampled[rid] = kept
                    continue
                sampled[rid] = EOS_TOKEN_ID if k + 1 >= g.output_len else int(g.output_token_ids[k])
        return sampled

    def _propose(self, drafter: Drafter) -> None:
        """Drafts for every decoding request (up to its k, adaptive and cut to the step's draft budget as
        in the engine; never past its true output), as the engine proposes after each step; their draft
        forwards are charged to the next step."""
        running = self.scheduler.running
        decoding = [r for r in running if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1]
        left = [self.live[r.request_id][0].output_len - len(r.output_token_ids) - 1 for r in decoding]
        caps = [min(drafter.next_k(r.request_id), n) for r, n in zip(decoding, left)]
        ks = drafter.plan([r.request_id for r in decoding], caps, max(self._base_tokens, len(decoding)))
        for r, n in zip(decoding, ks):
            if n <= 0:
                continue
            g, pos = self.live[r.request_id][0], len(r.output_token_ids)
            r.draft_token_ids = drafter.drafts(_truth(g, pos, n), n)
            self._draft_starts.append(int(r.num_computed_tokens))
            self._draft_forwards = max(self._draft_forwards, n)
            self._drafted += n

    def _record_step(self, dt: float, num_running: int, batched: int) -> None:
        """KV use after the step: every scheduled chunk's KV is written, finished requests are freed."""
        manager, out, bs = self.manager, self.out, self.config.block_size
        held = _held_tokens(manager, self.scheduler.running)
        used = manager.num_used_blocks
        if self.paged:
            empty = int((-(-held // bs) * bs - held).sum())  # only each sequence's private tail block
            if self.hybrid:  # a tail block in every group (windowed groups' chunk reservations not counted)
                empty *= self.manager.num_groups
            stored = used * bs - empty
        else:
            stored = int(held.sum())
            empty = used * bs - stored
        out.step_end_s.append(self.now)
        out.step_s.append(dt)
        out.running.append(num_running)
        out.waiting.append(self.scheduler.num_waiting)
        out.batched_tokens.append(batched)
        out.used_blocks.append(used)
        out.stored_tokens.append(stored)
        out.empty_slots.append(empty)
        out.held_bytes.append(float(used) * self.budget.bytes_per_block)
        out.live_bytes.append(self._live_bytes(held))

    def _live_bytes(self, held: npt.NDArray[np.int64]) -> float:
        """KV bytes some query of a running request will still read: per layer, its tokens from the first one
        the next query needs (`KVGroupSpec.first_needed`: 0 for full attention, the window's start for a
        sliding layer) to what it holds."""
        running = self.scheduler.running
        if not running:
            return 0.0
        if None in self.windows and len(self.windows) == 1:  # full attention only: every held token is read
            return float(held.sum()) * self.config.model.kv_bytes_per_token
        computed = np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=len(running))
        token_layers = 0
        for w, n in self.windows.items():
            first = np.zeros_like(computed) if w is None else np.maximum(computed - w + 1, 0)
            token_layers += n * int(np.maximum(held - first, 0).sum())
        return float(token_layers) * self.config.model.kv_bytes_per_layer_token

    def finish(self) -> SimTrace:
        """Check the allocator is whole and empty, then fill the per-request arrays."""
        manager, out, workload = self.manager, self.out, self.workload
        manager.check_invariants()
        out.final_used_blocks = manager.num_used_blocks
        if manager.num_used_blocks:
            raise InvariantError(
                f"simulator: {manager.num_used_blocks} block(s) still in use after every request finished "
                f"(allocator {self.config.allocator!r}): a leak"
            )
        out.arrival_s = self.arrival
        out.first_token_s = self.first_token
        out.finish_s = self.finish_time
        out.prompt_len = np.array([r.prompt_len for r in workload.requests], dtype=np.int64)
        out.output_len = np.array([r.output_len for r in workload.requests], dtype=np.int64)
        out.cached_tokens = self.cached
        out.manager_stats = manager.stats
        return out


def _truth(g: GeneratedRequest, pos: int, n: int) -> list[int]:
    """The request's true output tokens from output position `pos` on, at most `n` (EOS at its length)."""
    return [EOS_TOKEN_ID if j + 1 >= g.output_len else int(g.output_token_ids[j]) for j in range(pos, min(pos + n, g.output_len))]


def _fits(budget: KVBudget, tokens: int) -> bool:
    """Whether one request of `tokens` tokens fits the pool (hybrid pages: each group what it keeps)."""
    return budget.fits(tokens) if isinstance(budget, HybridKVBudget) else budget.num_tokens >= tokens


def _held_tokens(manager: KVManager, running: list[Request]) -> npt.NDArray[np.int64]:
    """Tokens each running request holds slots for (what the allocator has handed out to it)."""
    if not running:
        return np.zeros(0, dtype=np.int64)
    seq_ids = [r.seq_id for r in running]
    if all(s is not None for s in seq_ids):
        return np.asarray(manager.seq_lens(np.asarray(seq_ids, dtype=np.int64)), dtype=np.int64)
    return np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=len(running))
