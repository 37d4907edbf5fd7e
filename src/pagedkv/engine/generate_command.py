"""`pagedkv generate`: generate text with a real model served by the pagedkv engine (offline, on CPU).

    pagedkv generate "The capital of France is" --max-new-tokens 20
    pagedkv generate --model smollm2 --chat "Write a haiku about pages" --temperature 0.7 --seed 1
    pagedkv generate --prompts-file prompts.jsonl --kv-budget 64MiB --allocator contiguous --json

Prompts come from arguments or `--prompts-file` (one prompt a line, or JSONL objects with a "prompt" and
optionally "id", "max_new_tokens"). `--json` prints one object a line per completion (see
`RequestOutput.as_dict`); otherwise the texts, then a one-line summary on stderr. On a terminal one
completion (one prompt, `--n 1`) streams: its text is written as its tokens are produced; several, or piped
output, come whole at the end. A progress bar runs on stderr for batches of 8 prompts or more
(`--no-progress` silences it and transformers' loading bars).

Everything is checked before the weights load: the arguments, the model source (a bad folder or a file that
is not GGUF is one line on stderr, exit code 2), `--max-new-tokens` against the model's context length, and
every prompt's length. A prompt that cannot be served (longer than the model's context, or never fitting
the KV budget) is reported as "rejected" with the reason while the others are served; the summary counts
served and rejected requests separately, and the exit code is 1 when any was rejected.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.engine.cli_args import (
    check_fits_memory,
    existing_file,
    fraction,
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    seed_int,
    token_count,
    use_threads,
)
from pagedkv.engine.from_args import add_engine_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (bundled), a local transformers folder or a .gguf file"
    )
    parser.add_argument(
        "--prompts-file", type=existing_file, help="one prompt a line, or JSONL with a 'prompt' field"
    )
    parser.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="wrap each prompt in the model's chat template (default: on for instruct models with a template)",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=token_count, default=64)
    parser.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=fraction, default=1.0)
    parser.add_argument("--top-k", type=nonnegative_int, default=0, help="0 = off")
    parser.add_argument("--seed", type=seed_int, default=None)
    parser.add_argument(
        "--n", type=int_at_least(1, 1024), default=1, help="completions per prompt (share the prompt's KV blocks)"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(parser)
    tenancy = parser.add_argument_group("tenants (docs/engine.md)")
    tenancy.add_argument(
        "--cache-salt",
        default=None,
        help="isolate this run's prefix cache: requests share cached KV only with requests of the same salt",
    )
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
                        f"{args.prompts_file}:{lineno}: invalid JSON ({err.msg} at column {err.colno})"
                    ) from None
                if not isinstance(obj.get("prompt"), str):
                    raise InvalidArgumentError(
                        f"{args.prompts_file}:{lineno}: a JSONL line needs a string 'prompt'"
                    )
                limit = obj.get("max_new_tokens")
                if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
                    raise InvalidArgumentError(
                        f"{args.prompts_file}:{lineno}: max_new_tokens must be an integer >= 1, got {limit!r}"
                    )
                items.append((obj.get("id"), obj["prompt"], limit))
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
    """Check everything the user typed, then the model source, its config and tokenizer (cheap), reject the
    prompts that cannot fit the model's positions, and only then load the weights and serve the rest."""
    from pagedkv.hf.loading import check_source, load_config, load_tokenizer, set_progress_bars

    # 1. the arguments: prompts, sampling parameters, engine configuration
    items = read_prompts(args)
    params = _sampling_params(args, items)
    config = config_from_args(args)
    # 2. the model source, its context length and tokenizer (no weights yet)
    source = check_source(args.model)
    set_progress_bars(not args.no_progress)
    model_config = load_config(source)
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and args.max_new_tokens >= max_pos:
        raise InvalidArgumentError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's {max_pos} "
            f"positions; use at most {max_pos - 1}"
        )
    _check_block_memory(args, model_config)
    tokenizer = load_tokenizer(source)
    chat = args.chat if args.chat is not None else is_instruct(args.model, tokenizer)
    encoded = [encode_prompt(tokenizer, prompt, chat=chat) for _, prompt, _ in items]
    reasons = [prompt_problem(ids, p.max_new_tokens, max_pos) for ids, p in zip(encoded, params)]
    served = [i for i, why in enumerate(reasons) if why is None]
    if args.kv_budget is not None:  # say back what the size typed resolved to (1gb is 10^9 bytes)
        print(f"pagedkv generate: kv budget: {args.kv_budget / 2**30:.2f} GiB ({args.kv_budget:,} bytes)",
              file=sys.stderr)  # fmt: skip
    one = len(items) == 1 and served == [0] and params[0].n == 1
    stream = _TextStream(sys.stdout, params[0].stop) if one and not args.json and _on_terminal(sys.stdout) else None
    # 3. the weights, then serve the prompts that can be served
    engine, engine_outputs, wall = _load_and_serve(args, source, tokenizer, config, encoded, params, served, stream)
    # 4. the completions in prompt order, rejections included; then the summary
    outputs = _group_outputs(engine_outputs, encoded, reasons, served)
    if stream is not None and outputs[0][1].finish_reason != "rejected":  # rejected by the engine: no tokens
        stream.finish(outputs[0][1].output_text or "")
    else:
        _print_outputs(args, items, outputs)
    rejected = [i for i, out in outputs if out.finish_reason == "rejected" and out.parent_id is None]
    done = [out for _, out in outputs if out.finish_reason != "rejected"]
    num_tokens = sum(len(o.output_token_ids) for o in done)
    print(
        f"pagedkv generate: {len(items) - len(rejected)} requests served ({len(done)} completions, {num_tokens} "
        f"tokens in {wall:.1f}s, {num_tokens / wall if wall > 0 else 0.0:.1f} tok/s), {len(rejected)} rejected; "
        f"{engine.manager.num_blocks} KV blocks ({config.allocator}), {engine.stats.num_preemptions} preemptions; "
        f"{cached_summary(done)}{speculation_summary(engine)}",
        file=sys.stderr,
    )
    return 0 if not rejected else 1


