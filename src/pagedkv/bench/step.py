"""`pagedkv bench step`: where one engine step's time goes, and what a step costs before it computes anything.

For each batch size B it builds an engine over the model, admits B requests of `--prompt-len` tokens, runs
them until every one decodes, and then times `--steps` decode steps twice:

1. plain: `Engine.step()` untouched; the median is the step's time at B tokens. A least-squares line over the
   batch sizes gives `fixed_ms + per_token_ms * B`: the fixed cost is what a step costs at zero tokens.
2. instrumented: the same steps with timers around each phase (the engine's own objects wrapped, nothing
   else changed): `schedule` (the scheduler), `metadata` (block moves, block tables, slot mapping, the packed
   batch), `forward` split into `linear` (every projection, the lm_head included), `attention` (the paged
   attention function: KV write and attention, all layers) and `other` (embedding, norms, rotary, residuals,
   activations: everything else of the forward), `sampling`, `update` (the scheduler's bookkeeping) and `rest`
   (stop strings, statistics, outputs). Timers cost a few microseconds each, so these steps run a little slower
   than the plain ones; the split is what to read from them.

`linear` at B = 1 is mostly the time to read every weight once from memory (the weights do not fit in the
caches); it shrinks with fewer bytes per weight (`--dtype bfloat16`) and more memory bandwidth (`--threads`).
`fixed - linear(B=1)` is the overhead the step adds around the model's arithmetic (Python, dispatch, metadata,
sampling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedkv.engine.cli_args import add_threads, int_at_least, use_threads

PHASES = ("schedule", "metadata", "linear", "attention", "other", "sampling", "update", "rest")
DEFAULT_BATCHES = (1, 4, 16, 64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, a folder, a .gguf, or tiny:FAMILY")
    parser.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="float32",
        help="model dtype (auto: bfloat16 where the CPU has bf16 matrix instructions)",
    )  # fmt: skip
    parser.add_argument(
        "--linear-backend", choices=("auto", "onednn", "torch"), default="auto",
        help="the projections' implementation (pagedkv.hf.cpu_linear)",
    )  # fmt: skip
    parser.add_argument(
        "--model-forward", choices=("auto", "fused", "transformers"), default="auto",
        help="the forward: fused (Llama-structured models, pagedkv.hf.fused_llama) or transformers' modules",
    )  # fmt: skip
    add_threads(parser)
    parser.add_argument(
        "--batch-sizes", type=_sizes, default=list(DEFAULT_BATCHES), help="comma-separated decode batch sizes"
    )
    parser.add_argument("--prompt-len", type=int_at_least(1, 4096), default=64, help="tokens per prompt")
    parser.add_argument("--steps", type=int_at_least(3, 10_000), default=20, help="timed decode steps per batch size")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _sizes(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or max(values) > 1024:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes in [1, 1024], got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    threads = use_threads(args.threads)
    model, dtype_name = _load(args.model, args.dtype)
    rows = []
    for b in args.batch_sizes:
        print(f"bench step: batch {b} ...", file=sys.stderr, flush=True)
        rows.append(measure(model, b, args.prompt_len, args.steps, args.linear_backend, args.model_forward))
    fixed, per_token = fit(rows)
    result = {
        "model": args.model,
        "dtype": dtype_name,
        "torch_threads": threads,
        "linear_backend": rows[0]["linear_backend"],
        "model_forward": rows[0]["model_forward"],
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "fixed_ms": fixed,
        "per_token_ms": per_token,
        "overhead_ms": fixed - rows[0]["phases_ms"]["linear"] if rows and rows[0]["batch"] == 1 else None,
        "batches": rows,
    }
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


def _load(name: str, dtype: str) -> tuple[Any, str]:
    import torch

    from pagedkv.hf.cpu_linear import resolve_dtype

    resolved = resolve_dtype(dtype)
    if name.startswith("tiny:"):
        from pagedkv.hf.tiny import tiny_model

        model = tiny_model(name.removeprefix("tiny:"))
        if resolved is not None:
            model = model.to(getattr(torch, resolved))
    else:
        from pagedkv.hf.loading import load_model

        model = load_model(name, dtype=resolved, progress=False)[0]
    return model, str(next(model.parameters()).dtype).removeprefix("torch.")


def measure(
    model: Any, batch: int, prompt_len: int, steps: int, linear_backend: str = "auto", model_forward: str = "auto"
) -> dict[str, Any]:
    """One batch size: plain step times, then instrumented phase times (see the module docstring)."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.scheduler import SchedulerConfig

    block = 16
    per_request = -(-(prompt_len + 2 * steps + 8) // block)
    config = EngineConfig(
        num_blocks=batch * per_request + 2, block_size=block, linear_backend=linear_backend,  # type: ignore[arg-type]
        model_forward=model_forward,  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, prompt_len)),
    )  # fmt: skip
    engine = Engine(model, None, config)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=2 * steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(3, vocab, size=prompt_len).tolist(), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in _requests(engine)) or engine.scheduler.num_waiting:
        engine.step()
    engine.step()  # one decode step to warm up
    plain = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
    timers, undo = _instrument(engine)
    totals = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - t)
    finally:
        undo()
    total_ms = 1e3 * sum(totals) / steps
    phases = {name: 1e3 * timers[name] / steps for name in PHASES if name not in ("other", "rest")}
    phases["other"] = 1e3 * timers["forward"] / steps - phases["linear"] - phases["attention"]
    phases["rest"] = total_ms - sum(phases.values())
    engine.close()
    return {
        "batch": batch,
        "linear_backend": engine.linear_backend,
        "model_forward": "fused" if engine.runner.fused is not None else "transformers",
        "step_ms": 1e3 * statistics.median(plain),
        "step_ms_min": 1e3 * min(plain),
        "instrumented_step_ms": total_ms,
        "phases_ms": {name: phases[name] for name in PHASES},
    }


