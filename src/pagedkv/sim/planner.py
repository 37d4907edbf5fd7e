"""The capacity planner: how many concurrent requests fit with each allocator, without simulating.

For a request of prompt P and output O with block size b, let its life be L = max(O - 1, 1) decode steps
(each step adds one token). What it holds:

- `contiguous-max`: ceil(max_model_len / b) blocks for its whole life;
- `contiguous-oracle`: ceil((P + O) / b) blocks for its whole life;
- `paged`: ceil((P + k) / b) blocks at decode step k, growing one block at a time;
- `paged-prefix`: as `paged`, but leading full blocks it shares with another request of the workload are
  held once for everybody (assumes those requests are live together; sharing between the turns of one
  chat saves prefill compute, not memory, and is not counted).

A random live request is, by Little's law, weighted by its life, so the blocks of "an average live request"
are sum_i sum_steps blocks_i / sum_i L_i, and

    max_concurrent_memory        = usable blocks // that average       (requests at random points of their lives)
    max_concurrent_no_preemption = usable blocks // (life-weighted mean of the blocks at full length)
    max_concurrent               = min(max_num_seqs, max_concurrent_memory)

For contiguous allocators the two memory figures agree (the reservation never changes). For a fixed-length
workload arriving all at once, the contiguous figures are exactly the simulator's peak concurrency.
Usable blocks are the pool less its null block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.sim.allocators import ALLOCATORS, check_allocator
from pagedkv.sim.budget import KVBudget
from pagedkv.sim.workload import Workload
from pagedkv.workloads.generators import GeneratedRequest

IntArray = npt.NDArray[np.int64]


def _ceil_sum(n: IntArray, b: int) -> IntArray:
    """sum_{t=1..n} ceil(t / b), element-wise (closed form: b q (q+1) / 2 + r (q+1), n = q b + r)."""
    q, r = np.divmod(n, b)
    return b * q * (q + 1) // 2 + r * (q + 1)


def shared_prefix_blocks(requests: Sequence[GeneratedRequest], block_size: int) -> tuple[IntArray, int]:
    """Per request, how many leading full prompt blocks a request of another conversation also starts with;
    and how many distinct such blocks exist. Turns of one conversation (linked by `parent`) are not live
    together, so sharing between them does not count."""
    by_index = {r.index: r for r in requests}

    def root(r: GeneratedRequest) -> int:
        while r.parent is not None and r.parent in by_index:
            r = by_index[r.parent]
        return r.index

    keys: list[list[int]] = []
    owners: dict[int, set[int]] = {}
    for r in requests:
        chain, parent, conversation = [], 0, root(r)
        ids = np.ascontiguousarray(r.prompt_token_ids, dtype=np.int32)
        for j in range(len(ids) // block_size):
            parent = hash((parent, ids[j * block_size : (j + 1) * block_size].tobytes()))
            chain.append(parent)
            owners.setdefault(parent, set()).add(conversation)
        keys.append(chain)
    shared = np.array(
        [next((j for j, k in enumerate(chain) if len(owners[k]) < 2), len(chain)) for chain in keys],
        dtype=np.int64,
    )
    distinct = sum(1 for o in owners.values() if len(o) >= 2)
    return shared, distinct


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
        free_blocks = budget.num_usable_blocks
        if name == "contiguous-max":
            avg = full = float(-(-max_model_len // b))
            tokens = float(max_model_len)
        elif name == "contiguous-oracle":
            avg = full = float((full_blocks * life).sum() / total_life)
            tokens = float(((p + o) * life).sum() / total_life)
        else:
            avg = float(growing.sum() / total_life)
            full = float((full_blocks * life).sum() / total_life)
            tokens = float(((p + (o - 1) / 2 + 0.5) * life).sum() / total_life)
            if name == "paged-prefix":
                shared, distinct = shared_prefix_blocks(workload.requests, b)
                saved = float((shared * life).sum() / total_life)
                avg, full = max(avg - saved, 1e-9), max(full - saved, 1e-9)
                free_blocks = max(budget.num_usable_blocks - distinct, 0)
        memory = int(free_blocks // avg)
        no_preempt = int(free_blocks // full)
        result[name] = {
            "max_concurrent": min(max_num_seqs, memory),
            "max_concurrent_memory": memory,
            "max_concurrent_no_preemption": min(max_num_seqs, no_preempt),
            "tokens_per_request": tokens,
            "blocks_per_request": avg,
            "bytes_per_request": avg * budget.bytes_per_block,
        }
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