def cached_summary(done: list[Any]) -> str:
    """"cached prompt tokens: 48 (GPU 32, CPU 16, DISK 0)": the prompt tokens not computed, by the medium
    that served them (the device's prefix cache, then the tiers below it, when they are on)."""
    total = sum(o.num_cached_tokens for o in done if o.parent_id is None)
    by_tier: dict[str, int] = {}
    for o in done:
        if o.parent_id is None:
            for medium, n in o.num_cached_tokens_by_tier.items():
                by_tier[medium] = by_tier.get(medium, 0) + n
    detail = ", ".join(f"{m} {n}" for m, n in by_tier.items())
    return f"cached prompt tokens: {total}" + (f" ({detail})" if detail else "")


def speculation_summary(engine: Any) -> str:
    """"; speculation ngram:k=4,...: 120 of 300 draft tokens accepted (0.40), 1.9 tokens per verification", or
    nothing when the engine does not speculate."""
    spec, stats = engine.config.speculative, engine.stats.spec
    if spec is None or stats is None:
        return ""
    return (
        f"; speculation {spec.describe()}: {stats.num_accepted_tokens} of {stats.num_draft_tokens} draft tokens "
        f"accepted ({stats.acceptance_rate:.2f}), {stats.mean_accepted_length:.2f} tokens per verification"
    )


def is_instruct(model: str, tokenizer: Any) -> bool:
    """Whether to use the chat template by default: the tokenizer has one and the model is an instruct or
    chat model (by its name, or the bundled SmolLM2-135M-Instruct)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    name = (model + " " + str(getattr(tokenizer, "name_or_path", ""))).lower()
    return model == "smollm2" or any(word in name for word in ("instruct", "chat", "-it"))


def _check_block_memory(args: argparse.Namespace, model_config: Any) -> None:
    """With `--num-blocks`/`--host-blocks`, the KV bytes they ask for against the machine, before any weight
    loads (a block holds K and V of every layer, in the KV cache dtype: `pagedkv.storage.kv_spec`)."""
    from pagedkv.hf.cpu_linear import resolve_dtype
    from pagedkv.storage.kv_spec import KVCacheSpec, resolve_kv_cache_dtype

    heads = getattr(model_config, "num_attention_heads", 1) or 1
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or getattr(model_config, "hidden_size", heads) // heads
    layers = getattr(model_config, "num_hidden_layers", 1) or 1
    model_dtype = resolve_dtype(args.dtype) or getattr(model_config, "dtype", None) or "float32"
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype)
    per_block = KVCacheSpec(layers, kv_heads, head_dim, kv_dtype, args.kv_scale_scheme).bytes_per_block(args.block_size)
    blocks = (args.num_blocks or 0) + args.host_blocks
    if blocks:
        check_fits_memory(blocks * per_block, f"{blocks:,} KV blocks", "lower --num-blocks or --host-blocks")


def _sampling_params(args: argparse.Namespace, items: list[tuple[str | None, str, int | None]]) -> list[Any]:
    """One `SamplingParams` per prompt: the flags, with a JSONL line's own `max_new_tokens` when it has one."""
    from pagedkv.engine.params import SamplingParams

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
    return [base if limit is None else _with_limit(base, limit) for _, _, limit in items]


