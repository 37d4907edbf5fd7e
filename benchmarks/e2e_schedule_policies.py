"""Would another scheduling policy make `pagedkv bench e2e` faster? The real scheduler and allocator, a modelled step.

    PYTHONPATH=src python benchmarks/e2e_schedule_policies.py [--slices 20] [--wide] [--json]

Replays `pagedkv bench e2e`'s workload (the Azure conv trace scaled the same way: prompts // 16, outputs
// 2, all arriving at once, each stopped at its trace length, `max_new_tokens` 500) through the engine's
`Scheduler` and the paged allocator, with the forward pass replaced by a step-time model of this CPU and
SmolLM2-135M: `65 ms + 3.3 ms per scheduled token + 26 us per context token` (a least-squares fit of the
measured step times of a `bench e2e` run, 2026-12-01, `Intel(R) Xeon(R) Processor`). Every policy sees the
same workloads: the default slice (rows 0-31, 96 blocks) and `--slices` more (rows 64k.., sizes 32/64/48
requests over 96/128/64 blocks); `--wide` adds 60 more (prompt/output scales 16/2, 8/1, 32/4, 16/1 x 32-128
requests over 64-256 blocks, rows 500 on). It prints, per policy, the modelled time relative to the
engine's policy (mean, min, max over the workloads, and on how many it is slower) and the default slice's
steps, scheduled tokens and preemptions.

The policies, each a small change of `Scheduler`:
- `engine`: the engine's own (admit in order while the prompt fits and the growth reserve stays free, stop
  at the first that does not; preempt the latest arrival by recompute);
- `skip-ahead`: admission passes over a request that does not fit and tries the next ones (transformers'
  continuous batching does this);
- `victim-cheapest`: preempt the running request with the fewest computed tokens;
- `victim-starved`: preempt the latest arrival among the requests that need a new block this step;
- `headroom-0.15`: the engine with `admission_headroom=0.15`;
- `no-growth-reserve`: the engine with `admission_lookahead=0` (greedy admission, its policy before 2026-12).
`skip-ahead` replaces admission altogether (it admits greedily, with no growth reserve); the victim
policies keep the engine's admission, reserve included.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedkv.bench.e2e import BenchRequest, build_workload
from pagedkv.engine.managers import make_manager
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

STEP_S, TOKEN_S, CONTEXT_S = 0.065, 0.0033, 0.000026


class SkipAhead(Scheduler):
    def _admit_phase(self, out: SchedulerOutput, budget: int, now: float | None, roomy: bool) -> None:
        skipped = []
        while (
            self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
            and not self.swapped and not out.preempted and (roomy or not out.scheduled)
        ):  # fmt: skip
            request = self._waiting[0][-1]
            left = request.max_new_tokens - len(request.output_token_ids)
            admission = self.manager.admit(request.all_token_ids, max_new_tokens=left, keys=request.keys)
            if admission is None:
                skipped.append(heapq.heappop(self._waiting))
                continue
            heapq.heappop(self._waiting)
            chunk = self._chunk(request.num_tokens - admission.num_cached_tokens, budget, request)
            self._start(request, admission.seq_id, admission.num_cached_tokens, chunk, out)
            budget -= chunk
        for entry in skipped:
            heapq.heappush(self._waiting, entry)


class VictimCheapest(Scheduler):
    def _victim(self) -> Request:
        return min(reversed(self.running), key=lambda r: (r.priority, r.num_computed_tokens))


class VictimStarved(Scheduler):
    def _victim(self) -> Request:
        bs = self.manager.block_size
        starved = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1 and (r.num_tokens - 1) % bs == 0]
        return min(reversed(starved or self.running), key=lambda r: (r.priority, -r.arrival_time))


POLICIES: dict[str, tuple[type[Scheduler], dict[str, Any]]] = {
    "engine": (Scheduler, {}),
    "skip-ahead": (SkipAhead, {}),
    "victim-cheapest": (VictimCheapest, {}),
    "victim-starved": (VictimStarved, {}),
    "headroom-0.15": (Scheduler, {"admission_headroom": 0.15}),
    "no-growth-reserve": (Scheduler, {"admission_lookahead": 0}),
}


def replay(policy: tuple[type[Scheduler], dict[str, Any]], workload: list[BenchRequest], num_blocks: int) -> dict[str, Any]:
    """Modelled seconds, steps, scheduled tokens and preemptions of one policy on one workload."""
    cls, extra = policy
    scheduler = cls(make_manager("paged", num_blocks, 16), SchedulerConfig(max_num_batched_tokens=256, **extra))
    lengths = {}
    for r in workload:
        request = Request(r.request_id, r.prompt_token_ids, 500, arrival_time=0.0)
        lengths[r.request_id] = (request, r.output_len)
        scheduler.add_request(request)
    seconds, steps, tokens = 0.0, 0, 0
    while scheduler.has_unfinished():
        out = scheduler.schedule(now=0.0)
        steps, tokens = steps + 1, tokens + out.num_batched_tokens
        seconds += STEP_S + TOKEN_S * out.num_batched_tokens + CONTEXT_S * sum(c.end for c in out.scheduled)
        sampled = {c.request.request_id: 7 for c in out.scheduled if c.produces_token}
        scheduler.update(out, sampled, now=0.0)
        for request_id in sampled:  # stop at the trace length, as the benchmark's callback does
            request, n = lengths[request_id]
            if request.status is not RequestStatus.FINISHED and len(request.output_token_ids) >= n:
                scheduler.finish(request, "stop")
    return {"seconds": seconds, "steps": steps, "tokens": tokens, "preemptions": scheduler.num_preemptions}


def workloads(slices: int, wide: bool = False) -> list[tuple[list[BenchRequest], int]]:
    out = [(build_workload(32, 16, 2, 49152, offset=0), 96)]
    for k in range(slices):
        n, blocks = ((32, 96), (64, 128), (48, 64))[k % 3]
        out.append((build_workload(n, 16, 2, 49152, seed=k, offset=64 * (k // 3 + 1)), blocks))
    if wide:  # other length scales and sizes, from row 500 on; those whose longest request fits
        for i, (prompt_scale, output_scale) in enumerate([(16, 2), (8, 1), (32, 4), (16, 1)]):
            for j, (n, blocks) in enumerate([(32, 96), (64, 128), (48, 64), (96, 256), (128, 192)]):
                for k in range(3):
                    offset = 500 + 300 * k + 97 * j + 1000 * i
                    wl = build_workload(n, prompt_scale, output_scale, 49152, seed=k, offset=offset)
                    if max(-(-(len(r.prompt_token_ids) + r.output_len) // 16) for r in wl) < blocks:
                        out.append((wl, blocks))
    return out


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slices", type=int, default=20, help="workloads beside the default slice")
    parser.add_argument(
        "--wide", action="store_true", help="add 60 workloads of other length scales and sizes (~2 min)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cases = workloads(args.slices, args.wide)
    runs = {name: [replay(policy, wl, nb) for wl, nb in cases] for name, policy in POLICIES.items()}
    base = np.array([r["seconds"] for r in runs["engine"]])
    result: dict[str, Any] = {"workloads": len(cases), "step_model_s": [STEP_S, TOKEN_S, CONTEXT_S], "policies": {}}
    for name, rs in runs.items():
        rel = np.array([r["seconds"] for r in rs]) / base
        result["policies"][name] = {
            "relative_mean": float(rel.mean()), "relative_min": float(rel.min()), "relative_max": float(rel.max()),
            "slower_on": int((rel > 1.001).sum()),
            "default_slice": rs[0],
        }  # fmt: skip
    if args.json:
        emit(json.dumps(result))
        return result
    emit(f"modelled time relative to the engine's policy over {len(cases)} workloads (lower is faster)")
    emit("| policy | mean | min | max | slower on | default slice: modelled s | steps | tokens | preemptions |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for name, p in result["policies"].items():
        d = p["default_slice"]
        rel = f"{p['relative_mean']:.3f} | {p['relative_min']:.3f} | {p['relative_max']:.3f} | {p['slower_on']}"
        emit(f"| {name} | {rel} | {d['seconds']:.1f} | {d['steps']} | {d['tokens']} | {d['preemptions']} |")
    return result


if __name__ == "__main__":
    main()
