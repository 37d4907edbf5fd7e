"""`pagedkv simulate`: replay a workload under every allocator on a modelled GPU; table, JSON and figure.

Errors a user can fix (unknown model or GPU, a broken trace row, a budget too small for one request) print
one line naming the bad value or line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.engine.cli_args import (
    OneLineParser,
    int_at_least,
    nonnegative_float,
    output_file,
    positive_float,
    scheduler_from,
)
from pagedkv.sim.options import (
    _int_list,
    activation_bytes_from,
    add_common_arguments,
    catalog_from,
    check_workload,
    dropped_warning,
    sim_config_from,
    workload_from,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    s = parser.add_argument_group("simulation")
    s.add_argument("--plot", metavar="PATH", type=output_file(".png"), help="write the figure (PNG) here")
    s.add_argument(
        "--step-overhead-ms", type=nonnegative_float, default=2.0, help="fixed time per step (default: 2 ms)"
    )
    s.add_argument(
        "--sweep-block-sizes",
        type=_int_list,
        default=[],
        metavar="LIST",
        help="also run every allocator at these block sizes, e.g. 8,16,32,64,128 (with --plot OUT.png: the "
        "sweep figure goes to OUT-sweep.png)",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    s.add_argument(  # pagedkv.sim.guidance
        "--sweep-guidance",
        metavar="PATH",
        type=output_file(".png"),
        help="instead: sweep output-length spread x KV budget, write the decision chart (PNG) here",
    )
    from pagedkv.sim.replicas import add_replica_arguments

    add_replica_arguments(parser)
    _tighten_replica_flags(parser)


def _tighten_replica_flags(parser: argparse.ArgumentParser) -> None:
    """`--replicas N` takes N >= 1 (absent: one GPU, no router), and the replica-only flags are told apart
    from their defaults so that `run` can refuse them without `--replicas` (sim/replicas.py declares them)."""
    for action in parser._actions:
        if action.dest == "replicas":
            action.default, action.type = None, int_at_least(1, 4096)
        elif action.dest == "host_tier_gib":
            action.default, action.type = None, nonnegative_float
        elif action.dest in ("remote_tier_gib", "remote_bandwidth_gbs"):
            action.type = positive_float


def _check_replica_flags(args: argparse.Namespace) -> None:
    if not args.replicas:
        given = [f for f, v in (("--host-tier-gib", args.host_tier_gib), ("--remote-tier-gib", args.remote_tier_gib))
                 if v is not None] + (["--remote-tier"] if args.remote_tier else [])  # fmt: skip
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} models replicas' tiers: add --replicas N")
    if args.host_tier_gib is None:
        args.host_tier_gib = 0.0


def run(args: argparse.Namespace) -> int:
    from pagedkv.sim.runner import run_simulation

    try:
        _check_replica_flags(args)
        spec = workload_from(args)
        check_workload(spec, sim_config_from(args).max_model_len)  # before anything is built
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "sweep_guidance", None):
        from pagedkv.sim.guidance import run_guidance

        try:
            return run_guidance(args)
        except PagedKVError as exc:
            print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
            return 2
    if args.replicas:
        from pagedkv.sim.replicas import run_command

        return run_command(args)

    try:
        report = run_simulation(
            args.model,
            args.gpu,
            spec,
            allocators=args.allocators,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            scheduler=scheduler_from(args),
            step_overhead_s=args.step_overhead_ms / 1000.0,
            tensor_parallel=args.tensor_parallel,
            activation_bytes=activation_bytes_from(args),
            sweep_block_sizes=args.sweep_block_sizes,
            catalog=catalog_from(args),
            progress=not args.no_progress and not args.json,
            evictions=args.eviction,
            partial_reuse=args.partial_reuse,
        )
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    wl = report.workload
    warning = dropped_warning(
        wl.num_dropped,
        len(wl.requests) + wl.num_dropped,
        report.config.max_model_len,
        report.config.model.max_model_len,
    )
    if warning:
        print(f"pagedkv simulate: {warning}", file=sys.stderr)
    _print_report(args, report)
    return 0


def _print_report(args: argparse.Namespace, report: Any) -> None:
    """The table (or `--json`) on stdout, and the figures `--plot` asks for."""
    from pagedkv.sim.report import simulate_text

    data: dict[str, Any] = {}
    if args.json:
        data = report.to_json()
        data["dropped"] = report.workload.num_dropped
        if args.plot:
            data["plot"] = str(args.plot)
    else:
        print(simulate_text(report))
    if args.plot:
        from pagedkv.sim.plot import plot_report, plot_sweep, sweep_path

        path = plot_report(report, args.plot)
        if not args.json:
            print(f"\nfigure written to {path}")
        if report.sweep:
            swept = plot_sweep(report, sweep_path(args.plot))
            if args.json:
                data["sweep_plot"] = str(swept)
            else:
                print(f"block-size sweep figure written to {swept}")
    if args.json:
        print(json.dumps(data, indent=2))


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """`pagedkv simulate` as a function: `simulate_main(["--plot", "out.png"])` (for the demo)."""
    parser = OneLineParser(prog="pagedkv simulate")
    add_arguments(parser)
    return run(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    raise SystemExit(simulate_main())
