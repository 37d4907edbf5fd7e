"""`pagedkv generate`: generate text with a real model served by the pagedkv engine (offline, on CPU).

    pagedkv generate "The capital of France is" --max-new-tokens 20
    pagedkv generate --model smollm2 --chat "Write a haiku about pages" --temperature 0.7 --seed 1
    pagedkv generate --prompts-file prompts.jsonl --kv-budget 64MiB --allocator contiguous --json

Prompts come from arguments or `--prompts-file` (one prompt a line, or JSONL objects with a "prompt" and
optionally "id", "max_new_tokens"). `--json` prints one object a line per completion (see
`RequestOutput.as_dict`); otherwise the texts, then a one-line summary on stderr. A progress bar runs on
stderr for batches of 8 prompts or more. A prompt that can never fit the KV budget is reported as
"rejected" with the reason; the others complete.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.core.errors import InvalidArgumentError, PagedKVError

DEFAULT_KV_BUDGET = "64MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (bundled), a local transformers folder or a .gguf file"
    )
    parser.add_argument("--prompts-file", type=Path, help="one prompt a line, or JSONL with a 'prompt' field")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--n", type=int, default=1, help="completions per prompt (share the prompt's KV blocks)"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--kv-budget", help=f"KV cache bytes, e.g. 64MiB (default {DEFAULT_KV_BUDGET})")
    capacity.add_argument("--num-blocks", type=int, help="KV cache size in blocks instead of bytes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--allocator", choices=("paged", "contiguous"), default="paged")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    parser.add_argument("--json", action="store_true", help="one JSON object a line per completion")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_prompts(args: argparse.Namespace) -> list[tuple[str | None, str, int | None]]:
    """(id, prompt, max_new_tokens) for every prompt of the arguments and the file."""
    items: list[tuple[str | None, str, int | None]] = [(None, p, None) for p in args.prompts]
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise InvalidArgumentError(f"--prompts-file {args.prompts_file} does not exist")
        for lineno, line in enumerate(args.prompts_file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InvalidArgumentError(
                        f"{args.prompts_file}:{lineno}: invalid JSON ({err})"
                    ) from None
                if not isinstance(obj.get("prompt"), str):
                    raise InvalidArgumentError(
                        f"{args.prompts_file}:{lineno}: a JSONL line needs a string 'prompt'"
                    )
                limit = obj.get("max_new_tokens")
                items.append((obj.get("id"), obj["prompt"], int(limit) if limit is not None else None))
            else:
                items.append((None, line, None))
    if not items:
        raise InvalidArgumentError("no prompts: pass them as arguments or with --prompts-file")
    return items


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PagedKVError as err:
        print(f"pagedkv generate: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.engine.config import EngineConfig, parse_bytes
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.hf.loading import load_model

    torch.set_num_threads(1)
    items = read_prompts(args)
    base = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig(
        num_blocks=args.num_blocks,
        kv_budget_bytes=None
        if args.num_blocks is not None
        else parse_bytes(args.kv_budget or DEFAULT_KV_BUDGET),
        block_size=args.block_size,
        allocator=args.allocator,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        preemption_mode=args.preemption,
    )
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    engine = Engine(model, tokenizer, config)
    params = [base if limit is None else _with_limit(base, limit) for _, _, limit in items]
    progress = _progress(len(items) * args.n, disabled=args.no_progress or len(items) < 8)
    start = time.perf_counter()
    outputs = engine.generate(
        [p for _, p, _ in items], params, chat=args.chat, on_step=lambda done: progress.update(len(done))
    )
    progress.close()
    wall = time.perf_counter() - start
    prompts_by_id: dict[str, tuple[str | None, str]] = {}
    k = 0
    for out in outputs:
        if out.parent_id is None:
            prompts_by_id[out.request_id] = (items[k][0], items[k][1])
            k += 1
    for out in outputs:
        user_id, prompt = prompts_by_id[out.parent_id or out.request_id]
        if args.json:
            record = out.as_dict(prompt)
            if user_id is not None:
                record["id"] = (
                    user_id if out.parent_id is None else f"{user_id}{out.request_id[len(out.parent_id) :]}"
                )
            print(json.dumps(record), flush=True)
        else:
            tag = f"[{out.request_id}] " if len(outputs) > 1 else ""
            body = out.output_text if out.finish_reason != "rejected" else f"(rejected: {out.error})"
            print(f"{tag}{body}", flush=True)
    num_tokens = sum(len(o.output_token_ids) for o in outputs)
    print(
        f"pagedkv generate: {len(outputs)} completions, {num_tokens} tokens in {wall:.1f}s "
        f"({num_tokens / wall:.1f} tok/s), {engine.manager.num_blocks} KV blocks ({config.allocator}), "
        f"{engine.stats.num_preemptions} preemptions",
        file=sys.stderr,
    )
    return 0 if all(o.finish_reason != "rejected" for o in outputs) else 1


def _with_limit(params: Any, limit: int) -> Any:
    from dataclasses import replace

    return replace(params, max_new_tokens=limit)


def _progress(total: int, *, disabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=disabled, file=sys.stderr, unit="req", desc="generate")
