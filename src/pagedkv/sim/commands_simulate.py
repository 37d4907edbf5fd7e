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
    float_in,
    int_at_least,
    nonnegative_float,
    output_file,
    positive_float,
    scheduler_from,
)
from pagedkv.sim.cli_options import (
    _int_list,
    activation_bytes_from,
    add_common_arguments,
    catalog_from,
    check_workload,
    command_main,
    say_resolved,
    sim_config_from,
    warn_dropped,
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
    sp = parser.add_argument_group("speculative decoding (pagedkv.sim.speculation; paged allocators only)")
    sp.add_argument(
        "--spec-k", type=int_at_least(0, 64), default=0,
        help="draft tokens per decoding request per step (default: 0, no speculation)",
    )  # fmt: skip
    sp.add_argument(
        "--spec-acceptance", type=float_in(0.0, 1.0), default=0.7,
        help="probability that a draft token is accepted given the ones before it were (default: 0.7)",
    )  # fmt: skip
    sp.add_argument(
        "--spec-draft-cost", type=nonnegative_float, default=0.0,
        help="one draft forward's time relative to the target's decode step (default: 0, n-gram lookup; "
        "~0.1 for a draft model a tenth of the target's size)",
    )  # fmt: skip
    sp.add_argument(
        "--spec-fixed-k", action="store_true",
        help="every step proposes --spec-k drafts (default: each request adapts its k as the engine does, "
        "and a request whose drafts keep missing stops speculating for a while)",
    )  # fmt: skip
    sp.add_argument(
        "--spec-no-budget", action="store_true",
        help="no step draft budget: each request's adaptive k alone (default: the engine's DraftBudget cuts "
        "the batch's drafts to those that raise the step's expected tokens per second)",
    )  # fmt: skip
    s.add_argument(  # pagedkv.sim.guidance
        "--sweep-guidance",
        metavar="PATH",
        type=output_file(".png"),
        help="instead: sweep output-length spread x KV budget, write the decision chart (PNG) here",
    )
    _add_replica_arguments(parser)


def _router_list(text: str) -> list[str]:
    from pagedkv.router import POLICIES

    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(n not in POLICIES for n in names):
        raise argparse.ArgumentTypeError(f"expected routers from {','.join(POLICIES)}, got {text!r}")
    return names


def _add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """`--replicas N` (N >= 1; absent: one GPU, no router) and the flags of the replicas' router and tiers
    (`pagedkv.sim.replicas`); the tier flags default to None so that `run` can refuse them without it."""
    from pagedkv.router import POLICIES
    from pagedkv.sim.replicas import DEFAULT_REMOTE_BANDWIDTH, GB

    r = parser.add_argument_group("replicas (scale-out: with --replicas, the paged-prefix allocator only)")
    r.add_argument("--replicas", type=int_at_least(1, 4096), help="simulate N GPUs behind a router (default: off)")
    r.add_argument(
        "--router", type=_router_list, default=list(POLICIES), metavar="LIST",
        help=f"routing policies to compare, comma-separated from {','.join(POLICIES)} (default: all)",
    )  # fmt: skip
    r.add_argument("--host-tier-gib", type=nonnegative_float, help="host-RAM KV tier per replica (GiB)")
    r.add_argument("--remote-tier", action="store_true", help="a remote store shared by the replicas")
    r.add_argument("--remote-tier-gib", type=positive_float, help="remote store capacity (default: unbounded)")
    r.add_argument(
        "--remote-bandwidth-gbs", type=positive_float, default=DEFAULT_REMOTE_BANDWIDTH / GB,
        help="store bandwidth per replica, GB/s (default: 12.5, a 100 Gb/s NIC)",
    )  # fmt: skip


def _check_replica_flags(args: argparse.Namespace) -> None:
    if not args.replicas:
        given = [f for f, v in (("--host-tier-gib", args.host_tier_gib), ("--remote-tier-gib", args.remote_tier_gib))
                 if v is not None] + (["--remote-tier"] if args.remote_tier else [])  # fmt: skip
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} models replicas' tiers: add --replicas N")
    if args.host_tier_gib is None:
        args.host_tier_gib = 0.0


def _run_replicas(args: argparse.Namespace) -> int:
    """`--replicas N`: the table (or JSON) of every router; every replica runs the one `--eviction` policy
    given (default lru) and `--partial-reuse` if given, as `--allocators paged-prefix` would."""
    from pagedkv.sim.replicas import GB, GIB, TierConfig, run_replicas
    from pagedkv.sim.run import _Progress
    from pagedkv.sim.workload import build_workload

    try:
        if len(args.eviction) > 1:
            raise InvalidArgumentError("--replicas runs one eviction policy on every replica: give one to --eviction")
        config = sim_config_from(args, allocator="paged-prefix", eviction=(args.eviction or ["lru"])[0],
                                 partial_reuse=args.partial_reuse)  # fmt: skip
        tiers = TierConfig(
            host_tier_bytes=int(args.host_tier_gib * GIB),
            remote_tier=args.remote_tier or args.remote_tier_gib is not None,
            remote_bytes=None if args.remote_tier_gib is None else int(args.remote_tier_gib * GIB),
            remote_bandwidth=args.remote_bandwidth_gbs * GB,
        )
        workload = build_workload(workload_from(args), config.max_model_len)
        bar = _Progress(len(workload.requests) * len(args.router), not args.no_progress and not args.json)
        try:
            report = run_replicas(
                config, workload, num_replicas=args.replicas, routers=args.router, tiers=tiers, progress=bar
            )
        finally:
            bar.close()
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    warn_dropped("simulate", workload, config)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text())
    return 0


def run(args: argparse.Namespace) -> int:
    from pagedkv.sim.run import run_simulation

    try:
        _check_replica_flags(args)
        spec = workload_from(args)
        config = sim_config_from(args)
        check_workload(spec, config.max_model_len)  # before anything is built
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    say_resolved("simulate", args, config)
    if getattr(args, "sweep_guidance", None):
        from pagedkv.sim.guidance import run_guidance

        try:
            return run_guidance(args)
        except PagedKVError as exc:
            print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
            return 2
    if args.replicas:
        return _run_replicas(args)

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
            kv_cache_dtype=args.kv_cache_dtype,
            kv_scale_scheme=args.kv_scale_scheme,
            sweep_block_sizes=args.sweep_block_sizes,
            catalog=catalog_from(args),
            progress=not args.no_progress and not args.json,
            evictions=args.eviction,
            partial_reuse=args.partial_reuse,
            speculation=_speculation(args),
        )
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    warn_dropped("simulate", report.workload, report.config)
    _print_report(args, report)
    return 0


def _speculation(args: argparse.Namespace) -> Any:
    """The `SpecSim` of `--spec-k`, `--spec-acceptance`, `--spec-draft-cost`, `--spec-fixed-k` and
    `--spec-no-budget` (None when `--spec-k` is 0)."""
    from pagedkv.sim.speculation import SpecSim

    if not getattr(args, "spec_k", 0):
        return None
    return SpecSim(args.spec_k, args.spec_acceptance, args.spec_draft_cost,
                   adaptive=not getattr(args, "spec_fixed_k", False),
                   budget=not getattr(args, "spec_no_budget", False))  # fmt: skip


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
    return command_main("pagedkv simulate", add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(simulate_main())
