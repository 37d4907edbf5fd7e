"""`pagedkv bench e2e`: end-to-end serving throughput of a real model on this CPU, five systems, one workload.

Systems, all on the same model, the same requests, one torch thread and the same KV budget (`--num-blocks`
blocks of `--block-size` tokens, every block the systems may hold counted in it):
- `pagedkv-paged`: the pagedkv engine with the paged allocator (prefix caching on, preemption by recompute
  by default; `--preemption swap` takes the host pool (`--host-blocks`, default a quarter of the budget)
  out of the budget, so the device keeps `num_blocks - host_blocks` blocks and the total stays the same;
  `--speculative SPEC` speculates, its counters in the JSON's `speculation`);
- `pagedkv-contiguous`: the same engine with the contiguous baseline (reserves prompt + max_new_tokens);
- `pagedkv-contiguous-oracle`: the contiguous baseline told each request's true output length (it reserves
  prompt + true length): the gap between it and `pagedkv-contiguous` is the over-declared maximum, the gap
  between it and `pagedkv-paged` is what paging itself buys;
- `hf-continuous-batching`: transformers' continuous batching with the same page size and number of blocks
  (`continuous_batching_context_manager` + `add_request` with each request's own output length);
- `hf-static`: plain `generate` over left-padded static batches (its cache is not bounded by the budget).

Admission headroom is the same for every paged system: `--admission-headroom H` (default 0: none) is the
pagedkv scheduler's `admission_headroom` and transformers' `safety_margin` alike (below that fraction of free
blocks at the start of a step, neither admits a new request beyond the first one scheduled; transformers'
own default is 0.15). The pagedkv engine's growth reserve (`--admission-lookahead`, default 16 tokens: the
scheduler's own default, see `pagedkv.engine.scheduler`) is a policy of its scheduler with no counterpart in
transformers (which admits past a request that does not fit instead); it does not apply to the contiguous
systems, whose growth is reserved at admission. `systems[NAME]["config"]` in the JSON lists every setting
that differs between systems, and `admission_headroom` the common value.

Workload: `--num-requests` rows (default 32, from row `--trace-offset`, default 0) of the Azure conv trace
(Patel et al., "Splitwise", ISCA 2024, CC-BY 4.0), prompt length `max(8, ContextTokens // prompt_scale)` (default 16), output length
`max(4, GeneratedTokens // output_scale)` (default 2), seeded random prompt ids (no special ids), all
arriving at t=0, greedy decoding with EOS ignored so every system does the same work. Prompts are scaled down
more than outputs because a one-thread CPU prefills ~300 tokens/s: at the trace's own 6:1 ratio the run
would measure mostly prefill, which every system does identically.

Each request declares `max_new_tokens = --max-new-tokens` (default: the trace's longest output, 1000, scaled
the same way), as a client would: output lengths are not known in advance. The pagedkv engine stops each
request at its trace length as if the model had emitted EOS there (a client-side stop through the streaming
callback); the contiguous allocator must still reserve the declared maximum, which is the waste paging
removes. transformers' continuous batching is given each request's exact length instead (it cannot take a
stop callback), which can only help it.

Per system: tokens_per_s (output tokens / wall), requests_per_s, peak_concurrency (most requests between
first token and finish at once), kv_utilization (time-averaged live KV tokens / KV capacity while any request
decodes), TTFT and TPOT percentiles, wall_s; and cpu_s / tokens_per_cpu_s (process CPU time, all threads):
the machines are shared, so wall-clock figures move with other load while CPU time barely does. `outputs_identical` says whether every system produced the same
token ids for every request.

`--repeat N` runs the systems N times, interleaved (A B A B ...), so a slow spell of a shared machine falls
on both sides of a ratio: each system's figures are its median run's (with every run's tokens/s and wall
time), `ratios` divides the median runs, and `ratio_ranges` gives the median, min and max of the per-run
ratios (run i of one system against run i of the other).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.engine.cli_args import (
    add_block_size,
    add_kv_cache_dtype,
    add_linear_backend,
    add_scheduler_arguments,
    add_speculative,
    add_threads,
    check_fits_memory,
    float_in,
    int_at_least,
    nonnegative_int,
    output_file,
    positive_int,
    scheduler_from,
    seed_int,
    token_count,
    use_threads,
)
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.percentiles import percentile
from pagedkv.workloads.traces import default_trace_path, load_trace

SYSTEMS = (
    "pagedkv-paged",
    "pagedkv-contiguous",
    "pagedkv-contiguous-oracle",
    "hf-continuous-batching",
    "hf-static",
)
TRACE_MAX_OUTPUT = 1000  # longest output of the Azure conv trace (data/README.md)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Timeline:
    """What one system did for one request: output ids and the time of each output token (t=0 at start)."""

    output_token_ids: list[int]
    token_times: list[float] = field(default_factory=list)


def build_workload(
    num_requests: int, prompt_scale: int, output_scale: int, vocab_size: int, seed: int = 0, offset: int = 0
) -> list[BenchRequest]:
    """The seeded requests every system serves (see the module docstring): trace rows
    `[offset, offset + num_requests)`."""
    rows = load_trace(default_trace_path(), limit=offset + num_requests)[offset:]
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        n = max(8, row.prompt_len // prompt_scale)
        ids = rng.integers(100, vocab_size, size=n).tolist()
        out.append(BenchRequest(f"r{row.index}", ids, max(4, row.output_len // output_scale)))
    return out


# --- systems ------------------------------------------------------------------------------------------


def pagedkv_config(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """The settings of one pagedkv system, as the JSON reports them (`systems[NAME]["config"]`)."""
    allocator = "paged" if system == "pagedkv-paged" else "contiguous"
    # the contiguous baseline reserves every request's maximum up front, so it never preempts
    mode = args.preemption if allocator == "paged" else "recompute"
    host = args.host_blocks if mode == "swap" else 0
    return {
        "allocator": allocator,
        "prefix_caching": True,
        "preemption_mode": mode,
        "num_blocks": args.num_blocks - host,  # device blocks; host + device = the budget
        "host_blocks": host,
        "admission_headroom": args.admission_headroom,
        "growth_reserve_tokens": args.admission_lookahead if allocator == "paged" else "none (reserved at admission)",
        "block_size": args.block_size,
        "max_batch_tokens": args.max_num_batched_tokens,
        "declared_max_new_tokens": "true length" if system.endswith("-oracle") else args.max_new_tokens,
        "attention": "pagedkv (engine default)",
        # speculation rolls rejected drafts back, which the contiguous baseline cannot: pagedkv-paged only
        "speculative": args.speculative.describe() if args.speculative and allocator == "paged" else "off",
    }


def hf_continuous_config(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' ContinuousBatchingConfig arguments (the page-size keyword is `page_size` from 5.17 on,
    `block_size` before: whichever this version's config declares), plus the attention implementation."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = (
        {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        if dataclasses.is_dataclass(ContinuousBatchingConfig)
        else set()
    )
    page_key = "page_size" if "page_size" in names or not names else "block_size"
    return {
        page_key: args.block_size,
        "num_blocks": args.num_blocks,
        "max_batch_tokens": args.max_num_batched_tokens,
        "safety_margin": args.admission_headroom,
        "attn_implementation": "sdpa",
        "declared_max_new_tokens": "true length",
        "growth_reserve_tokens": "none (its scheduler admits past a request that does not fit instead)",
    }


def run_pagedkv(
    model: Any, workload: Sequence[BenchRequest], system: str, args: argparse.Namespace
) -> tuple[dict[str, Timeline], dict[str, Any]]:
    """The engine's timelines, and its counters (preemptions, tokens run through the model, steps)."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    cfg = pagedkv_config(system, args)
    config = EngineConfig(
        num_blocks=cfg["num_blocks"],
        block_size=args.block_size,
        allocator=cfg["allocator"],
        scheduler=scheduler_from(
            args, preemption_mode=cfg["preemption_mode"], admission_headroom=args.admission_headroom
        ),
        num_host_blocks=cfg["host_blocks"],
        kv_cache_dtype=args.kv_cache_dtype,
        kv_scale_scheme=args.kv_scale_scheme,
        linear_backend=args.linear_backend,
        speculative=args.speculative if cfg["speculative"] != "off" else None,
    )
    oracle = system.endswith("-oracle")
    engine = Engine(model, None, config)
    timelines: dict[str, Timeline] = {}
    lengths = {r.request_id: r.output_len for r in workload}
    t0 = time.perf_counter()

    def on_token(out: Any) -> None:
        tl = timelines[out.request_id]
        tl.token_times.append(time.perf_counter() - t0)
        tl.output_token_ids = list(out.output_token_ids)
        if len(out.output_token_ids) >= lengths[out.request_id] and not out.finished:
            engine.finish(out.request_id, "stop")  # the trace's EOS

    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for r in workload:
        timelines[r.request_id] = Timeline([])
        own = SamplingParams(max_new_tokens=r.output_len, ignore_eos=True) if oracle else params
        engine.add_request(
            r.prompt_token_ids, own, request_id=r.request_id, arrival_time=t0, on_token=on_token
        )
    engine.run()
    stats = engine.stats
    counters: dict[str, Any] = {
        "num_steps": stats.num_steps,
        "num_preemptions": stats.num_preemptions,
        "num_scheduled_tokens": stats.num_scheduled_tokens,
        "num_swapped_out_blocks": stats.num_swapped_out_blocks,
    }
    if stats.spec is not None:
        counters["speculation"] = stats.spec.as_dict()
    return timelines, counters


