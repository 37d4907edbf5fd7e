"""What grows inside a long-lived `pagedkv serve`? tracemalloc snapshots around a soak.

    PYTHONPATH=src python benchmarks/serve_memory.py [--warmup 2000] [--requests 8000] [--top 25] [--model FOLDER]
        [--chaos] [--server-option=--dtype=float32 ...]

`pagedkv bench serve --soak N` measures the server's resident memory from outside; this script says which
lines of Python allocated what stayed. It starts `pagedkv serve` (a tiny random llama by default, the soak's
model) under a launcher that turns on `tracemalloc` (10 frames) on a first SIGUSR1 and writes a snapshot on
each later one; it sends `--warmup` short requests, turns tracing on, sends 200 more (so the steady churn is
traced), takes the baseline snapshot, sends `--requests` more, takes the second one, and
prints the `--top` allocation sites by bytes still held in the second and not the first (grouped by
traceback), with their block counts: a structure that keeps something per finished request shows as a site
whose count grows with the requests (about `--requests` or a multiple of it). tracemalloc makes the server
2-3x slower; the figures are Python heap bytes (not RSS: the allocator's own arenas are not counted).
`--chaos` sends the chaos soak's hostile rotation (`pagedkv bench serve --soak N --soak-chaos`) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import signal
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from pagedkv.bench import serve_procs as procs
from pagedkv.bench import serve_soak

# SIGUSR1: the first turns tracemalloc on (tracing the imports and the model load would take many minutes and
# says nothing about growth), each later one writes snapshot N.
LAUNCHER = """
import os, pickle, signal, sys, tracemalloc
out = os.environ["PAGEDKV_SNAPSHOT_DIR"]
count = [0]
def _dump(*_):
    if not tracemalloc.is_tracing():
        tracemalloc.start(10)
        path = os.path.join(out, "snap0.pickle")
        open(path, "wb").close()
        return
    count[0] += 1
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    path = os.path.join(out, f"snap{count[0]}.pickle")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(snap, f)
    os.replace(path + ".tmp", path)
signal.signal(signal.SIGUSR1, _dump)
from pagedkv.cli import main
sys.exit(main(["serve"] + sys.argv[1:]))
"""


def signal_and_wait(server: procs.ServerProcess, folder: Path, index: int) -> Path:
    os.kill(server.pid, signal.SIGUSR1)
    path = folder / f"snap{index}.pickle"
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no snapshot from the server after 300 s:\n{server.log_tail()}")
        time.sleep(0.5)
    return path


def snapshot(server: procs.ServerProcess, folder: Path, index: int) -> tracemalloc.Snapshot:
    with signal_and_wait(server, folder, index).open("rb") as f:
        snap: tracemalloc.Snapshot = pickle.load(f)
    return snap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", default=None, help="model folder (default: the soak's tiny llama)")
    parser.add_argument("--chaos", action="store_true", help="the chaos soak's hostile traffic")
    parser.add_argument("--server-option", action="append", default=[],
                        help="an extra pagedkv serve argument, e.g. --server-option=--dtype=float32")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedkv-serve-memory-") as tmp:
        work = Path(tmp)
        folder = Path(args.model) if args.model else serve_soak.tiny_folder(work / "tiny")
        os.environ["PAGEDKV_SNAPSHOT_DIR"] = str(work)
        argv = [sys.executable, "-c", LAUNCHER, "--model", str(folder), "--host", "127.0.0.1", "--port", "0",
                "--num-blocks", "64", "--block-size", "16", *args.server_option]  # fmt: skip
        server = procs.start_server("pagedkv-serve-traced", argv, work)
        words = serve_soak._vocab_words(folder)
        chaos = 1 << 20 if args.chaos else None

        def drive(n: int) -> None:
            _, errors, first_error = asyncio.run(
                serve_soak._drive(server, n, args.concurrency, n, words, chaos_prompt_bytes=chaos)
            )
            if errors:
                print(f"{errors} of {n} requests did not get their answer; first: {first_error}", file=sys.stderr)

        try:
            drive(args.warmup)
            signal_and_wait(server, work, 0)  # tracing on
            drive(200)
            first = snapshot(server, work, 1)
            rss0 = procs.rss_bytes(server.pid)
            drive(args.requests)
            second = snapshot(server, work, 2)
            rss1 = procs.rss_bytes(server.pid)
        finally:
            procs.stop_server(server)
    print(f"{args.requests} requests after {args.warmup} warm-up: RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB; "
          f"traced heap {sum(s.size for s in first.statistics('filename')) / 2**20:.2f} -> "
          f"{sum(s.size for s in second.statistics('filename')) / 2**20:.2f} MiB")  # fmt: skip
    for stat in second.compare_to(first, "traceback")[: args.top]:
        if stat.size_diff <= 0:
            continue
        print(f"+{stat.size_diff / 1024:9.1f} KiB  +{stat.count_diff:7d} blocks  (now {stat.count} blocks)")
        for line in stat.traceback.format()[-8:]:
            print(f"      {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
