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

import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.core.contiguous import RunAllocator
from pagedkv.core.errors import CapacityError
from pagedkv.progress import Progress
from pagedkv.sim.allocators import ALLOCATORS, check_allocator
from pagedkv.sim.hybrid_kv import hybrid_plan
from pagedkv.sim.kv_budget import KVBudget
from pagedkv.sim.workload import Workload
from pagedkv.workloads.generators import GeneratedRequest
from pagedkv.workloads.traces import sm64

IntArray = npt.NDArray[np.int64]


def _ceil_sum(n: IntArray, b: int) -> IntArray:
    """sum_{t=1..n} ceil(t / b), element-wise (closed form: b q (q+1) / 2 + r (q+1), n = q b + r)."""
    q, r = np.divmod(n, b)
    total: IntArray = b * q * (q + 1) // 2 + r * (q + 1)
    return total


class SharedChains(NamedTuple):
    """Which leading prompt blocks each request shares with other conversations, as flat arrays.

    Entry e: request `owner[e]` holds shared block `block[e]`; `own[e]` is the first position (in the
    workload) of a request of the owner's conversation holding that block. `holders[starts[k]:starts[k+1]]`
    are the first positions of every conversation holding block k, ascending. A request's entries stop at its
    first block no other conversation holds."""

    owner: IntArray
    block: IntArray
    own: IntArray
    holders: IntArray
    starts: IntArray
    num_requests: int


def _conversations(requests: Sequence[GeneratedRequest]) -> list[int]:
    """Per request, the index of the first turn of its conversation (turns are linked by `parent`)."""
    by_index = {r.index: r for r in requests}
    root: dict[int, int] = {}
    for r in requests:
        path, cur = [], r
        while cur.index not in root and cur.parent is not None and cur.parent in by_index:
            path.append(cur.index)
            cur = by_index[cur.parent]
        first = root.get(cur.index, cur.index)
        for index in (*path, cur.index):
            root[index] = first
    return [root[r.index] for r in requests]


_CHUNK_BLOCKS = 64  # blocks of each live prompt copied into one array at a time


def _block_hashes(parents: npt.NDArray[np.uint64], tokens: npt.NDArray[np.int32]) -> npt.NDArray[np.uint64]:
    """Each row's block key, chained from its parent's: 64 bits (a planner estimate; a collision merges two
    blocks' holders, it serves no KV)."""
    weights = sm64(np.arange(1, tokens.shape[1] + 1, dtype=np.uint64)) | np.uint64(1)
    with np.errstate(over="ignore"):
        row = (tokens.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)
        return sm64(sm64(parents) ^ row)


class _Depth(NamedTuple):
    """One depth's shared blocks: the entries (in `alive` order, `shared` marks them) and the holders."""

    shared: npt.NDArray[np.bool_]
    block: IntArray  # per alive request: the shared block's number within this depth (where shared)
    own: IntArray
    holders: IntArray  # first positions per shared block, ascending within each block
    counts: IntArray  # holders per shared block


def _shared_at_depth(alive: IntArray, keys: npt.NDArray[np.uint64], conv: IntArray) -> _Depth:
    """Which of the `alive` requests' blocks (keys `keys`) another conversation holds: one sort."""
    c = conv[alive]
    order = np.lexsort((alive, c, keys))  # by key, then conversation, then position
    ks, cs, ps = keys[order], c[order], alive[order]
    new_key = np.ones(len(ks), dtype=bool)
    new_key[1:] = ks[1:] != ks[:-1]
    new_pair = new_key.copy()
    new_pair[1:] |= cs[1:] != cs[:-1]
    key_id = np.cumsum(new_key) - 1
    pair_id = np.cumsum(new_pair) - 1
    pair_key, pair_pos = key_id[new_pair], ps[new_pair]  # each (block, conversation): its first position
    convs = np.bincount(pair_key, minlength=int(key_id[-1]) + 1)
    shared_keys = convs >= 2
    number = np.cumsum(shared_keys) - 1  # shared blocks numbered 0.. in key order
    shared, block, own = (np.empty(len(alive), dtype=t) for t in (bool, np.int64, np.int64))
    shared[order] = shared_keys[key_id]
    block[order] = number[key_id]
    own[order] = pair_pos[pair_id]
    keep = shared_keys[pair_key]
    by_block = np.lexsort((pair_pos[keep], number[pair_key[keep]]))
    return _Depth(shared, block, own, pair_pos[keep][by_block], convs[shared_keys])