def run_hf_continuous(
    model: Any, workload: Sequence[BenchRequest], config: dict[str, Any], args: argparse.Namespace
) -> dict[str, Timeline]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=args.max_new_tokens
    )
    skip = ("attn_implementation", "declared_max_new_tokens", "growth_reserve_tokens")
    cb = ContinuousBatchingConfig(**{k: v for k, v in config.items() if k not in skip})
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=10
    ) as manager:
        for r in workload:
            manager.add_request(
                r.prompt_token_ids,
                request_id=r.request_id,
                max_new_tokens=r.output_len,
                record_timestamps=True,
                eos_token_id=-1,
            )
        while len(results) < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(
                        f"transformers continuous batching failed on {result.request_id}: {result.error}"
                    )
                results[result.request_id] = result
    return {
        rid: Timeline(list(r.generated_tokens), [t - t0 for t in (r.timestamps or [])])
        for rid, r in results.items()
    }


def run_hf_static(
    model: Any, workload: Sequence[BenchRequest], args: argparse.Namespace
) -> tuple[dict[str, Timeline], float]:
    """Left-padded static batches of `--static-batch` in arrival order; returns timelines and the mean
    fraction of each batch's dense cache holding live tokens."""
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    from pagedkv.hf.oracle import model_eos

    class _Clock(LogitsProcessor):  # called once per generated position, just before sampling it
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter() - t0)
            return scores

    timelines: dict[str, Timeline] = {}
    utilization: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    for b in range(0, len(workload), args.static_batch):
        batch = workload[b : b + args.static_batch]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        steps = max(r.output_len for r in batch)
        clock = _Clock()
        gen = GenerationConfig(do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=0)  # type: ignore[no-untyped-call]
        start = time.perf_counter()
        with torch.inference_mode(), model_eos(model, None):
            out = model.generate(
                ids, attention_mask=mask, generation_config=gen, logits_processor=LogitsProcessorList([clock])
            )
        for i, r in enumerate(batch):
            timelines[r.request_id] = Timeline(
                out[i, width : width + r.output_len].tolist(), clock.times[: r.output_len]
            )
        live = sum(len(r.prompt_token_ids) + r.output_len / 2 for r in batch)
        utilization.append((time.perf_counter() - start, live / (len(batch) * (width + steps))))
    total = sum(dt for dt, _ in utilization)
    return timelines, sum(dt * u for dt, u in utilization) / total if total else 0.0


