"""`pagedkv plan`: the instant capacity planner (no simulation): KV budget, bytes per token and per block,
and how many concurrent requests fit with each allocator for a model, GPU, max_model_len and workload."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pagedkv.core.errors import PagedKVError
from pagedkv.sim.options import (
    add_common_arguments,
    dropped_warning,
    sim_config_from,
    workload_from,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pagedkv.sim.planner import plan_capacity
    from pagedkv.sim.report import plan_text
    from pagedkv.sim.workload import build_workload

    try:
        config = sim_config_from(args)
        model = config.model
        budget = config.budget()
        workload = build_workload(workload_from(args), config.max_model_len)
        plan = plan_capacity(
            budget, workload, config.max_model_len, max_num_seqs=args.max_num_seqs, allocators=args.allocators
        )
    except PagedKVError as exc:
        print(f"pagedkv plan: error: {exc}", file=sys.stderr)
        return 2
    warning = dropped_warning(
        workload.num_dropped,
        len(workload.requests) + workload.num_dropped,
        config.max_model_len,
        model.max_model_len,
    )
    if warning:
        print(f"pagedkv plan: {warning}", file=sys.stderr)
    plan["dropped"] = workload.num_dropped
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(plan_text(plan, budget.lines()))
    return 0


def plan_main(argv: Sequence[str] | None = None) -> int:
    """`pagedkv plan` as a function."""
    parser = argparse.ArgumentParser(prog="pagedkv plan")
    add_arguments(parser)
    return run(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    raise SystemExit(plan_main())
