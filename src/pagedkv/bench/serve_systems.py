"""The systems `pagedkv bench serve` runs: their names, the settings they all get, how each one is started.

Served systems: `pagedkv-serve` (the engine on a thread of the server's process, the default),
`pagedkv-serve-process` (`pagedkv serve --engine-process`: the engine in a process of its own), the CPU peers of `pagedkv.bench.peers` (`vllm`, `openvino` through our
shim, `llama-cpp`, a serial server) and `transformers-serve`; `pagedkv-offline` is the engine in the bench's
process. `--systems` also takes the short names `pagedkv`, `pagedkv-process`, `transformers` and `offline`.

Every system gets the same `Settings`: the dtype, the threads (`--threads`, default this process's CPU
affinity: `pagedkv serve --threads`, `OMP_NUM_THREADS` and torch threads for transformers, vLLM's
`VLLM_CPU_OMP_THREADS_BIND`, OpenVINO's `INFERENCE_NUM_THREADS`, llama.cpp's `n_threads`), the KV budget,
the token budget per step, the running requests and prefix caching, each in its own flags; each reports
what it got in its own terms (`configs`), and the bench prints the settings that differ.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.bench import peers as peer_registry
from pagedkv.bench import serve_procs as procs
from pagedkv.engine.cli_args import scheduler_from

PAGEDKV = "pagedkv-serve"
PAGEDKV_PROCESS = "pagedkv-serve-process"  # pagedkv serve --engine-process: the engine in a process of its own
TRANSFORMERS = "transformers-serve"
OFFLINE = "pagedkv-offline"
SERVED = (PAGEDKV, PAGEDKV_PROCESS, *peer_registry.PEER_NAMES, TRANSFORMERS)
SYSTEMS = (*SERVED, OFFLINE)
ALIASES = {"pagedkv": PAGEDKV, "pagedkv-process": PAGEDKV_PROCESS, "transformers": TRANSFORMERS, "offline": OFFLINE}
DEFAULT_SYSTEMS = (PAGEDKV, TRANSFORMERS, OFFLINE)
PEER_HEADROOM = 0.15  # transformers' default safety_margin; `transformers serve` has no flag for it


def parse_systems(text: str) -> list[str]:
    """The systems of `--systems`, short names resolved, in the order given, each once; `ValueError` names
    the unknown ones."""
    names = [ALIASES.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ValueError(unknown)
    return list(dict.fromkeys(names))


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def settings(args: argparse.Namespace, max_model_len: int) -> peer_registry.Settings:
    """The settings every system gets, from the bench's flags."""
    sched = scheduler_from(args)
    return peer_registry.Settings(
        dtype=peer_registry.DTYPE_NAMES[args.dtype], threads=args.threads, num_blocks=args.num_blocks,
        block_size=args.block_size, max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs, prefix_caching=not args.no_prefix_caching, max_model_len=max_model_len,
    )  # fmt: skip


def missing_peers(systems: list[str]) -> dict[str, str]:
    """The peers asked for that are not installed: name -> the one line saying how to install it."""
    registry = peer_registry.registry()
    return {s: registry[s].install_hint() for s in systems if s in registry and registry[s].python() is None}


def pagedkv_options(args: argparse.Namespace) -> list[str]:
    """`pagedkv serve`'s engine options: the bench's KV budget, block size, scheduler flags, dtype and
    prefix caching; everything else is the engine's default (the same `EngineConfig` the offline row builds
    from them). The threads go on the server's command line (`--threads`), not here."""
    sched = scheduler_from(args)
    options = ["--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
               "--max-num-batched-tokens", str(sched.max_num_batched_tokens), "--max-num-seqs", str(sched.max_num_seqs),
               "--admission-lookahead", str(sched.admission_lookahead),
               "--dtype", peer_registry.DTYPE_NAMES[args.dtype]]  # fmt: skip
    return [*options, "--no-prefix-caching"] if args.no_prefix_caching else options


def engine_config(args: argparse.Namespace) -> Any:
    """The `EngineConfig` `pagedkv serve` builds from `pagedkv_options` (`pagedkv.engine.from_args`: the
    engine's own flags and config builder, which the server shares with `pagedkv generate`)."""
    from pagedkv.engine.from_args import add_engine_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return config_from_args(parser.parse_args(pagedkv_options(args)))