def shared_prefix_chains(
    requests: Sequence[GeneratedRequest], block_size: int, progress: Progress | None = None
) -> SharedChains:
    """Per request, each leading full prompt block that a request of another conversation also starts with
    (see `SharedChains`). Turns of one conversation (linked by `parent`) are not live together, so sharing
    between them does not count.

    Blocks are keyed depth by depth, and only for requests whose previous block is shared: a block's key
    chains from its parent's, so a request whose block j no other conversation holds shares nothing after
    it. Each depth is one sort of its live requests (the pass was quadratic in the holders of a block)."""
    conv = np.array(_conversations(requests), dtype=np.int64)
    prompts = [r.prompt_token_ids for r in requests]
    num_blocks = np.array([len(t) // block_size for t in prompts], dtype=np.int64)
    alive = np.flatnonzero(num_blocks > 0)
    keys = np.zeros(len(alive), dtype=np.uint64)
    out: list[list[IntArray]] = [[], [], [], [], []]  # owner, block, own, holders, counts
    depth = numbered = 0
    while len(alive):
        span = min(_CHUNK_BLOCKS, int(num_blocks[alive].max()) - depth)
        chunk = np.zeros((len(alive), span * block_size), dtype=np.int32)
        for row, pos in enumerate(alive.tolist()):
            head = prompts[pos][depth * block_size : (depth + span) * block_size]
            chunk[row, : len(head)] = head
        rows = np.arange(len(alive))
        for d in range(span):
            keys = _block_hashes(keys, chunk[rows, d * block_size : (d + 1) * block_size])
            got = _shared_at_depth(alive, keys, conv)
            s = got.shared
            for part, value in zip(
                out, (alive[s], got.block[s] + numbered, got.own[s], got.holders, got.counts)
            ):
                part.append(value)
            numbered += len(got.counts)
            if progress is not None:
                progress.update(len(alive))
            depth += 1
            keep = s & (num_blocks[alive] > depth)
            alive, keys, rows = alive[keep], keys[keep], rows[keep]
            if not len(alive):
                break
    owner, block, own, holders, counts = (np.concatenate(p) if p else np.zeros(0, np.int64) for p in out)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return SharedChains(owner, block, own, holders, starts, len(requests))


def shared_blocks_saved(chains: SharedChains, window: int) -> npt.NDArray[np.float64]:
    """Per request, the blocks it does not pay for when the requests live with it are the `window` around it
    in workload order: each shared block costs 1/c, c its live holders (itself included).

    One sorted search for all entries: holder positions are encoded as block * n + position, ascending."""
    n = max(chains.num_requests, 1)
    half = max(window, 1) // 2
    if not len(chains.owner):
        return np.zeros(chains.num_requests, dtype=np.float64)
    which = np.repeat(np.arange(len(chains.starts) - 1, dtype=np.int64), np.diff(chains.starts))
    encoded = which * n + chains.holders
    lo = np.maximum(chains.owner - half, 0)
    hi = np.minimum(chains.owner + half, n - 1)
    inside = np.searchsorted(encoded, chains.block * n + hi, side="right")
    inside -= np.searchsorted(encoded, chains.block * n + lo, side="left")
    live = inside - ((chains.own >= lo) & (chains.own <= hi))  # other conversations only
    saved = 1.0 - 1.0 / (1.0 + live)
    return np.bincount(chains.owner, weights=saved, minlength=chains.num_requests).astype(np.float64)


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
                raise CapacityError(
                    f"a contiguous allocator reserves {need} blocks for one request but the pool has "
                    f"{num_blocks}; plan a smaller --max-model-len or only --allocators paged"
                )
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


def contiguous_blocks(name: str, workload: Workload, max_model_len: int, block_size: int) -> npt.NDArray[np.int64]:
    """The blocks a contiguous allocator reserves for each request: `max_model_len` for every request
    (contiguous-max), or the request's own final length (contiguous-oracle)."""
    p = np.array([r.prompt_len for r in workload.requests], dtype=np.int64)
    if name == "contiguous-max":
        return np.full_like(p, -(-max_model_len // block_size))
    o = np.array([r.output_len for r in workload.requests], dtype=np.int64)
    return -(-(p + o) // block_size)


def unfit_allocators(
    budget: KVBudget, workload: Workload, max_model_len: int, allocators: Sequence[str]
) -> dict[str, str]:
    """The contiguous allocators of `allocators` that cannot hold one of the workload's requests in the
    whole pool, each with one line saying why (a paged allocator holds any request the pool can)."""
    out: dict[str, str] = {}
    pool = budget.num_usable_blocks
    for name in allocators:
        if name not in ("contiguous-max", "contiguous-oracle") or not workload.requests:
            continue
        need = int(contiguous_blocks(name, workload, max_model_len, budget.block_size).max())
        if need > pool:
            what = (f"max_model_len {max_model_len:,} tokens" if name == "contiguous-max"
                    else "the workload's longest request")  # fmt: skip
            out[name] = (
                f"reserves {need:,} blocks for {what} in one contiguous run, but the pool has {pool:,}; "
                "a smaller --max-model-len or a larger --gpu plans it"
            )
    return out


def plan_capacity(
    budget: KVBudget,
    workload: Workload,
    max_model_len: int,
    *,
    max_num_seqs: int = 256,
    allocators: Sequence[str] = ALLOCATORS,
    progress: bool | None | Progress = None,
) -> dict[str, Any]:
    """Blocks per request and concurrent requests per allocator (see the module docstring), JSON-ready.
    `progress`: a line on stderr naming each step (None: on a terminal, where the work takes over a
    second; a `Progress` of the caller's: its line)."""
    if isinstance(progress, Progress):
        return _plan_capacity(budget, workload, max_model_len, max_num_seqs, allocators, progress)
    with Progress("pagedkv plan", enabled=progress, tick=True) as bar:
        return _plan_capacity(budget, workload, max_model_len, max_num_seqs, allocators, bar)


def _plan_capacity(
    budget: KVBudget, workload: Workload, max_model_len: int, max_num_seqs: int, allocators: Sequence[str],
    bar: Progress,
) -> dict[str, Any]:  # fmt: skip
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
        bar.stage(name)
        if name in ("contiguous-max", "contiguous-oracle"):
            sizes = contiguous_blocks(name, workload, max_model_len, b)
            result[name] = _contiguous_row(name, sizes, p, o, life, budget, max_model_len, max_num_seqs)
            continue
        avg = float(growing.sum() / total_life)
        full = float((full_blocks * life).sum() / total_life)
        tokens = float(((p + (o - 1) / 2 + 0.5) * life).sum() / total_life)
        if name == "paged-prefix":
            avg, full = _prefix_shared_blocks(workload, budget, life, avg, full, max_num_seqs, bar)
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
    if budget.model.is_hybrid:
        bar.stage("KV cache groups of the hybrid model")
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
        # a hybrid model (sliding layers): the same workload with one table per KV cache group, and the
        # uniform vs hybrid KV at fixed contexts (pagedkv.sim.hybrid_kv)
        **({"kv_groups": hybrid_plan(budget, p, o, max_num_seqs)} if budget.model.is_hybrid else {}),
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
    bar: Progress,
) -> tuple[float, float]:
    """(mean, full) blocks per request once shared prefixes are counted once: a fixed point, N -> live
    holders per block -> blocks per request -> N."""
    total_life = float(life.sum())
    free_blocks = budget.num_usable_blocks
    bar.stage("paged-prefix: hashing shared prefixes", unit="blocks")
    chains = shared_prefix_chains(workload.requests, budget.block_size, bar)
    n, avg, full = max(int(free_blocks // avg0), 1), avg0, full0
    for i in range(20):
        bar.stage(f"paged-prefix: blocks shared by live requests, pass {i + 1}")
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