# --- figures ------------------------------------------------------------------------------------------


def summarize(
    workload: Sequence[BenchRequest], timelines: dict[str, Timeline], wall_s: float, capacity_tokens: int
) -> dict[str, Any]:
    """The per-system figures (see the module docstring)."""
    ttft, tpot, events, live = [], [], [], []
    tokens = 0
    for r in workload:
        tl = timelines[r.request_id]
        times = tl.token_times[: r.output_len]
        tokens += min(len(tl.output_token_ids), r.output_len)
        if not times:
            continue
        ttft.append(times[0])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
        events += [(times[0], 1), (times[-1], -1)]
        # live KV tokens of this request between consecutive output tokens
        for k in range(len(times) - 1):
            live.append((times[k], times[k + 1], len(r.prompt_token_ids) + k + 1))
    running = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], -e[1])):
        running += delta
        peak = max(peak, running)
    util = None
    if live and capacity_tokens > 0:
        start = min(a for a, _, _ in live)
        end = max(b for _, b, _ in live)
        util = (
            sum((b - a) * n for a, b, n in live) / ((end - start) * capacity_tokens) if end > start else None
        )
    return {
        "tokens_per_s": tokens / wall_s,
        "requests_per_s": len(workload) / wall_s,
        "output_tokens": tokens,
        "peak_concurrency": peak,
        "kv_utilization": util,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "wall_s": wall_s,
    }