def base_configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every setting of pagedkv serve, transformers serve and the offline engine, as the JSON reports it
    (the peers report theirs when they are launched)."""
    dtype = peer_registry.DTYPE_NAMES[args.dtype]
    common = {"num_blocks": args.num_blocks, "block_size": args.block_size,
              "max_batch_tokens": args.max_num_batched_tokens, "threads": args.threads, "dtype": dtype,
              "weights": "the converted folder"}  # fmt: skip
    sched = engine_config(args).scheduler
    engine = {**common, "admission_headroom": sched.admission_headroom,
              "growth_reserve_tokens": sched.admission_lookahead, "max_running": sched.max_num_seqs,
              "prefix_caching": not args.no_prefix_caching, "preemption": sched.preemption_mode,
              "attention": "pagedkv (engine default)", "ignore_eos": "ignore_eos: true in the body"}  # fmt: skip
    margin = PEER_HEADROOM if args.peer_safety_margin is None else args.peer_safety_margin
    return {
        PAGEDKV: {**engine, "threads": f"{args.threads} (pagedkv serve --threads)",
                  "process": "pagedkv serve (uvicorn, one worker; the engine on a thread)"},
        PAGEDKV_PROCESS: {**engine, "threads": f"{args.threads} (pagedkv serve --threads)",
                         "process": "pagedkv serve --engine-process (uvicorn, one worker; the engine in a process of its own)"},
        TRANSFORMERS: {
            **common,
            "threads": f"{args.threads} (OMP_NUM_THREADS, torch threads)",
            "admission_headroom": margin,
            "growth_reserve_tokens": "none",
            "max_running": "its default",
            "prefix_caching": "allow_block_sharing (its default; no flag to turn it off)",
            "preemption": "recompute (its scheduler's)",
            "attention": "sdpa (paged)",
            "ignore_eos": "generation_config {eos_token_id: -1} in the body",
            "process": "transformers serve --continuous-batching (uvicorn)",
        },
        OFFLINE: {**engine, "threads": f"{args.threads} (torch threads)", "ignore_eos": "SamplingParams(ignore_eos=True)",
                  "process": "Engine in the bench process, no HTTP"},
    }  # fmt: skip


@dataclass(slots=True)
class Started:
    """A running system: its server, the body fields its requests carry, its settings as it reports them."""

    server: procs.ServerProcess
    extra_body: dict[str, Any]
    config: dict[str, Any]


def start(system: str, args: argparse.Namespace, model: peer_registry.Model, settings_: peer_registry.Settings,
          workdir: Path) -> Started:  # fmt: skip
    """Start `system` as a server on a free port and wait until it answers (`RuntimeError` if it does not)."""
    _progress(f"starting {system}")
    configs = base_configs(args)
    threads = peer_registry.thread_env(args.threads)
    if system in (PAGEDKV, PAGEDKV_PROCESS):
        argv = [*procs.pagedkv_argv(str(model.folder), pagedkv_options(args)), "--threads", str(args.threads)]
        if system == PAGEDKV_PROCESS:
            argv.append("--engine-process")
        server = procs.start_server(system, argv, workdir, env=threads)
        return Started(server, {"ignore_eos": True}, configs[system])
    if system == TRANSFORMERS:
        argv = procs.peer_argv(model.folder, args.block_size, args.num_blocks, args.max_num_batched_tokens,
                               args.peer_safety_margin, dtype=peer_registry.DTYPE_NAMES[args.dtype])  # fmt: skip
        server = procs.start_server(system, argv, workdir, env=threads)
        return Started(server, procs.peer_extra_body(), configs[TRANSFORMERS])
    peer = peer_registry.registry()[system]
    python = peer.python()
    if python is None:
        raise RuntimeError(peer.install_hint())
    if peer.prepare is not None:
        model = peer.prepare(model, python)
    launch = peer.launch(model, settings_, workdir, python)
    server = procs.start_server(system, launch.argv, workdir, env=launch.env, port=launch.port,
                                ready_timeout_s=args.peer_start_timeout)  # fmt: skip
    return Started(server, launch.extra_body, launch.config)


def _progress(text: str) -> None:
    if sys.stderr.isatty():
        print(f"[bench serve] {text} ...", file=sys.stderr, flush=True)
