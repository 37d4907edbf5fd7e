"""`pagedkv serve | simulate | plan | generate | bench {allocator,attention,e2e,tiers,stalls,bitwise,soak,step,...}`: a thin front door.

Each command lives in the module that owns its logic and exposes `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their command is chosen, so `simulate`, `plan` and
`bench allocator` never load torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from pagedkv import __version__
from pagedkv.core.errors import PagedKVError
from pagedkv.engine.cli_args import OneLineParser
from pagedkv.progress import on_terminal

# command path -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("simulate",): (
        "pagedkv.sim.commands_simulate",
        "replay a workload through the scheduler on a modelled GPU",
    ),
    ("plan",): ("pagedkv.sim.commands_plan", "capacity planner: how many requests fit with each allocator"),
    ("generate",): ("pagedkv.engine.generate_command", "generate text with a real model served on pagedkv"),
    ("serve",): ("pagedkv.serve.serve_command", "an OpenAI-compatible HTTP server of a model on pagedkv"),
    ("bench", "allocator"): ("pagedkv.bench.allocator", "allocator cost per scheduled token on a trace"),
    ("bench", "attention"): ("pagedkv.bench.attention", "paged attention vs contiguous SDPA"),
    ("bench", "e2e"): ("pagedkv.bench.e2e", "end-to-end serving throughput on a real model (CPU)"),
    ("bench", "tiers"): ("pagedkv.bench.tiers", "put/get throughput and lookup latency of host, disk and Redis tiers"),
    ("bench", "stalls"): ("pagedkv.bench.stalls", "step-latency stalls from KV-cache reallocation"),
    ("bench", "bitwise"): (
        "pagedkv.bench.bitwise",
        "what is bit-identical: allocators, vs transformers, Triton",
    ),
    ("bench", "soak"): ("pagedkv.bench.soak", "random operations on both managers, checked against a shadow KV store"),
    ("bench", "serve"): ("pagedkv.bench.serve", "pagedkv serve vs transformers serve under one load generator"),
    ("bench", "replicas"): ("pagedkv.bench.replicas", "replicas on Ray Serve: pagedkv's router vs Ray's, same requests"),
    ("bench", "step"): ("pagedkv.bench.step", "where one engine step's time goes, and its fixed cost"),
    ("bench", "kv-dtype"): (
        "pagedkv.bench.kv_dtype",
        "KV cache dtypes side by side: accuracy, requests at one budget, decode attention time",
    ),
    ("bench", "spec"): ("pagedkv.bench.spec", "tokens/s with and without speculative decoding, side by side"),
    ("bench", "rl"): ("pagedkv.bench.rl", "an RL rollout loop: rollouts, sleep/wake, weight updates, the stale-KV check"),
}


def _chosen(argv: Sequence[str]) -> tuple[str, ...] | None:
    for path in COMMANDS:
        if tuple(argv[: len(path)]) == path:
            return path
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(prog="pagedkv", description="Paged KV-cache management for LLM serving.")
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", metavar="BENCH")
    chosen = _chosen(argv)
    for path, (module_name, help_text) in COMMANDS.items():
        holder = bench if path[0] == "bench" else sub
        p = holder.add_parser(path[-1], help=help_text, description=help_text)
        if path == chosen:  # import only the chosen command's module
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad argument (already one line on stderr)
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    if hasattr(args, "no_progress") and not on_terminal():
        args.no_progress = True  # progress bars only where a person watches (piped: no 40 KB line of redraws)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except PagedKVError as e:  # misuse: one clear line, no traceback
        print(f"pagedkv {' '.join(chosen or ())}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
