"""`pagedkv bench allocator`: the allocator's cost per scheduled token, replaying a real trace.

The loop is defined so that other allocators can replay exactly the same work (PEERS.md): requests in
trace order, timestamps ignored; each step

  1. admits waiting requests first-come-first-served while fewer than `max_running` run and the
     allocator holds the whole prompt; the admitted prompts are published after the admission loop (the
     peers cache blocks at allocation), so no request admitted in the same step hits another's blocks;
  2. while growing every running request by one token does not fit, preempts the most recently admitted
     request (recompute: it goes back to the head of the queue with its prompt plus generated tokens);
  3. grows every running request by one token (and marks the step's KV computed);
  4. frees the requests that reached their output length.

`us_per_token` = time spent in those phases / scheduled tokens (prompt tokens admitted, re-admissions
included, plus grown tokens). Token synthesis (the model's job) and the utilisation bookkeeping are
outside the timed phases. Time is this thread's CPU time by default (`--clock wall` for wall time): on a
shared 2-core machine wall time mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pagedkv.core import BlockKeys, ContiguousKVManager, PagedKVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.workloads.traces import (
    STREAM_GENERATED,
    VOCAB,
    TraceRequest,
    default_trace_path,
    generated_token_ids,
    load_trace,
    prompt_token_ids,
    sm64,
)


@dataclass(frozen=True)
class ReplayResult:
    allocator: str
    trace: str
    requests: int
    skipped: int
    steps: int
    scheduled_tokens: int
    wall_s: float
    us_per_token: float
    admissions: int
    preemptions: int
    prefix_hit_rate: float
    peak_blocks_in_use: int
    mean_kv_utilization: float
    utilization_floor: float
    block_size: int
    num_blocks: int
    max_running: int
    prefix_caching: bool
    hash_fn: str
    backend: str  # the prefix cache's hot-path backend: "native" (the C extension) or "python"
    # per step, for plots (not in the JSON): running requests, blocks in use, slots holding KV
    series: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)


def make_manager(
    allocator: str,
    num_blocks: int,
    block_size: int,
    *,
    prefix_caching: bool,
    hash_fn: str = "sha256",
    native: bool | None = None,
) -> PagedKVManager | ContiguousKVManager:
    if allocator == "paged":
        return PagedKVManager(
            num_blocks, block_size, enable_prefix_caching=prefix_caching, hash_fn=hash_fn, native=native
        )
    if allocator == "contiguous":
        return ContiguousKVManager(num_blocks, block_size)
    raise InvalidArgumentError(f"unknown allocator {allocator!r}; choose paged or contiguous")


def replay(
    requests: list[TraceRequest],
    allocator: str = "paged",
    *,
    num_blocks: int = 16384,
    block_size: int = 16,
    max_running: int = 256,
    prefix_caching: bool = True,
    hash_fn: str = "sha256",
    trace_name: str = "",
    check_every: int = 0,
    clock: str = "cpu",
    native: bool | None = None,
    progress: Callable[[int], object] | None = None,
) -> ReplayResult:
    """Run the loop above; `check_every > 0` also checks the manager's invariants every that many steps.
    `native`: the hot-path backend (None: the C extension if built; False: the Python reference).
    `progress(n)` is told, outside the timed phases, that n more requests finished."""
    m = make_manager(
        allocator, num_blocks, block_size, prefix_caching=prefix_caching, hash_fn=hash_fn, native=native
    )
    paged = isinstance(m, PagedKVManager)
    n_req = len(requests)
    out_len = np.array([r.output_len for r in requests], dtype=np.int64)
    fits = np.array([r.prompt_len + r.output_len <= m.capacity_tokens for r in requests], dtype=bool)
    skipped = int((~fits).sum())
    if skipped:
        print(
            f"warning: skipping {skipped} request(s) that can never fit {m.capacity_tokens} tokens",
            file=sys.stderr,
        )
    generated = np.zeros(n_req, dtype=np.int64)
    gen_seed = sm64(
        np.uint64(int(sm64(0)) ^ STREAM_GENERATED) ^ (np.arange(n_req, dtype=np.uint64) << np.uint64(8))
    )
    keys: list[BlockKeys | None] = [None] * n_req
    prompts: dict[int, np.ndarray] = {}
    waiting: deque[int] = deque(int(i) for i in np.nonzero(fits)[0])
    run_req = np.zeros(0, dtype=np.int64)  # admission order
    run_sid = np.zeros(0, dtype=np.int64)
    steps = scheduled = 0
    timed_ns = 0
    peak_used = 0
    util_sum = floor_sum = 0.0
    util_steps = 0
    finished_last = 0
    series: dict[str, list[int]] = {"running": [], "blocks_in_use": [], "tokens_held": []}
    bs = block_size
    clock_ns = time.thread_time_ns if clock == "cpu" else time.perf_counter_ns

    while waiting or len(run_req):
        steps += 1
        # 1. admit, FCFS
        new_req: list[int] = []
        new_sid: list[int] = []
        t0 = clock_ns()
        while waiting and len(run_req) + len(new_req) < max_running:
            r = waiting[0]
            tokens = prompts.get(r)
            if tokens is None:  # token synthesis is the workload's job: not timed
                t_pause = clock_ns()
                tokens = prompt_token_ids(requests[r])
                if generated[r]:
                    tokens = np.concatenate([tokens, generated_token_ids(requests[r], 0, int(generated[r]))])
                prompts[r] = tokens
                t0 += clock_ns() - t_pause
            if paged and keys[r] is None:
                keys[r] = BlockKeys()
            adm = m.admit(tokens, max_new_tokens=int(out_len[r] - generated[r]), keys=keys[r])
            if adm is None:
                break
            waiting.popleft()
            del prompts[r]
            new_req.append(r)
            new_sid.append(adm.seq_id)
            scheduled += len(tokens)
        if new_req:
            # The step writes the admitted prompts: publish them now (peers cache blocks at allocation),
            # after the admission loop, so no request admitted in this step hits another's blocks.
            m.mark_computed(new_sid)
            run_req = np.concatenate([run_req, new_req])
            run_sid = np.concatenate([run_sid, new_sid])
        t1 = clock_ns()
        pos = generated[run_req]  # the token each request grows by (the model's output): not timed
        tok = (sm64(gen_seed[run_req] + pos.astype(np.uint64)) % np.uint64(VOCAB)).astype(np.int32)
        t2 = clock_ns()
        # 2 + 3. grow everyone by one token; while that does not fit (append changed nothing),
        # preempt the newest and retry
        while len(run_sid) and not m.append(run_sid, tok):
            r, sid = int(run_req[-1]), int(run_sid[-1])
            m.preempt(sid)
            run_req, run_sid, pos, tok = run_req[:-1], run_sid[:-1], pos[:-1], tok[:-1]
            waiting.appendleft(r)
        if len(run_sid):
            m.mark_computed(run_sid)
        scheduled += len(run_sid)
        t3 = clock_ns()
        generated[run_req] = pos + 1  # the model's bookkeeping (not timed)
        # utilisation bookkeeping (not timed)
        if len(run_sid):
            lens = m.seq_lens(run_sid).astype(np.int64)
            used = m.num_used_blocks
            peak_used = max(peak_used, used)
            held = int(lens.sum())
            if paged:
                held -= bs * m.num_extra_references  # shared blocks hold their tokens once
            util_sum += held / (used * bs)
            series["running"].append(len(run_sid))
            series["blocks_in_use"].append(used)
            series["tokens_held"].append(held)
            floor_sum += int(lens.sum()) / (int((-(-lens // bs)).sum()) * bs)
            util_steps += 1
        if check_every and steps % check_every == 0:
            m.check_invariants()
        if progress is not None and finished_last:
            progress(finished_last)
        t4 = clock_ns()
        # 4. free the finished
        done = generated[run_req] >= out_len[run_req]
        finished_last = int(done.sum())
        if finished_last:
            for sid in run_sid[done].tolist():
                m.free(sid)
            keep = ~done
            run_req, run_sid = run_req[keep], run_sid[keep]
        timed_ns += (t1 - t0) + (t3 - t2) + (clock_ns() - t4)
    m.check_invariants()
    if progress is not None and finished_last:
        progress(finished_last)
    stats = m.stats
    wall = timed_ns / 1e9
    return ReplayResult(
        allocator=allocator + ("" if not paged or prefix_caching else "-no-prefix"),
        trace=trace_name,
        requests=n_req - skipped,
        skipped=skipped,
        steps=steps,
        scheduled_tokens=scheduled,
        wall_s=wall,
        us_per_token=wall * 1e6 / max(scheduled, 1),
        admissions=stats.admissions,
        preemptions=stats.preemptions,
        prefix_hit_rate=stats.hit_rate,
        peak_blocks_in_use=peak_used,
        mean_kv_utilization=util_sum / max(util_steps, 1),
        utilization_floor=floor_sum / max(util_steps, 1),
        block_size=block_size,
        num_blocks=num_blocks,
        max_running=max_running,
        prefix_caching=prefix_caching and paged,
        hash_fn=hash_fn if paged and prefix_caching else "-",
        backend=m.prefix.hot.NAME if paged else "-",
        series=series,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Azure CSV(.gz) or Mooncake JSONL (default: shipped Azure conv)",
    )
    p.add_argument("--limit", type=int, default=3000, help="first N requests of the trace (default 3000)")
    p.add_argument("--num-blocks", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--allocator",
        choices=["paged", "contiguous", "both"],
        default="paged",
        help="both: the paged allocator and the contiguous baseline side by side",
    )
    p.add_argument("--hash", dest="hash_fn", choices=["sha256", "fast"], default="sha256")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per allocator; the median us/token is reported"
    )
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time the phases in this thread's CPU time (default: robust on a shared machine) or wall time",
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG: concurrency and KV use per step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (with --allocator both: one object keyed by allocator)",
    )


def run(args: argparse.Namespace) -> int:
    path = args.trace or default_trace_path()
    requests = load_trace(path, limit=args.limit)
    names = ["paged", "contiguous"] if args.allocator == "both" else [args.allocator]
    repeats = max(1, args.repeat)
    from pagedkv.sim.runner import _Progress  # the simulator's bar: tqdm when installed, else a counter

    bar = _Progress(len(requests) * len(names) * repeats, enabled=not args.no_progress)
    results = []
    try:
        for name in names:
            runs = []
            for i in range(repeats):
                bar.describe(f"{name} run {i + 1}/{repeats}")
                runs.append(replay(
                    requests, name, num_blocks=args.num_blocks, block_size=args.block_size,
                    max_running=args.max_running, prefix_caching=not args.no_prefix_caching,
                    hash_fn=args.hash_fn, trace_name=Path(path).name, clock=args.clock, progress=bar,
                ))  # fmt: skip
            results.append(sorted(runs, key=lambda r: r.us_per_token)[len(runs) // 2])
    finally:
        bar.close()
    if args.plot:
        print(f"figure written to {plot_replay(results, args.plot)}", file=sys.stderr)
    if args.json:
        rows = {r.allocator: {k: v for k, v in asdict(r).items() if k != "series"} for r in results}
        print(json.dumps(next(iter(rows.values())) if len(rows) == 1 else rows, indent=1))
        return 0
    print(f"trace {Path(path).name}, first {len(requests)} requests; block size {args.block_size}, "
          f"{args.num_blocks} blocks, at most {args.max_running} running; hot path: {results[0].backend}")  # fmt: skip
    header = (
        "allocator",
        "steps",
        "sched tokens",
        "preempt",
        "hit rate",
        "us/token",
        "peak blocks",
        "kv util",
        "floor",
    )
    print("{:<22} {:>6} {:>13} {:>8} {:>9} {:>9} {:>12} {:>8} {:>7}".format(*header))
    for r in results:
        print(f"{r.allocator:<22} {r.steps:>6} {r.scheduled_tokens:>13,} {r.preemptions:>8} {r.prefix_hit_rate:>8.1%} "
              f"{r.us_per_token:>9.4f} {r.peak_blocks_in_use:>12} {r.mean_kv_utilization:>7.1%} {r.utilization_floor:>6.1%}")  # fmt: skip
    return 0


def plot_replay(results: list[ReplayResult], path: Path) -> Path:
    """Running requests and KV slots (allocated vs holding tokens) per step, one colour per allocator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for r, colour in zip(results, ("tab:blue", "tab:orange", "tab:green")):
        s = r.series
        top.plot(s["running"], color=colour, lw=0.8, label=f"{r.allocator}: {r.steps} steps")
        slots = [b * r.block_size for b in s["blocks_in_use"]]
        bottom.plot(slots, color=colour, lw=0.8, ls="--", label=f"{r.allocator}: slots allocated")
        bottom.plot(s["tokens_held"], color=colour, lw=0.8, label=f"{r.allocator}: slots holding KV "
                    f"(mean utilisation {r.mean_kv_utilization:.1%})")  # fmt: skip
    top.set_ylabel("running requests")
    top.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("KV slots (tokens)")
    bottom.set_xlabel("step")
    bottom.legend(loc="center left", fontsize=8)
    r0 = results[0]
    fig.suptitle(
        f"pagedkv bench allocator: {r0.trace}, {r0.requests} requests; {r0.num_blocks} blocks of "
        f"{r0.block_size} tokens, at most {r0.max_running} running",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
