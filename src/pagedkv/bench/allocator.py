"""`pagedkv bench allocator`: the allocator's cost per scheduled token, replaying a real trace.

The loop is defined so that other allocators can replay exactly the same work (benchmarks/allocator_vs_peers.py
drives nano-vllm's, SGLang's and vLLM's block managers through it): requests in trace order, timestamps ignored; each step

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

from pagedkv.core import BlockKeys, KVManager
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import (
    add_block_size,
    check_fits_memory,
    existing_file,
    int_at_least,
    output_file,
    positive_int,
)
from pagedkv.engine.managers import MANAGER_KINDS, make_manager
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
    backend: str  # the hot-path backend: "native" (the C extension) or "python" ("-": the contiguous baseline)
    # per step, for plots (not in the JSON): running requests, blocks in use, slots holding KV
    series: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)


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
    if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
        raise InvalidArgumentError(f"max_running must be an int >= 1 (nothing could ever run), got {max_running!r}")
    if not requests:
        raise InvalidArgumentError("replay: no requests (an empty trace, or limit 0)")
    m = make_manager(
        allocator, num_blocks, block_size, enable_prefix_caching=prefix_caching, hash_fn=hash_fn, native=native
    )
    loop = _Loop(m, requests, block_size, max_running, paged=allocator == "paged")
    clock_ns = time.thread_time_ns if clock == "cpu" else time.perf_counter_ns
    timed_ns = 0
    finished_last = 0
    while loop.waiting or len(loop.run_req):
        loop.steps += 1
        t0 = clock_ns()
        t0 += loop.admit(clock_ns)  # 1. admit, FCFS (minus the untimed token synthesis)
        t1 = clock_ns()
        pos, tok = loop.next_tokens()  # the token each request grows by (the model's output): not timed
        t2 = clock_ns()
        pos = loop.grow(pos, tok)  # 2 + 3. grow everyone by one token, preempting the newest until it fits
        t3 = clock_ns()
        loop.generated[loop.run_req] = pos + 1  # the model's bookkeeping (not timed)
        loop.measure()  # utilisation bookkeeping (not timed)
        if check_every and loop.steps % check_every == 0:
            m.check_invariants()
        if progress is not None and finished_last:
            progress(finished_last)
        t4 = clock_ns()
        finished_last = loop.free_finished()  # 4. free the finished
        timed_ns += (t1 - t0) + (t3 - t2) + (clock_ns() - t4)
    m.check_invariants()
    if progress is not None and finished_last:
        progress(finished_last)
    return loop.result(
        allocator, trace_name, timed_ns, num_blocks=num_blocks, prefix_caching=prefix_caching, hash_fn=hash_fn
    )


class _Loop:
    """The state of one `replay`: the queue, the running requests (in admission order) and the counters,
    with one method per phase of the loop in the module docstring."""

    def __init__(
        self,
        m: KVManager,
        requests: list[TraceRequest],
        block_size: int,
        max_running: int,
        *,
        paged: bool,
    ) -> None:
        self.m = m
        self.requests = requests
        self.max_running = max_running
        self.paged = paged  # the paged allocator: requests keep their block keys, shared blocks count once
        self.bs = block_size
        n_req = len(requests)
        self.out_len = np.array([r.output_len for r in requests], dtype=np.int64)
        fits = np.array([r.prompt_len + r.output_len <= m.capacity_tokens for r in requests], dtype=bool)
        self.skipped = int((~fits).sum())
        if self.skipped:
            print(
                f"warning: skipping {self.skipped} request(s) that can never fit {m.capacity_tokens} tokens",
                file=sys.stderr,
            )
        self.generated = np.zeros(n_req, dtype=np.int64)
        self.gen_seed = sm64(
            np.uint64(int(sm64(0)) ^ STREAM_GENERATED) ^ (np.arange(n_req, dtype=np.uint64) << np.uint64(8))
        )
        self.keys: list[BlockKeys | None] = [None] * n_req
        self.prompts: dict[int, np.ndarray] = {}
        self.waiting: deque[int] = deque(int(i) for i in np.nonzero(fits)[0])
        self.run_req = np.zeros(0, dtype=np.int64)  # admission order
        self.run_sid = np.zeros(0, dtype=np.int64)
        self.steps = self.scheduled = 0
        self.peak_used = 0
        self.util_sum = self.floor_sum = 0.0
        self.util_steps = 0
        self.series: dict[str, list[int]] = {"running": [], "blocks_in_use": [], "tokens_held": []}

    def admit(self, clock_ns: Callable[[], int]) -> int:
        """Phase 1: admit waiting requests FCFS while a seat is free and the allocator takes the prompt; then
        publish the admitted prompts. Returns the nanoseconds spent synthesising tokens (not timed)."""
        m, requests, generated = self.m, self.requests, self.generated
        untimed = 0
        new_req: list[int] = []
        new_sid: list[int] = []
        while self.waiting and len(self.run_req) + len(new_req) < self.max_running:
            r = self.waiting[0]
            tokens = self.prompts.get(r)
            if tokens is None:  # token synthesis is the workload's job: not timed
                t_pause = clock_ns()
                tokens = prompt_token_ids(requests[r])
                if generated[r]:
                    tokens = np.concatenate([tokens, generated_token_ids(requests[r], 0, int(generated[r]))])
                self.prompts[r] = tokens
                untimed += clock_ns() - t_pause
            if self.paged and self.keys[r] is None:
                self.keys[r] = BlockKeys()
            adm = m.admit(tokens, max_new_tokens=int(self.out_len[r] - generated[r]), keys=self.keys[r])
            if adm is None:
                break
            self.waiting.popleft()
            del self.prompts[r]
            new_req.append(r)
            new_sid.append(adm.seq_id)
            self.scheduled += len(tokens)
        if new_req:
            # The step writes the admitted prompts: publish them now (peers cache blocks at allocation),
            # after the admission loop, so no request admitted in this step hits another's blocks.
            m.mark_computed(new_sid)
            self.run_req = np.concatenate([self.run_req, new_req])
            self.run_sid = np.concatenate([self.run_sid, new_sid])
        return untimed

    def next_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(position, token) each running request grows by: the synthetic model's output."""
        pos = self.generated[self.run_req]
        tok = (sm64(self.gen_seed[self.run_req] + pos.astype(np.uint64)) % np.uint64(VOCAB)).astype(np.int32)
        return pos, tok

    def grow(self, pos: np.ndarray, tok: np.ndarray) -> np.ndarray:
        """Phases 2 + 3: while growing everyone by one token does not fit (append changed nothing), preempt
        the newest and retry; then mark the step's KV computed. Returns the survivors' positions."""
        m = self.m
        run_req, run_sid = self.run_req, self.run_sid
        while len(run_sid) and not m.append(run_sid, tok):
            r, sid = int(run_req[-1]), int(run_sid[-1])
            m.preempt(sid)
            run_req, run_sid, pos, tok = run_req[:-1], run_sid[:-1], pos[:-1], tok[:-1]
            self.waiting.appendleft(r)
        if len(run_sid):
            m.mark_computed(run_sid)
        self.scheduled += len(run_sid)
        self.run_req, self.run_sid = run_req, run_sid
        return pos

    def measure(self) -> None:
        """Blocks in use and the tokens they hold (shared blocks counted once), for the utilisation figures."""
        if not len(self.run_sid):
            return
        m, bs = self.m, self.bs
        lens = m.seq_lens(self.run_sid).astype(np.int64)
        used = m.num_used_blocks
        self.peak_used = max(self.peak_used, used)
        held = int(lens.sum())
        if self.paged:
            held -= bs * m.num_extra_references  # shared blocks hold their tokens once
        self.util_sum += held / (used * bs)
        self.series["running"].append(len(self.run_sid))
        self.series["blocks_in_use"].append(used)
        self.series["tokens_held"].append(held)
        self.floor_sum += int(lens.sum()) / (int((-(-lens // bs)).sum()) * bs)
        self.util_steps += 1

    def free_finished(self) -> int:
        """Phase 4: free the requests that reached their output length; returns how many."""
        done = self.generated[self.run_req] >= self.out_len[self.run_req]
        finished = int(done.sum())
        if finished:
            for sid in self.run_sid[done].tolist():
                self.m.free(sid)
            keep = ~done
            self.run_req, self.run_sid = self.run_req[keep], self.run_sid[keep]
        return finished

    def result(
        self, allocator: str, trace_name: str, timed_ns: int, *, num_blocks: int, prefix_caching: bool, hash_fn: str
    ) -> ReplayResult:
        m, paged = self.m, self.paged
        stats = m.stats
        wall = timed_ns / 1e9
        return ReplayResult(
            allocator=allocator + ("" if not paged or prefix_caching else "-no-prefix"),
            trace=trace_name,
            requests=len(self.requests) - self.skipped,
            skipped=self.skipped,
            steps=self.steps,
            scheduled_tokens=self.scheduled,
            wall_s=wall,
            us_per_token=wall * 1e6 / max(self.scheduled, 1),
            admissions=stats.admissions,
            preemptions=stats.preemptions,
            prefix_hit_rate=stats.hit_rate,
            peak_blocks_in_use=self.peak_used,
            mean_kv_utilization=self.util_sum / max(self.util_steps, 1),
            utilization_floor=self.floor_sum / max(self.util_steps, 1),
            block_size=self.bs,
            num_blocks=num_blocks,
            max_running=self.max_running,
            prefix_caching=prefix_caching and paged,
            hash_fn=hash_fn if paged and prefix_caching else "-",
            backend=m.hot_path,
            series=self.series,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=existing_file,
        default=None,
        help="Azure CSV(.gz) or Mooncake JSONL (default: shipped Azure conv)",
    )
    p.add_argument(
        "--limit", type=int_at_least(1, 10_000_000), default=3000, help="first N requests of the trace (default 3000)"
    )
    p.add_argument("--num-blocks", type=int_at_least(2, 1 << 28), default=16384, help="KV blocks (default 16384)")
    add_block_size(p)
    p.add_argument(
        "--max-running", type=positive_int, default=256, help="most requests running at once (default 256)"
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--allocator",
        choices=[*MANAGER_KINDS, "both"],
        default="paged",
        help="both: the paged allocator and the contiguous baseline side by side",
    )
    p.add_argument("--hash", dest="hash_fn", choices=["sha256", "fast"], default="sha256")
    p.add_argument(
        "--repeat", type=int_at_least(1, 1000), default=1, help="runs per allocator; the median us/token is reported"
    )
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time the phases in this thread's CPU time (default: robust on a shared machine) or wall time",
    )
    p.add_argument(
        "--plot", type=output_file(".png"), default=None, help="write a PNG: concurrency and KV use per step"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (with --allocator both: one object keyed by allocator)",
    )


def run(args: argparse.Namespace) -> int:
    # the pool's own arrays: a block's token ids (4 bytes a token) and some 64 bytes of bookkeeping
    check_fits_memory(args.num_blocks * (4 * args.block_size + 64), f"--num-blocks {args.num_blocks:,}",
                      "lower --num-blocks or --block-size")  # fmt: skip
    path = args.trace or default_trace_path()
    requests = load_trace(path, limit=args.limit)
    names = ["paged", "contiguous"] if args.allocator == "both" else [args.allocator]
    repeats = args.repeat
    from pagedkv.sim.run import _Progress  # the simulator's bar: tqdm when installed, else a counter

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
    from pagedkv.sim.figures import pyplot, save_figure

    plt = pyplot()

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
    return save_figure(fig, path)
