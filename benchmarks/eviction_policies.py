"""What each eviction policy costs: per block operation at three cache sizes, and in the allocator loop.

    PYTHONPATH=src python benchmarks/eviction_policies.py [--trace PATH] [--limit N] [--repeats 3] [--num-blocks N]

1. Per operation: a policy over n cached-free blocks (n = 1k, 16k, 128k) runs cycles of "evict 16, release
   16 (a chain, tail first), take 4 by a hit and release them again"; the time per block touched is
   printed (thread CPU time). O(1) policies stay flat as n grows, O(log n) ones grow by the heap's depth.
2. In the allocator loop (`pagedkv bench allocator`'s replay, sha256 keys, at most 256 running) over a pool
   small enough to evict (`--num-blocks`, default 2048): us per scheduled token and the prefix hit rate of
   each policy, interleaved, median of `--repeats`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from pagedkv.bench import allocator
from pagedkv.core import PagedKVManager
from pagedkv.core.eviction import EVICTION_POLICIES, eviction_policy
from pagedkv.workloads.traces import default_trace_path, load_trace

SIZES = (1024, 16384, 131072)
CHAIN = 16


def per_op_ns(name: str, n: int, cycles: int = 2000) -> float:
    """ns per block touched by evict/release/take cycles over n cached-free blocks."""
    policy = eviction_policy(name, n + CHAIN + 1, 16)
    rng = np.random.default_rng(0)
    for start in range(1, n + 1, CHAIN):  # fill: chains released tail first
        policy.release(np.arange(min(start + CHAIN, n + 1) - 1, start - 1, -1, dtype=np.int64), 0)
    touched = 0
    t0 = time.thread_time_ns()
    for _ in range(cycles):
        out = policy.evict(CHAIN)
        policy.release(out[::-1].copy(), int(rng.integers(0, 2)))
        cached = out[:4]
        policy.take(cached)
        policy.hit(cached)
        policy.release(cached, 0)
        touched += 2 * CHAIN + 8
    return (time.thread_time_ns() - t0) / touched


def loop_results(requests: Any, num_blocks: int, repeats: int) -> dict[str, tuple[float, float]]:
    """(median us/token, hit rate) of the allocator loop under each policy, interleaved."""
    real = allocator.make_manager
    times: dict[str, list[float]] = {name: [] for name in EVICTION_POLICIES}
    hits: dict[str, float] = {}
    try:
        for _ in range(repeats):
            for name in EVICTION_POLICIES:
                allocator.make_manager = lambda kind, nb, bs, _name=name, **kw: PagedKVManager(  # type: ignore[assignment,misc]
                    nb, bs, hash_fn=kw["hash_fn"], native=kw["native"], eviction=_name
                )
                r = allocator.replay(requests, "paged", num_blocks=num_blocks, block_size=16, max_running=256)
                times[name].append(r.us_per_token)
                hits[name] = r.prefix_hit_rate
    finally:
        allocator.make_manager = real
    return {name: (statistics.median(t), hits[name]) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help="Azure CSV(.gz) or Mooncake JSONL (default: shipped Azure conv)")
    p.add_argument("--limit", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=2048)
    args = p.parse_args()
    print("per block operation (ns), by cached-free blocks:")
    print(f"{'policy':<10}" + "".join(f"{n:>10,}" for n in SIZES))
    for name in EVICTION_POLICIES:
        print(f"{name:<10}" + "".join(f"{per_op_ns(name, n):>10.0f}" for n in SIZES))
    requests = load_trace(args.trace or default_trace_path(), limit=args.limit)
    results = loop_results(requests, args.num_blocks, args.repeats)
    base = results["lru"][0]
    print(f"\nallocator loop, {args.num_blocks} blocks of 16, {len(requests)} requests, median of {args.repeats}:")
    for name, (us, hit) in results.items():
        print(f"{name:<10} {us:.4f} us/token  {us / base:.2f}x lru  prefix hit {100 * hit:.1f}%")


if __name__ == "__main__":
    main()