def _bench_scheduler() -> SchedulerConfig:
    """The engine's scheduler defaults with a 256-token step budget (a CPU-sized step, every system alike)."""
    return SchedulerConfig(max_num_batched_tokens=256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, a local transformers folder or a .gguf file"
    )
    add_threads(parser)
    add_linear_backend(parser)
    add_speculative(parser)  # pagedkv-paged only (the contiguous baseline cannot roll drafts back)
    parser.add_argument("--num-requests", type=int_at_least(1, 10_000), default=32)
    parser.add_argument(
        "--trace-offset", type=int_at_least(0, 10_000), default=0,
        help="skip this many trace rows first (another slice of the trace)",
    )  # fmt: skip
    parser.add_argument("--prompt-scale", type=positive_int, default=16, help="prompt len = ContextTokens // this")
    parser.add_argument(
        "--output-scale", type=positive_int, default=2, help="output length = GeneratedTokens // this"
    )
    parser.add_argument(
        "--max-new-tokens", type=token_count, default=None, help="declared cap (default: 1000 // output scale)"
    )
    parser.add_argument(
        "--num-blocks", type=int_at_least(2, 1 << 24), default=96,
        help="KV budget in blocks (same for every paged system)",
    )  # fmt: skip
    add_block_size(parser)
    add_kv_cache_dtype(parser)  # pagedkv's systems; the transformers baselines keep the model's dtype
    parser.add_argument(
        "--host-blocks",
        type=nonnegative_int,
        default=None,
        help="with --preemption swap: host blocks, counted inside --num-blocks (default: a quarter of it)",
    )
    parser.add_argument(
        "--admission-headroom",
        type=float_in(0.0, 1.0),
        default=0.0,
        help="fraction of blocks that must be free for a step to admit more than one new request, the same for "
        "every paged system (transformers' safety_margin; its own default is 0.15)",
    )
    # --max-num-batched-tokens (256 here: a CPU-sized step), --max-num-seqs, --admission-lookahead (the
    # engine's growth reserve, 16; 0 = greedy, the engine before 2026-12), --preemption (of pagedkv-paged
    # only; swap takes the host pool out of --num-blocks, see --host-blocks)
    add_scheduler_arguments(parser, _bench_scheduler(), preemption=True)
    parser.add_argument(
        "--repeat",
        type=int_at_least(1, 1000),
        default=1,
        help="runs per system, interleaved (A B A B ...); figures are the median run's, ratios the median and "
        "range of the per-run ratios",
    )
    parser.add_argument("--static-batch", type=int_at_least(1, 4096), default=8, help="batch size of hf-static")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS)
    )
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--outputs-file", type=output_file(), help="write every system's output token ids (JSON)")


