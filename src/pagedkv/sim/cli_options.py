"""Command-line options shared by `pagedkv simulate` and `pagedkv plan` (model, GPU, workload, lengths)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import (
    MAX_TOKENS,
    OneLineParser,
    add_block_size,
    add_kv_cache_dtype,
    add_scheduler_arguments,
    check_fits_memory,
    existing_file,
    float_in,
    fraction,
    int_at_least,
    positive_float,
    scheduler_from,
    seed_int,
    token_count,
)
from pagedkv.sim.allocators import ALLOCATORS
from pagedkv.sim.catalog import EXAMPLE_CATALOG, Catalog
from pagedkv.sim.simulator import SIM_SCHEDULER, SimConfig
from pagedkv.sim.workload import ARRIVALS, DEFAULT_WORKLOAD, GENERATORS, Workload, WorkloadSpec
from pagedkv.workloads.generators import AZURE_CONV_OUTPUT_LOGNORMAL, AZURE_CONV_PROMPT_LOGNORMAL

MAX_REQUESTS = 10_000_000  # requests one workload may hold (each is at least a few hundred bytes)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _lognormal(text: str) -> tuple[float, float]:
    try:
        mu, sigma = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MU,SIGMA (two numbers), got {text!r}") from None
    if not (math.isfinite(mu) and math.isfinite(sigma)) or sigma < 0:
        raise argparse.ArgumentTypeError(f"expected finite MU and SIGMA >= 0, got {text!r}")
    if mu > math.log(MAX_TOKENS) or sigma > 10:  # e^MU tokens is the median length
        raise argparse.ArgumentTypeError(f"MU,SIGMA {text!r} gives lengths beyond any model's context")
    return mu, sigma


def _name_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in ALLOCATORS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown allocator(s) {bad or text!r}; choose from {', '.join(ALLOCATORS)}"
        )
    return names


def _eviction_list(text: str) -> list[str]:
    """`--eviction`: comma-separated eviction policies (pagedkv.core.eviction), or `all`."""
    from pagedkv.core.eviction import EVICTION_POLICIES

    names = list(EVICTION_POLICIES) if text.strip() == "all" else [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in EVICTION_POLICIES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"unknown or repeated eviction policy in {text!r}; choose from {', '.join(EVICTION_POLICIES)} or all"
        )
    return names


class _ExampleCatalog(argparse.Action):
    """`--example-catalog`: print a complete catalog file and exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(EXAMPLE_CATALOG, end="")
        parser.exit(0)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "catalog file format (--catalog FILE; `--example-catalog` prints it):\n\n" + "\n".join(
        "  " + line for line in EXAMPLE_CATALOG.splitlines()
    )
    _add_deployment_arguments(parser)
    _add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("deployment")
    g.add_argument("--model", default="llama-2-7b", help="model name (default: llama-2-7b)")
    g.add_argument("--gpu", default="a100-40gb", help="GPU name (default: a100-40gb)")
    g.add_argument(
        "--tensor-parallel", type=int_at_least(1, 1024), default=1, help="GPUs sharing the model (default: 1)"
    )
    g.add_argument(
        "--catalog", metavar="FILE", type=existing_file, help="JSON/YAML file adding GPUs and models (format below)"
    )
    g.add_argument("--example-catalog", action=_ExampleCatalog, help="print an example catalog file and exit")
    g.add_argument("--max-model-len", type=token_count, help="context limit (default: the model's)")
    add_block_size(g)
    add_kv_cache_dtype(g)
    g.add_argument(
        "--gpu-memory-utilization", type=fraction, default=0.9, help="fraction of memory (default: 0.9)"
    )
    # the simulator models vLLM's scheduler: greedy admission (no growth reserve), an 8192-token budget
    add_scheduler_arguments(g, SIM_SCHEDULER)
    reserve = g.add_mutually_exclusive_group()
    reserve.add_argument(
        "--activation-reserve-gib",
        type=float_in(0.0, 1 << 20),
        help="override the activation reserve estimate (GiB, 2^30 bytes)",
    )
    reserve.add_argument(
        "--activation-reserve-gb", type=float_in(0.0, 1 << 20), help="the same in decimal GB (10^9 bytes; older spelling)"
    )
    g.add_argument(
        "--allocators",
        type=_name_list,
        default=list(ALLOCATORS),
        help=f"comma-separated subset of {','.join(ALLOCATORS)} (default: all)",
    )
    g.add_argument(
        "--eviction",
        type=_eviction_list,
        default=[],
        metavar="LIST",
        help="prefix-cache eviction policies to run paged-prefix under, side by side: lru,slru,lfu,priority,cost "
        "or all (default: lru, one row)",
    )
    g.add_argument(
        "--partial-reuse",
        action="store_true",
        help="paged-prefix copies a cached block a prompt diverges inside, computing only the rest",
    )


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument(
        "--trace", metavar="PATH", type=existing_file, help="Azure CSV or Mooncake JSONL trace to replay"
    )
    src.add_argument(
        "--workload",
        choices=(DEFAULT_WORKLOAD, *GENERATORS),
        default=DEFAULT_WORKLOAD,
        help=f"built-in workload (default: {DEFAULT_WORKLOAD}, the Azure conv trace shipped in the package)",
    )
    w.add_argument(
        "--num-requests", type=int_at_least(1, MAX_REQUESTS), default=1000, help="requests to replay (default: 1000)"
    )
    w.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="trace",
        help="trace: honour timestamps (generators: all at t=0 unless --rate); burst: all at t=0; "
        "poisson: --rate req/s (default: trace)",
    )
    w.add_argument("--rate", type=positive_float, help="Poisson arrival rate, requests/s")
    w.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="replay trace timestamps this much faster"
    )
    w.add_argument("--seed", type=seed_int, default=0, help="generator seed (default: 0)")
    w.add_argument("--prompt-len", type=token_count, default=512, help="fixed workload: prompt tokens (default: 512)")
    w.add_argument("--output-len", type=token_count, default=128, help="fixed workload: output tokens (default: 128)")
    w.add_argument(
        "--system-prompt-len", type=int_at_least(0, MAX_TOKENS), default=1024,
        help="shared-prefix/multi-turn system prompt (default: 1024)",
    )  # fmt: skip
    w.add_argument(
        "--prompt-lognormal",
        type=_lognormal,
        metavar="MU,SIGMA",
        help="variable workload: ln(prompt length) ~ N(MU, SIGMA) (default: Azure conv fit 6.633,0.985)",
    )
    w.add_argument(
        "--output-lognormal",
        type=_lognormal,
        metavar="MU,SIGMA",
        help="variable workload: ln(output length) ~ N(MU, SIGMA) (default: Azure conv fit 5.019,0.859)",
    )
    w.add_argument(
        "--turns", type=int_at_least(1, 10_000), default=4, help="multi-turn: turns per conversation (default: 4)"
    )