def _requests(engine: Any) -> list[Any]:
    return list(engine.scheduler.running)


def _instrument(engine: Any) -> tuple[dict[str, float], Callable[[], None]]:
    """Wrap the step's phases with timers; return the accumulated seconds and an undo."""

    import torch
    from transformers import AttentionInterface

    from pagedkv.hf.attention import ATTENTION_NAME, paged_attention_forward
    from pagedkv.hf.cpu_linear import PackedLinear

    timers: dict[str, float] = defaultdict(float)
    undo: list[Callable[[], None]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t

        return wrapper

    def patch(obj: Any, attr: str, name: str) -> None:
        original, had = getattr(obj, attr), attr in vars(obj)
        setattr(obj, attr, timed(name, original))
        undo.append(lambda: setattr(obj, attr, original) if had else delattr(obj, attr))

    patch(engine.scheduler, "schedule", "schedule")
    patch(engine.scheduler, "update", "update")
    patch(engine.runner, "apply_block_moves", "metadata")
    patch(engine.runner, "build_batches", "metadata")
    patch(engine, "_sample", "sampling")
    patch(engine.runner, "forward", "forward")
    fused = engine.runner.fused
    if fused is not None:  # the fused forward's own attention calls and GEMMs
        undo.append(_time_fused(fused, timed))
    else:
        AttentionInterface.register(ATTENTION_NAME, timed("attention", paged_attention_forward))
        undo.append(lambda: AttentionInterface.register(ATTENTION_NAME, paged_attention_forward))
        for module in engine.model.modules():
            if isinstance(module, torch.nn.Linear | PackedLinear):
                patch(module, "forward", "linear")
    def undo_all() -> None:
        for u in reversed(undo):
            u()

    return timers, undo_all


def _time_fused(fused: Any, timed: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Timers around a `FusedLlama`'s attention calls and GEMMs; returns the undo."""
    import dataclasses

    from pagedkv.hf import fused_llama

    attend = fused_llama.attend_layer
    fused_llama.attend_layer = timed("attention", attend)  # type: ignore[assignment]
    layers, lm_head = fused.layers, fused.lm_head
    fused.layers = [
        dataclasses.replace(x, **{n: timed("linear", getattr(x, n)) for n in ("qkv", "o", "gate_up", "down")})
        for x in layers
    ]
    fused.lm_head = timed("linear", lm_head)

    def restore() -> None:
        fused_llama.attend_layer = attend  # type: ignore[assignment]
        fused.layers, fused.lm_head = layers, lm_head

    return restore


def fit(rows: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Least squares `step_ms = fixed + per_token * batch` over the rows (None with fewer than 2 sizes)."""
    if len({r["batch"] for r in rows}) < 2:
        return None, None
    x = np.array([r["batch"] for r in rows], dtype=float)
    y = np.array([r["step_ms"] for r in rows], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def render(result: dict[str, Any]) -> str:
    head = (
        f"bench step: {result['model']} {result['dtype']}, {result['torch_threads']} torch thread(s), "
        f"{result['linear_backend']} linear, {result['model_forward']} forward, prompts of {result['prompt_len']} tokens, {result['steps']} decode steps"
    )
    cols = ["batch", "step ms", *PHASES]
    lines = [head, "", " | ".join(cols), " | ".join("---" for _ in cols)]
    for r in result["batches"]:
        p = r["phases_ms"]
        lines.append(" | ".join([str(r["batch"]), f"{r['step_ms']:.1f}", *(f"{p[n]:.1f}" for n in PHASES)]))
    lines.append("")
    lines.append("phases: ms per step of the instrumented steps (timers add a little); step ms: median of plain steps")
    if result["fixed_ms"] is not None:
        lines.append(
            f"fit over batch sizes: step = {result['fixed_ms']:.1f} ms + {result['per_token_ms']:.2f} ms per token"
        )
    if result["overhead_ms"] is not None:
        lines.append(
            f"fixed cost less the linear layers at batch 1 (weight reads): {result['overhead_ms']:.1f} ms of overhead"
        )
    return "\n".join(lines)