def run(args: argparse.Namespace) -> int:

    from pagedkv.hf.loading import load_model
    from pagedkv.hf.model_spec import model_spec

    args.threads = use_threads(args.threads)  # resolved, so the JSON says the count
    # 1. the arguments, the model and the workload, checked before anything runs
    if args.max_new_tokens is None:
        args.max_new_tokens = TRACE_MAX_OUTPUT // args.output_scale
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    problem = _argument_problem(args, systems)
    if problem:
        print(f"pagedkv bench e2e: error: {problem}", file=sys.stderr)
        return 2
    model, _ = load_model(args.model)
    spec = model_spec(model)
    workload = build_workload(
        args.num_requests, args.prompt_scale, args.output_scale, model.config.vocab_size, args.seed,
        args.trace_offset,
    )
    if any(r.output_len > args.max_new_tokens for r in workload):
        print(f"pagedkv bench e2e: error: --max-new-tokens {args.max_new_tokens} is below a request's output "
              "length", file=sys.stderr)  # fmt: skip
        return 2
    if args.host_blocks is None:
        args.host_blocks = args.num_blocks // 4 if args.preemption == "swap" else 0
    if args.preemption == "swap" and not 0 < args.host_blocks <= args.num_blocks - 2:
        print(f"pagedkv bench e2e: error: --host-blocks must be in [1, {args.num_blocks - 2}] (inside "
              "--num-blocks)", file=sys.stderr)  # fmt: skip
        return 2
    warm_up(model, args.max_num_batched_tokens)
    budget_bytes = args.num_blocks * spec.kv_cache_spec().bytes_per_block(args.block_size)
    check_fits_memory(budget_bytes, f"--num-blocks {args.num_blocks:,}", "lower --num-blocks")
    capacity = (args.num_blocks - 1) * args.block_size
    # 2. every system on the same workload, the repeats interleaved so that a slow spell of a shared machine
    # falls on every system alike
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    outputs: dict[str, dict[str, list[int]]] = {}
    for i in range(args.repeat):
        for system in systems:
            label = f"{system} (run {i + 1}/{args.repeat})" if args.repeat > 1 else system
            figure, out = _run_system(system, model, workload, args, capacity, label)
            runs[system].append(figure)
            if outputs.setdefault(system, out) != out:
                print(f"[bench e2e] warning: {system} produced other tokens in run {i + 1}", file=sys.stderr)
    figures = {system: median_run(r) for system, r in runs.items()}
    if args.outputs_file is not None:
        prompts = {r.request_id: r.prompt_token_ids for r in workload}
        args.outputs_file.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    # 3. the figures side by side
    result = _result(args, workload, figures, outputs, budget_bytes)
    result["repeat"] = args.repeat
    result["ratio_ranges"] = paired_ratios(runs, "tokens_per_s")
    result["ratio_ranges_cpu"] = paired_ratios(runs, "tokens_per_cpu_s")
    if args.json:
        print(json.dumps(result))
        return 0
    _print_table(args, workload, result, budget_bytes)
    return 0 if math.isfinite(sum(f["wall_s"] for f in figures.values())) else 1


def _argument_problem(args: argparse.Namespace, systems: list[str]) -> str | None:
    """One line saying what is wrong with the arguments that need no model, or None."""
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        return f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}"
    if args.host_blocks is not None and args.host_blocks < 0:
        return "--host-blocks must be >= 0"
    if args.repeat < 1 or args.trace_offset < 0 or args.num_requests < 1:
        return "--repeat and --num-requests must be >= 1, --trace-offset >= 0"
    if args.admission_lookahead < 0:
        return "--admission-lookahead must be >= 0 (tokens; 0 = greedy admission)"
    if args.max_new_tokens < 1:
        return f"--output-scale {args.output_scale} leaves no output token (1000 // it must be >= 1)"
    return None