def catalog_from(args: argparse.Namespace) -> Catalog:
    catalog = Catalog.builtin()
    if args.catalog:
        catalog.load_file(args.catalog)
    return catalog


def workload_from(args: argparse.Namespace) -> WorkloadSpec:
    arrivals = args.arrivals
    if (
        args.rate is not None
        and arrivals == "trace"
        and args.trace is None
        and args.workload != DEFAULT_WORKLOAD
    ):
        arrivals = "poisson"  # a generator with --rate means Poisson arrivals
    if arrivals == "poisson" and args.rate is None:
        raise InvalidArgumentError("--arrivals poisson needs --rate (requests/s)")
    same = ("num_requests", "rate", "time_scale", "seed", "prompt_len", "output_len", "system_prompt_len", "turns",
            "prompt_lognormal", "output_lognormal")  # WorkloadSpec fields spelled as their flags  # fmt: skip
    return WorkloadSpec(source=args.trace or args.workload, arrivals=arrivals, **{f: getattr(args, f) for f in same})


def activation_bytes_from(args: argparse.Namespace) -> int | None:
    for flag, value, unit in (
        ("--activation-reserve-gib", getattr(args, "activation_reserve_gib", None), 1024**3),
        ("--activation-reserve-gb", args.activation_reserve_gb, 10**9),
    ):
        if value is not None:
            if value < 0:
                raise InvalidArgumentError(f"{flag} must be >= 0, got {value}")
            return int(value * unit)
    return None


def sim_config_from(args: argparse.Namespace, **overrides: object) -> SimConfig:
    """The `SimConfig` the common flags describe (model, GPU, catalog, block size, context, memory, scheduler
    limits, tensor parallelism, activation reserve, and the step overhead where the command has it);
    `overrides` replace fields (a command's own allocator, say)."""
    catalog = catalog_from(args)
    model = catalog.model(args.model)
    if args.kv_cache_dtype != "auto":  # the model's KV stored in another dtype: its bytes per token change
        model = dataclasses.replace(model, kv_cache_dtype=args.kv_cache_dtype)
    if args.kv_scale_scheme != "token":  # checked against the dtype by ModelShape
        model = dataclasses.replace(model, kv_scale_scheme=args.kv_scale_scheme)
    fields: dict[str, object] = {
        "model": model,
        "gpu": catalog.gpu(args.gpu),
        "block_size": args.block_size,
        "max_model_len": args.max_model_len or model.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "scheduler": scheduler_from(args),
        "tensor_parallel": args.tensor_parallel,
        "activation_bytes": activation_bytes_from(args),
    }
    if hasattr(args, "step_overhead_ms"):
        fields["step_overhead_s"] = args.step_overhead_ms / 1000.0
    fields.update(overrides)
    return SimConfig(**fields)  # type: ignore[arg-type]