def _load_and_serve(
    args: argparse.Namespace,
    source: Any,
    tokenizer: Any,
    config: Any,
    encoded: list[list[int]],
    params: list[Any],
    served: list[int],
    stream: _TextStream | None = None,
) -> tuple[Any, list[Any], float]:
    """Load the weights, build the engine and serve the prompts `served` names: (engine, outputs, wall s);
    `stream` gets every new token's snapshot."""
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.hf.loading import load_weights

    use_threads(args.threads)
    from pagedkv.hf.cpu_linear import resolve_dtype

    model = load_weights(source, dtype=resolve_dtype(args.dtype), tokenizer=tokenizer)
    engine = Engine(model, tokenizer, config)
    total = sum(params[i].n for i in served)
    progress = _progress(total, disabled=args.no_progress or len(served) < 8)
    start = time.perf_counter()
    try:
        for medium, why in engine.tiering.inactive().items() if engine.tiering is not None else ():
            print(f"pagedkv generate: warning: the {medium} tier is inactive: {why}", file=sys.stderr)
        engine_outputs = _serve(engine, encoded, params, served, progress, args.cache_salt, stream)
    finally:
        engine.close()  # the disk tier's file and the remote store's connections
    progress.close()
    return engine, engine_outputs, time.perf_counter() - start


def _group_outputs(
    engine_outputs: list[Any], encoded: list[list[int]], reasons: list[str | None], served: list[int]
) -> list[tuple[int, Any]]:
    """(prompt index, output) in prompt order: per prompt, the engine's (parent first, then its children,
    renamed `req-<prompt index>[suffix]`) or one "rejected" output."""
    from pagedkv.engine.outputs import RequestOutput

    groups: dict[int, list[Any]] = {
        i: [RequestOutput(f"req-{i}", encoded[i], [], "", True, "rejected", reasons[i])]
        for i, why in enumerate(reasons)
        if why is not None
    }
    k = -1
    engine_parent = ""
    for out in engine_outputs:
        if out.parent_id is None:
            k += 1
            engine_parent = out.request_id
            groups[served[k]] = []
        suffix = out.request_id[len(engine_parent) :]
        parent = f"req-{served[k]}"
        groups[served[k]].append(
            replace(out, request_id=parent + suffix, parent_id=parent if suffix else None)
        )
    return [(i, out) for i in sorted(groups) for out in groups[i]]


def _print_outputs(
    args: argparse.Namespace, items: list[tuple[str | None, str, int | None]], outputs: list[tuple[int, Any]]
) -> None:
    """One JSON object a line (`--json`, the user's own ids kept) or the texts, tagged when there are several."""
    for i, out in outputs:
        user_id, prompt = items[i][0], items[i][1]
        if args.json:
            record = out.as_dict(prompt)
            if user_id is not None:
                record["id"] = user_id + out.request_id[len(f"req-{i}") :]
            print(json.dumps(record), flush=True)
        else:
            tag = f"[{out.request_id}] " if len(outputs) > 1 else ""
            body = out.output_text if out.finish_reason != "rejected" else f"(rejected: {out.error})"
            print(f"{tag}{body}", flush=True)


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    """The prompt's token ids, the way the engine encodes text (the chat template when `chat`)."""
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def prompt_problem(ids: list[int], max_new_tokens: int, max_positions: int | None) -> str | None:
    """Why this request cannot be served by the model at all (its length), or None. KV-budget rejections
    come from the engine, which knows the cache's size."""
    if not ids:
        return "empty prompt"
    if max_positions is not None and len(ids) + max_new_tokens > max_positions:
        return (
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} exceeds "
            f"the model's {max_positions} positions; shorten the prompt or lower --max-new-tokens"
        )
    return None


def _with_limit(params: Any, limit: int) -> Any:
    return replace(params, max_new_tokens=limit)


def _progress(total: int, *, disabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=disabled, file=sys.stderr, unit="req", desc="generate")


def _serve(
    engine: Any,
    encoded: list[list[int]],
    params: list[Any],
    served: list[int],
    progress: Any,
    cache_salt: str | None,
    stream: _TextStream | None = None,
) -> list[Any]:
    if not served:
        return []
    return list(
        engine.generate(
            [encoded[i] for i in served],
            [params[i] for i in served],
            on_step=lambda done: progress.update(len(done)),
            cache_salt=cache_salt,
            on_token=stream,
        )
    )


def _on_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _TextStream:
    """One completion's text written to `out` as it grows (an engine `on_token` callback), then `finish`.

    The text of a snapshot can still change at its end: an incomplete UTF-8 sequence decodes to U+FFFD
    until its last byte arrives, and the start of a stop string is cut once the string completes. So the
    last `len(longest stop) - 1` characters and a trailing U+FFFD wait for the next token; `finish` writes
    what the final text has beyond what was written (or, should they differ, the final text on a new line)."""

    def __init__(self, out: Any, stop: tuple[str, ...]) -> None:
        self.out = out
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.written = ""

    def __call__(self, snapshot: Any) -> None:
        text = snapshot.output_text or ""
        safe = text[: len(text) - self.holdback].rstrip("\ufffd")
        if len(safe) > len(self.written) and safe.startswith(self.written):
            self.out.write(safe[len(self.written) :])
            self.out.flush()
            self.written = safe

    def finish(self, final: str) -> None:
        rest = final[len(self.written) :] if final.startswith(self.written) else "\n" + final
        self.out.write(rest + "\n")
        self.out.flush()
