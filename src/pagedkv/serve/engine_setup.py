"""`load_engine(args)`: the engine `pagedkv serve` runs, built from its flags, and `EngineFacts`, what its
start-up line says of it. One builder for both places an engine runs: in the server's process
(`--no-engine-process`) and in an engine process of its own (`pagedkv.serve.engine_process`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.engine.cli_args import use_threads
from pagedkv.engine.from_args import config_from_args

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import Engine


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the start-up line says of an engine: its KV pool (`num_blocks` of `block_size` tokens, in
    `kv_budget_bytes`), the model's positions (None: unbounded), the weights phrase
    (`pagedkv.hf.cpu_linear.describe_weights`) and the torch threads of its forward."""

    num_blocks: int
    block_size: int
    kv_budget_bytes: int
    max_positions: int | None
    weights: str
    threads: int


def load_engine(args: argparse.Namespace) -> tuple[Engine, EngineFacts]:
    """Check the source, set the torch threads, load the tokenizer and the weights and build the `Engine` of
    `pagedkv serve`'s flags; with its facts. A bad source or flag raises a `PagedKVError` before the weights
    load."""
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.cpu_linear import describe_weights, resolve_dtype
    from pagedkv.hf.loading import check_source, load_tokenizer, load_weights, set_progress_bars

    config = config_from_args(args)
    source = check_source(args.model)
    set_progress_bars(False)
    threads = use_threads(args.threads)
    tokenizer = load_tokenizer(source)
    model = load_weights(source, dtype=resolve_dtype(args.dtype), tokenizer=tokenizer)
    engine = Engine(model, tokenizer, config)
    facts = EngineFacts(
        num_blocks=int(engine.manager.num_blocks),
        block_size=config.block_size,
        kv_budget_bytes=int(engine.kv_budget_bytes),
        max_positions=engine.spec.max_position_embeddings,
        weights=describe_weights(args.dtype, model.dtype, engine.linear_backend),
        threads=threads,
    )
    return engine, facts
