"""The engine's command-line flags and the one `EngineConfig` they describe.

`pagedkv generate`, `pagedkv serve` (one process, or `--replicas N`, whose driver builds the config once and
hands it to every replica) and the server benchmark declare the engine flags with `add_engine_arguments` and
turn them into a config with `config_from_args`: one set of names, defaults and validation for every entry
point. The flag types and the scheduler's flags are `pagedkv.engine.cli_args`'.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pagedkv.engine.cli_args import (
    add_block_size,
    add_kv_cache_dtype,
    add_linear_backend,
    add_scheduler_arguments,
    add_speculative,
    add_threads,
    byte_size,
    check_fits_memory,
    int_at_least,
    scheduler_from,
    writable_folder,
)
from pagedkv.engine.managers import MANAGER_KINDS

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig

DEFAULT_KV_BUDGET = "64MiB"
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_HELP = (
    "model dtype (default: auto, bfloat16 where the CPU has bf16 matrix instructions (AVX512-BF16, AMX), "
    "else the checkpoint's)"
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, in two groups: the engine (KV pool, allocator, scheduler, dtypes, threads, linear
    backend, speculation) and the KV tiers below the device."""
    engine = parser.add_argument_group("engine")
    capacity = engine.add_mutually_exclusive_group()
    capacity.add_argument(
        "--kv-budget", type=byte_size, help=f"KV cache bytes, e.g. 64MiB or 2GB (default {DEFAULT_KV_BUDGET})"
    )
    capacity.add_argument(
        "--num-blocks", type=int_at_least(2, 1 << 28), help="KV cache size in blocks instead of bytes"
    )
    add_block_size(engine)
    engine.add_argument("--allocator", choices=MANAGER_KINDS, default="paged")
    engine.add_argument("--no-prefix-caching", action="store_true")
    add_scheduler_arguments(engine, preemption=True)  # the engine's own defaults
    engine.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    add_kv_cache_dtype(engine)
    add_threads(engine)
    add_linear_backend(engine)
    add_speculative(engine)
    tiers = parser.add_argument_group("KV tiers below the device (docs/tiers.md)")
    tiers.add_argument(
        "--host-blocks", type=int_at_least(0, 1 << 28), default=0, help="host-RAM tier size in blocks (0 = off)"
    )
    tiers.add_argument("--disk-path", type=writable_folder, default=None, help="folder of the local disk tier")
    tiers.add_argument(
        "--disk-bytes", type=byte_size, default=None, help="disk tier size, e.g. 64GiB (needs --disk-path)"
    )
    tiers.add_argument("--remote-url", default=None, help="shared store: redis://HOST:PORT/DB or unix:///PATH")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the flags of `add_engine_arguments` describe (validated by its constructor; a KV
    budget larger than this machine's memory is refused here)."""
    from pagedkv.engine.config import EngineConfig, parse_bytes

    budget = None if args.num_blocks is not None else args.kv_budget or parse_bytes(DEFAULT_KV_BUDGET)
    if budget is not None:
        check_fits_memory(budget, "the KV cache (--kv-budget)", "lower --kv-budget")
    return EngineConfig(
        num_blocks=args.num_blocks,
        kv_budget_bytes=budget,
        block_size=args.block_size,
        allocator=args.allocator,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduler=scheduler_from(args),
        host_blocks=args.host_blocks,
        disk_path=args.disk_path,
        disk_bytes=0 if args.disk_bytes is None else args.disk_bytes,
        remote_url=args.remote_url,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_scale_scheme=args.kv_scale_scheme,
        linear_backend=args.linear_backend,
        speculative=args.speculative,
    )
