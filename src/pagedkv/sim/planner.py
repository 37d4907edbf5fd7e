"""The capacity planner: how many concurrent requests fit with each allocator, without simulating.

For a request of prompt P and output O with block size b, let its life be L = max(O - 1, 1) decode steps
(each step adds one token). What it holds:

- `contiguous-max`: ceil(max_model_len / b) blocks for its whole life;
- `contiguous-oracle`: ceil((P + O) / b) blocks for its whole life;
- `paged`: ceil((P + k) / b) blocks at decode step k, growing one block at a time;
- `paged-prefix`: as `paged`, but a leading full prompt block shared with other live requests is held once
  for all of them, so each of the c live holders pays 1/c of it. Which requests are live together: under
  FCFS admission, about N consecutive requests of the trace (N the concurrency being solved for), so c is
  the number of conversations holding that block within the N requests around this one. N is found by a
  fixed point, starting from `paged`'s figure (sharing only lowers the blocks per request, so N only grows).
  Sharing between the turns of one chat saves prefill compute, not memory (they are not live together),
  and is not counted.

The contiguous allocators place each reservation as one run of blocks, first fit, so free space splits into
holes too small for the next request (external fragmentation), and FCFS admission waits for the head request
even when a later one would fit. Their figures therefore come from a packing pass instead of the average
below: the workload's reservations, in order, are placed first fit into the usable blocks (the core's own
`RunAllocator`), each held for its life in decode steps; the figure is the step-weighted mean number placed
while requests are still waiting. It models no time, tokens or scheduler, only placement (milliseconds).

For the paged allocators, a random live request is, by Little's law, weighted by its life, so the blocks of "an average live request"
are sum_i sum_steps blocks_i / sum_i L_i, and

    max_concurrent_memory        = usable blocks // that average       (requests at random points of their lives)
    max_concurrent_no_preemption = usable blocks // (life-weighted mean of the blocks at full length)
    max_concurrent               = min(max_num_seqs, max_concurrent_memory)

For contiguous allocators the two memory figures agree (the reservation never changes). For a fixed-length
workload arriving all at once, the contiguous figures are exactly the simulator's peak concurrency.
Usable blocks are the pool less its null block.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.core.contiguous import RunAllocator
from pagedkv.core.errors import CapacityError
from pagedkv.sim.allocators import ALLOCATORS, check_allocator
from pagedkv.sim.budget import KVBudget
from pagedkv.sim.workload import Workload
from pagedkv.workloads.generators import GeneratedRequest

IntArray = npt.NDArray[np.int64]


def _ceil_sum(n: IntArray, b: int) -> IntArray:
    """sum_{t=1..n} ceil(t / b), element-wise (closed form: b q (q+1) / 2 + r (q+1), n = q b + r)."""
    q, r = np.divmod(n, b)
    total: IntArray = b * q * (q + 1) // 2 + r * (q + 1)
    return total


def shared_prefix_chains(
    requests: Sequence[GeneratedRequest], block_size: int
) -> list[list[tuple[int, ...]]]:
    """Per request, for each leading full prompt block that a request of another conversation also starts
    with: the sorted positions (in the workload) of one request per other conversation holding it. The list
    of a request stops at its first block no other conversation holds. Turns of one conversation (linked by
    `parent`) are not live together, so sharing between them does not count."""
    by_index = {r.index: r for r in requests}

    def root(r: GeneratedRequest) -> int:
        while r.parent is not None and r.parent in by_index:
            r = by_index[r.parent]
        return r.index

    conversations = [root(r) for r in requests]
    keys: list[list[int]] = []
    holders: dict[int, dict[int, int]] = {}  # block key -> conversation -> first position holding it
    for pos, r in enumerate(requests):
        chain, parent = [], 0
        ids = np.ascontiguousarray(r.prompt_token_ids, dtype=np.int32)
        for j in range(len(ids) // block_size):
            parent = hash((parent, ids[j * block_size : (j + 1) * block_size].tobytes()))
            chain.append(parent)
            holders.setdefault(parent, {}).setdefault(conversations[pos], pos)
        keys.append(chain)
    out: list[list[tuple[int, ...]]] = []
    for pos, chain in enumerate(keys):
        shared: list[tuple[int, ...]] = []
        for k in chain:
            others = tuple(sorted(p for c, p in holders[k].items() if c != conversations[pos]))
            if not others:
                break
            shared.append(others)
        out.append(shared)
    return out


def shared_blocks_saved(chains: list[list[tuple[int, ...]]], window: int) -> npt.NDArray[np.float64]:
    """Per request, the blocks it does not pay for when the requests live with it are the `window` around it
    in workload order: each shared block costs 1/c, c its live holders (itself included)."""
    half = max(window, 1) // 2
    saved = np.zeros(len(chains), dtype=np.float64)
    for pos, shared in enumerate(chains):
        lo, hi = pos - half, pos + half
        total = 0.0
        for others in shared:
            live = bisect.bisect_right(others, hi) - bisect.bisect_left(others, lo)
            total += 1.0 - 1.0 / (1 + live)
        saved[pos] = total
    return saved


def first_fit_concurrency(
    sizes: IntArray, lives: IntArray, num_blocks: int, max_num_seqs: int
) -> float | None:
    """Mean number of reservations held while some still wait, placing `sizes[i]` blocks first fit for
    `lives[i]` steps in order (FCFS: the head waits for a hole; nobody overtakes it). The last placement
    ends the measured span; None if nobody ever waited (the workload never filled the pool)."""
    runs = RunAllocator(0, num_blocks)
    live: list[tuple[int, int, int, int]] = []  # heap of (end step, position, start block, size)
    now = nxt = 0
    weighted = span = 0
    while nxt < len(sizes) or live:
        while nxt < len(sizes) and len(live) < max_num_seqs:
            need = int(sizes[nxt])
            if need > num_blocks:
                raise CapacityError(f"a request needs {need} blocks but the pool has {num_blocks}")
            hole = runs.find(need)
            if hole is None:
                break
            heapq.heappush(live, (now + int(lives[nxt]), nxt, runs.take(hole, need), need))
            nxt += 1
        end = live[0][0]
        if nxt < len(sizes):  # requests still waiting: this stretch counts
            weighted += len(live) * (end - now)
            span += end - now
        while live and live[0][0] == end:
            _, _, start, size = heapq.heappop(live)
            runs.give(start, size)
        now = end
    return weighted / span if span else None


def plan_capacity(
    budget: KVBudget,
    workload: Workload,
    max_model_len: int,
    *,
    max_num_seqs: int = 256,
    allocators: Sequence[str] = ALLOCATORS,
) -> dict[str, Any]:
    """Blocks per request and concurrent requests per allocator (see the module docstring), JSON-ready."""
    b = budget.block_size
    p = np.array([r.prompt_len for r in workload.requests], dtype=np.int64)
    o = np.array([r.output_len for r in workload.requests], dtype=np.int64)
    life = np.maximum(o - 1, 1)
    total_life = float(life.sum())
    full_blocks = -(-(p + o) // b)
    growing = np.where(o > 1, _ceil_sum(p + o - 1, b) - _ceil_sum(p, b), -(-p // b))
    result: dict[str, dict[str, Any]] = {}
    for name in allocators:
        check_allocator(name)
        if name in ("contiguous-max", "contiguous-oracle"):
            sizes = np.full_like(p, -(-max_model_len // b)) if name == "contiguous-max" else full_blocks
            result[name] = _contiguous_row(name, sizes, p, o, life, budget, max_model_len, max_num_seqs)
            continue
        avg = float(growing.sum() / total_life)
        full = float((full_blocks * life).sum() / total_life)
        tokens = float(((p + (o - 1) / 2 + 0.5) * life).sum() / total_life)
        if name == "paged-prefix":
            avg, full = _prefix_shared_blocks(workload, budget, life, avg, full, max_num_seqs)
        free_blocks = budget.num_usable_blocks
        memory = int(free_blocks // avg)
        no_preempt = int(free_blocks // full)
        result[name] = _row(
            min(max_num_seqs, memory), memory, min(max_num_seqs, no_preempt), tokens, avg, budget
        )
    notes = [
        f"{workload.notes()}; prompt mean {p.mean():.0f}, output mean {o.mean():.0f} tokens",
        "max concurrent: requests at random points of their lives, capped at max_num_seqs="
        f"{max_num_seqs}; no-preempt: every request can reach its full length; by memory: uncapped",
    ]
    return {
        "model": budget.model.name,
        "gpu": budget.gpu.name,
        "tensor_parallel": budget.tensor_parallel,
        "workload": workload.name,
        "kv_budget_bytes": budget.kv_budget_bytes,
        "bytes_per_token": budget.bytes_per_token,
        "bytes_per_block": budget.bytes_per_block,
        "block_size": b,
        "num_blocks": budget.num_blocks,
        "num_usable_blocks": budget.num_usable_blocks,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "allocators": result,
        "notes": notes,
    }


def _contiguous_row(
    name: str,
    sizes: npt.NDArray[np.int64],
    p: npt.NDArray[np.int64],
    o: npt.NDArray[np.int64],
    life: npt.NDArray[np.int64],
    budget: KVBudget,
    max_model_len: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    """A contiguous allocator reserves `sizes` blocks per request for its whole life: the packing pass where
    the workload fills the pool, Little's law where it never does."""
    total_life = float(life.sum())
    avg = float((sizes * life).sum() / total_life)
    tokens = float(max_model_len) if name == "contiguous-max" else float(((p + o) * life).sum() / total_life)
    free_blocks = budget.num_usable_blocks
    memory = first_fit_concurrency(sizes, life, free_blocks, len(sizes))
    memory_n = int(memory) if memory is not None else int(free_blocks // avg)
    packed = min(max_num_seqs, memory_n)
    return _row(packed, memory_n, packed, tokens, avg, budget)


def _prefix_shared_blocks(
    workload: Workload,
    budget: KVBudget,
    life: npt.NDArray[np.int64],
    avg0: float,
    full0: float,
    max_num_seqs: int,
) -> tuple[float, float]:
    """(mean, full) blocks per request once shared prefixes are counted once: a fixed point, N -> live
    holders per block -> blocks per request -> N."""
    total_life = float(life.sum())
    free_blocks = budget.num_usable_blocks
    chains = shared_prefix_chains(workload.requests, budget.block_size)
    n, avg, full = max(int(free_blocks // avg0), 1), avg0, full0
    for _ in range(20):
        saved = float((shared_blocks_saved(chains, min(n, max_num_seqs)) * life).sum() / total_life)
        avg, full = max(avg0 - saved, 1e-9), max(full0 - saved, 1e-9)
        n_next = max(int(free_blocks // avg), 1)
        if n_next == n:
            break
        n = n_next
    return avg, full


def _row(
    concurrent: int, memory: int, no_preempt: int, tokens: float, blocks: float, budget: KVBudget
) -> dict[str, Any]:
    return {
        "max_concurrent": concurrent,
        "max_concurrent_memory": memory,
        "max_concurrent_no_preemption": no_preempt,
        "tokens_per_request": tokens,
        "blocks_per_request": blocks,
        "bytes_per_request": blocks * budget.bytes_per_block,
    }
