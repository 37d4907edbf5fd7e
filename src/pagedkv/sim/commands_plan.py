"""`pagedkv plan`: the capacity planner (no simulation): KV budget, bytes per token and per block, and how
many concurrent requests fit with each allocator for a model, GPU, max_model_len and workload. It models
no time: the default workload plans in about a second, a 12,000-request Mooncake trace in a few (most of it
building the requests; docs/benchmarks.md has the figures). `--list` prints the known models and GPUs.

It counts the requests live at one moment, so nothing in it evicts or copies a cached block: `--eviction` and
`--partial-reuse` (prefix-cache policies over time, `pagedkv simulate`'s) are refused, not ignored.

Without `--allocators` it plans every allocator that can hold the workload's requests: a contiguous one whose
single reservation exceeds the whole pool (a 131,072-token context on one GPU) is left out, with one line
saying why (`left_out` in `--json`); named in `--allocators`, it is an error. On a terminal a line on stderr
names each step while it runs (`pagedkv.progress`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.sim.allocators import ALLOCATORS
from pagedkv.sim.cli_options import (
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
    parser.set_defaults(allocators=None)  # None: every allocator that fits (see the module docstring)
    parser.add_argument("--list", action="store_true", help="list the known models and GPUs and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from pagedkv.progress import Progress
    from pagedkv.sim.planner import plan_capacity, unfit_allocators
    from pagedkv.sim.report import plan_text
    from pagedkv.sim.workload import build_workload

    if args.list:
        return _print_catalog(args)
    try:
        with Progress("pagedkv plan", enabled=False if args.no_progress else None, tick=True) as bar:
            _refuse_cache_policy(args)
            config = sim_config_from(args)
            budget = config.budget()
            spec = workload_from(args)
            check_workload(spec, config.max_model_len)
            bar.stage("building the workload")
            workload = build_workload(spec, config.max_model_len)
            allocators = args.allocators or list(ALLOCATORS)
            left_out = unfit_allocators(budget, workload, config.max_model_len, allocators)
            for name, why in left_out.items() if args.allocators else ():
                raise InvalidArgumentError(f"--allocators {name}: {name} {why}")
            plan = plan_capacity(
                budget, workload, config.max_model_len, max_num_seqs=args.max_num_seqs,
                allocators=[a for a in allocators if a not in left_out], progress=bar,
            )  # fmt: skip
    except PagedKVError as exc:
        print(f"pagedkv plan: error: {exc}", file=sys.stderr)
        return 2
    say_resolved("plan", args, config)
    warn_dropped("plan", workload, config)
    plan["dropped"] = workload.num_dropped
    plan["left_out"] = left_out
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(plan_text(plan, budget.lines()))
        for name, why in left_out.items():
            print(f"left out: {name}: {why}")
        if "kv_groups" in plan and "paged" in plan["allocators"]:  # a hybrid model: uniform vs hybrid
            from pagedkv.sim.hybrid_kv import hybrid_text

            print(hybrid_text(plan["kv_groups"], plan["allocators"]["paged"]))
    return 0


def _refuse_cache_policy(args: argparse.Namespace) -> None:
    """The plan has no place where a cached block is evicted or copied: refuse those flags (one line)."""
    given = [f for f, v in (("--eviction", args.eviction), ("--partial-reuse", args.partial_reuse)) if v]
    if given:
        raise InvalidArgumentError(
            f"{' and '.join(given)}: plan counts the requests live at one moment, where no cached block is "
            "evicted or copied; compare cache policies over time with pagedkv simulate"
        )


def _print_catalog(args: argparse.Namespace) -> int:
    """`--list`: the models and GPUs `--model`/`--gpu` know (the built-in ones and any `--catalog`'s)."""
    try:
        catalog = catalog_from(args)
    except PagedKVError as exc:
        print(f"pagedkv plan: error: {exc}", file=sys.stderr)
        return 2
    models = {name: catalog.models[name].max_model_len for name in sorted(catalog.models)}
    gpus = {name: catalog.gpus[name].memory_bytes / 2**30 for name in sorted(catalog.gpus)}
    if args.json:
        print(json.dumps({"models": models, "gpus": gpus}, indent=2))
        return 0
    print("models (--model; context in tokens):")
    print("\n".join(f"  {name:<16} {ctx:>9,}" for name, ctx in models.items()))
    print("gpus (--gpu; memory):")
    print("\n".join(f"  {name:<16} {gib:>6.0f} GiB" for name, gib in gpus.items()))
    print("add your own with --catalog FILE (`pagedkv plan --example-catalog` prints the format)")
    return 0


def plan_main(argv: Sequence[str] | None = None) -> int:
    """`pagedkv plan` as a function."""
    return command_main("pagedkv plan", add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(plan_main())