def say_resolved(command: str, args: argparse.Namespace, config: SimConfig) -> None:
    """One stderr line per name the catalog resolved from another spelling (an alias, another case):
    "pagedkv plan: gpu: h100-80gb (--gpu h100)", so no alias is taken silently."""
    for flag, typed, name in (("--model", args.model, config.model.name), ("--gpu", args.gpu, config.gpu.name)):
        if typed != name:
            print(f"pagedkv {command}: {flag[2:]}: {name} ({flag} {typed})", file=sys.stderr)


def _tokens_per_request(spec: WorkloadSpec, max_model_len: int) -> float:
    """About how many token ids one request of `spec` holds once built (prompt and output)."""
    if spec.is_trace or spec.source in ("multi-turn", "legal"):
        return float(max_model_len)  # traces and chats never hold more than the context
    if spec.source == "fixed":
        return float(spec.prompt_len + spec.output_len)
    prompt = spec.prompt_lognormal or AZURE_CONV_PROMPT_LOGNORMAL
    output = spec.output_lognormal or AZURE_CONV_OUTPUT_LOGNORMAL
    mean = [math.exp(min(mu + sigma * sigma / 2, 60.0)) for mu, sigma in (prompt, output)]
    head = spec.system_prompt_len if spec.source == "shared-prefix" else 0
    return head + min(mean[0], MAX_TOKENS) + min(mean[1], MAX_TOKENS)


def check_workload(spec: WorkloadSpec, max_model_len: int) -> None:
    """Refuse, before building it, a workload no request of which fits `max_model_len`, or one that would
    not fit this machine's memory (token ids are 4 bytes; twice that for the copies made while building)."""
    if spec.source == "fixed" and spec.prompt_len >= max_model_len:
        raise InvalidArgumentError(f"--prompt-len {spec.prompt_len} leaves no room in max_model_len {max_model_len}")
    if spec.source == "fixed" and spec.output_len > max_model_len:
        raise InvalidArgumentError(f"--output-len {spec.output_len} exceeds max_model_len {max_model_len}")
    if spec.source in ("shared-prefix", "multi-turn") and spec.system_prompt_len >= max_model_len:
        raise InvalidArgumentError(
            f"--system-prompt-len {spec.system_prompt_len} leaves no room in max_model_len {max_model_len}"
        )
    tokens = spec.num_requests * _tokens_per_request(spec, max_model_len)
    check_fits_memory(
        int(8 * tokens), f"a workload of {spec.num_requests:,} requests", "lower --num-requests or the lengths"
    )


def command_main(
    prog: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """A command as a function (`simulate_main([...])`): parse `argv` (None: the process's) with one-line
    errors, then run it."""
    parser = OneLineParser(prog=prog)
    add_arguments(parser)
    return run(parser.parse_args(list(argv) if argv is not None else None))


def warn_dropped(command: str, workload: Workload, config: SimConfig) -> None:
    """Print `dropped_warning` for `workload` under `config` on stderr, prefixed `pagedkv <command>:`, if any."""
    warning = dropped_warning(
        workload.num_dropped, len(workload.requests) + workload.num_dropped, config.max_model_len,
        config.model.max_model_len,
    )  # fmt: skip
    if warning:
        print(f"pagedkv {command}: {warning}", file=sys.stderr)


def dropped_warning(num_dropped: int, num_total: int, max_model_len: int, model_max_len: int) -> str | None:
    """The stderr warning for requests the workload dropped (prompt >= max_model_len), or None."""
    if not num_dropped:
        return None
    if max_model_len < model_max_len:
        keep = f"raise --max-model-len (up to the model's {model_max_len}) to keep them"
    else:
        keep = "--max-model-len is already the model's context; a --model with a longer context keeps them"
    return (
        f"warning: {num_dropped} of {num_total} requests dropped: their prompt is >= --max-model-len "
        f"{max_model_len} tokens; {keep}"
    )