def warm_up(model: Any, num_tokens: int) -> None:
    """Untimed forwards at a decode-like and a prefill-like size before any system runs, so the first system
    timed does not pay the process's one-time costs (allocator growth, library initialisation) alone."""
    import torch

    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        for n in (8, num_tokens):
            model(input_ids=torch.full((1, n), 100, dtype=torch.long), use_cache=False)


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the run with the median output tokens/s (the lower middle one for an even count), with
    every run's tokens/s and wall time under `runs_tokens_per_s` and `runs_wall_s`."""
    ordered = sorted(runs, key=lambda f: f["tokens_per_s"])
    figure = dict(ordered[(len(ordered) - 1) // 2])
    figure["runs_tokens_per_s"] = [f["tokens_per_s"] for f in runs]
    figure["runs_wall_s"] = [f["wall_s"] for f in runs]
    return figure


def paired_ratios(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, dict[str, Any]]:
    """`pagedkv-paged / system` of `key` within each run (the runs are interleaved, so run i of both systems
    saw the same machine): median, min, max and every run's ratio."""
    if "pagedkv-paged" not in runs:
        return {}
    out = {}
    for system, other in runs.items():
        if system == "pagedkv-paged":
            continue
        ratios = [a[key] / b[key] for a, b in zip(runs["pagedkv-paged"], other)]
        out[f"pagedkv-paged/{system}"] = {
            "median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios), "runs": ratios,
        }  # fmt: skip
    return out


def _run_system(
    system: str, model: Any, workload: list[Any], args: argparse.Namespace, capacity: int, label: str = ""
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Serve the workload with one system: (its figures, its output token ids per request)."""
    print(f"[bench e2e] {label or system} ...", file=sys.stderr, flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    static_util = None
    counters: dict[str, Any] = {}
    config: dict[str, Any]
    if system.startswith("pagedkv-"):
        config = pagedkv_config(system, args)
        timelines, counters = run_pagedkv(model, workload, system, args)
    elif system == "hf-continuous-batching":
        config = hf_continuous_config(args)
        model.set_attn_implementation("sdpa")
        timelines = run_hf_continuous(model, workload, config, args)
    else:
        config = {"batch_size": args.static_batch, "cache": "dense, not bounded by the budget",
                  "attn_implementation": "sdpa", "declared_max_new_tokens": "longest in the batch"}  # fmt: skip
        model.set_attn_implementation("sdpa")
        timelines, static_util = run_hf_static(model, workload, args)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    figures = summarize(workload, timelines, wall, capacity)
    figures["cpu_s"] = cpu
    figures["tokens_per_cpu_s"] = figures["output_tokens"] / cpu
    figures.update(counters)
    figures["config"] = config
    if static_util is not None:
        figures["kv_utilization"] = static_util
    outputs = {r.request_id: timelines[r.request_id].output_token_ids[: r.output_len] for r in workload}
    return figures, outputs


def _result(
    args: argparse.Namespace,
    workload: list[Any],
    figures: dict[str, dict[str, Any]],
    outputs: dict[str, dict[str, list[int]]],
    budget_bytes: int,
) -> dict[str, Any]:
    """The JSON object: the setup, whether every system produced the same tokens, figures and ratios."""
    first = next(iter(outputs.values()), {})
    identical = all(o == first for o in outputs.values())
    return {
        "model": args.model,
        "torch_threads": args.threads,
        "kv_budget_bytes": budget_bytes,
        "kv_budget_blocks": args.num_blocks,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_scale_scheme": args.kv_scale_scheme,
        "requests": len(workload),
        "trace_offset": args.trace_offset,
        "prompt_tokens_mean": float(np.mean([len(r.prompt_token_ids) for r in workload])),
        "output_tokens_mean": float(np.mean([r.output_len for r in workload])),
        "max_new_tokens": args.max_new_tokens,
        "preemption": args.preemption,
        "host_blocks_inside_budget": args.host_blocks,
        "admission_headroom": args.admission_headroom,
        "outputs_identical": identical,
        "outputs_mismatched": {
            s: sum(o[k] != first[k] for k in first) for s, o in outputs.items() if o != first
        },
        "systems": figures,
        "ratios": {
            f"pagedkv-paged/{s}": figures["pagedkv-paged"]["tokens_per_s"] / f["tokens_per_s"]
            for s, f in figures.items()
            if s != "pagedkv-paged" and "pagedkv-paged" in figures
        },
        "ratios_cpu": {  # output tokens per CPU second: steadier than wall time on a shared machine
            f"pagedkv-paged/{s}": figures["pagedkv-paged"]["tokens_per_cpu_s"] / f["tokens_per_cpu_s"]
            for s, f in figures.items()
            if s != "pagedkv-paged" and "pagedkv-paged" in figures
        },
    }


def _print_table(args: argparse.Namespace, workload: list[Any], result: dict[str, Any], budget_bytes: int) -> None:
    print(
        f"{args.model}: {len(workload)} requests, KV budget {args.num_blocks} blocks x {args.block_size} tokens "
        f"({budget_bytes / 2**20:.1f} MiB), outputs identical: {result['outputs_identical']}"
    )
    cols = (
        "tokens_per_s",
        "requests_per_s",
        "peak_concurrency",
        "kv_utilization",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "wall_s",
    )
    print(f"admission headroom {args.admission_headroom} for every paged system; pagedkv-paged preempts by "
          f"{args.preemption}, host blocks inside the budget: {args.host_blocks}, growth reserve "
          f"{args.admission_lookahead} tokens per running request (pagedkv's scheduler only)")  # fmt: skip
    for name, ratio in result["ratios"].items():
        print(f"{name}: {ratio:.2f}x tokens/s, {result['ratios_cpu'][name]:.2f}x tokens per CPU second")
        spread = result["ratio_ranges"].get(name)
        if spread and len(spread["runs"]) > 1:
            print(f"  over {len(spread['runs'])} interleaved runs: median {spread['median']:.2f}x, "
                  f"range {spread['min']:.2f}-{spread['max']:.2f}x")  # fmt: skip
    print("| system | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for system, f in result["systems"].items():
        cells = [f"{f[c]:.3f}" if isinstance(f[c], float) else str(f[c]) for c in cols]
        print(f"| {system} | " + " | ".join(cells) + " |")
