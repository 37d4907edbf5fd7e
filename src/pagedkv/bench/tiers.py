"""`pagedkv bench tiers`: put/get throughput and lookup latency of each tier below the device.

Blocks are `--block-size` tokens of a 7B-shaped model by default (Llama-2-7B: 32 layers, 32 KV heads, head
dim 128, float16: 8 MiB per 16-token block, K and V of every layer). For each tier (host RAM, local disk,
Redis), `--blocks` distinct blocks are put in batches of `--batch`, then read back in batches of `--batch`
(every byte is compared with what was put), best of `--repeats` rounds, then `--lookups` chains of `--chain` keys are looked up. MB/s
is payload bytes (10^6) per wall second; `lookup us` is the median wall time of one chain lookup;
`round trips/request` is the network round trips of one request's lookup + get of `--chain` blocks (the
remote tier: pipelined EXISTS, then one MGET).

The bench starts its own `redis-server` on a unix socket in a temporary folder (never the one on :6379),
sized to hold every block, or uses `--redis-url`. The disk tier writes into `--disk-path` (default: a
temporary folder); a disk read right after a write is usually served by the page cache, so the disk
figures are the file path's cost (header, CRC32, syscalls) more than the device's. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import add_block_size, check_fits_memory, int_at_least, writable_folder
from pagedkv.tiers.disk import DiskTier
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.keys import model_fingerprint
from pagedkv.tiers.slot_index import LruClock
from pagedkv.tiers.tier import Tier
from pagedkv.tiers.value import DTYPE_BYTES, MAX_KEY_BYTES, BlockLayout

TIERS = ("host", "disk", "redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    count = int_at_least(1, 1 << 20)
    parser.add_argument("--blocks", type=count, default=32, help="distinct blocks put and read back per tier")
    parser.add_argument("--batch", type=count, default=8, help="blocks per put/get call")
    parser.add_argument("--chain", type=count, default=8, help="blocks per request (lookup + get)")
    parser.add_argument("--lookups", type=count, default=200, help="chain lookups timed per tier")
    parser.add_argument(
        "--repeats", type=int_at_least(1, 1000), default=3, help="put+get rounds per tier; the best is reported"
    )
    parser.add_argument("--layers", type=int_at_least(1, 1024), default=32)
    parser.add_argument("--kv-heads", type=int_at_least(1, 1024), default=32)
    parser.add_argument("--head-dim", type=int_at_least(1, 4096), default=128)
    add_block_size(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float16")
    parser.add_argument(
        "--disk-path", type=writable_folder, default=None,
        help="folder for the disk tier's file (default: a temp folder)",
    )  # fmt: skip
    parser.add_argument("--redis-url", default=None, help="use this store instead of starting a redis-server")
    parser.add_argument("--quick", action="store_true", help="small blocks and counts, for smoke tests")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_tier(name: str, tier: Tier, args: argparse.Namespace, values: np.ndarray) -> dict[str, Any]:
    """Put, get and lookup figures of one tier (see the module docstring)."""
    n, batch, nbytes = args.blocks, args.batch, tier.layout.nbytes
    keys = [_key(i) for i in range(n)]
    out = np.zeros((min(batch, n), nbytes), dtype=np.uint8)
    put_s = get_s = float("inf")
    for _ in range(args.repeats):  # best of: the first round also pays page faults and file growth
        tier.remove(keys)
        put_total = get_total = 0.0
        for i in range(0, n, batch):
            t0 = time.perf_counter()
            tier.put(keys[i : i + batch], values[i : i + batch])
            put_total += time.perf_counter() - t0
        for i in range(0, n, batch):
            part = keys[i : i + batch]
            t0 = time.perf_counter()
            tier.get(part, out[: len(part)])
            get_total += time.perf_counter() - t0
            if not np.array_equal(out[: len(part)], values[i : i + len(part)]):
                raise AssertionError(f"bench tiers: {name} returned other bytes than were put")
        put_s, get_s = min(put_s, put_total), min(get_s, get_total)
    chain = keys[: args.chain]
    lookups = [_timed(lambda: tier.lookup(chain)) for _ in range(args.lookups)]
    trips_before = getattr(tier, "round_trips", 0)
    tier.lookup(chain)
    tier.get(chain, np.zeros((len(chain), nbytes), dtype=np.uint8))
    trips = getattr(tier, "round_trips", 0) - trips_before
    mb = n * nbytes / 1e6
    return {
        "tier": name,
        "blocks": n,
        "block_bytes": nbytes,
        "put_MBps": round(mb / put_s, 1),
        "get_MBps": round(mb / get_s, 1),
        "lookup_us": round(statistics.median(lookups) * 1e6, 1),
        "round_trips_per_request": trips,
    }


def _bench_remote(
    name: str, args: argparse.Namespace, layout: BlockLayout, fingerprint: Any, values: np.ndarray
) -> dict[str, Any]:
    """The Redis tier: on `--redis-url`, or on a redis-server of our own started (and stopped) here."""
    from pagedkv.tiers.remote import RedisTier

    server: Any = None
    url = args.redis_url
    if url is None:
        from pagedkv.tiers.redis_server import RedisServer

        mib = 2 * args.blocks * layout.value_bytes(MAX_KEY_BYTES) // 2**20 + 64
        server = RedisServer(maxmemory=f"{mib}mb").start()
        url = server.url
    try:
        remote = RedisTier(url, layout, fingerprint, timeout_s=30.0)
        why = remote.probe() if args.redis_url is not None else None
        if why is not None:  # a store that does not answer is the user's URL, not a benchmark failure
            remote.close()
            raise InvalidArgumentError(f"--redis-url {remote.url}: {why}")
        result = bench_tier(name, remote, args, values)
        remote.remove([_key(i) for i in range(args.blocks)])
        remote.close()
    finally:
        if server is not None:
            server.stop()
    return result


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.layers, args.kv_heads, args.head_dim, args.blocks, args.lookups, args.repeats = (
            2,
            2,
            16,
            8,
            20,
            1,
        )
    layout = BlockLayout(args.dtype, (args.layers, 2, args.block_size, args.kv_heads, args.head_dim))
    tiers_bytes = len(args.tiers) * args.blocks * layout.value_bytes(MAX_KEY_BYTES)
    check_fits_memory(2 * tiers_bytes, "these tiers' blocks", "lower --blocks or the block's shape")
    fingerprint = model_fingerprint(
        "bench", args.dtype, args.layers, args.kv_heads, args.head_dim, args.block_size
    )
    values = np.random.default_rng(0).integers(0, 256, (args.blocks, layout.nbytes), dtype=np.uint8)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-tiers-") as tmp:
        for name in args.tiers:
            clock = LruClock()
            if name == "host":
                results.append(bench_tier(name, HostTier(args.blocks, layout, clock), args, values))
            elif name == "disk":
                folder = args.disk_path or tmp
                disk = DiskTier(
                    f"{folder}/bench.blocks", args.blocks * layout.value_bytes(MAX_KEY_BYTES), layout, clock
                )
                try:
                    results.append(bench_tier(name, disk, args, values))
                finally:
                    disk.close()
            else:
                results.append(_bench_remote(name, args, layout, fingerprint, values))
    config = {"dtype": args.dtype, "shape": list(layout.shape), "block_bytes": layout.nbytes, "batch": args.batch,
              "chain": args.chain, "repeats": args.repeats, "redis": "own redis-server, unix socket" if args.redis_url is None else args.redis_url}  # fmt: skip
    if args.json:
        print(json.dumps({"config": config, "results": results}, indent=2))
        return 0
    print("tiers (" + ", ".join(f"{k}={v}" for k, v in config.items()) + ")")
    print(
        f"{'tier':6} {'blocks':>6} {'put MB/s':>10} {'get MB/s':>10} {'lookup us':>10} {'round trips/request':>20}"
    )
    for r in results:
        print(f"{r['tier']:6} {r['blocks']:>6} {r['put_MBps']:>10} {r['get_MBps']:>10} {r['lookup_us']:>10} "
              f"{r['round_trips_per_request']:>20}")  # fmt: skip
    return 0
