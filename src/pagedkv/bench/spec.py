"""`pagedkv bench spec`: the engine with and without speculative decoding, side by side in one run.

Same model, same requests, same KV budget and scheduler; the only difference is `--speculative` (default
`ngram:k=4`). Two workloads:

- `grounded` (input-grounded: the output copies spans of the prompt). Real English text: the first
  paragraphs (>= 200 characters) of the docstrings of Python standard-library modules (`GROUNDED_MODULES`,
  present wherever Python is), one passage per request, in the chat template (as plain text where the
  tokenizer has none): "Here is a passage: ... Repeat the passage above exactly, word for word." Greedy;
  each request stops at EOS or at the passage's token length + 16. Copying and quoting (editing code,
  answering from a document, summarising with quotes) is where prompt lookup pays.
- `conversation`: the Azure conversation slice the other benchmarks use (`bench e2e`'s workload: trace
  rows from `--trace-offset`, prompt and output lengths scaled by `--prompt-scale` / `--output-scale`,
  seeded random prompt ids), greedy, EOS ignored, each request stopped at its trace length.

Batch sizes (`--batches`, default `1,4,saturated`): at most that many requests run at once
(`max_num_seqs`), all arriving at t=0; `saturated` lets every request run at once.

For every (workload, batch) the two systems run `--repeat` times, interleaved (plain, spec, spec, plain,
...), so a slow spell of a shared machine falls on both; figures are the median run's, and
`ratio` is the median (and range) of the per-pair tokens/s ratios spec / plain. Per system: output
tokens/s, TTFT and TPOT p50, steps; with speculation the acceptance rate, the rate per draft position and
the mean accepted length (tokens per verification). `identical` says whether both produced the same
tokens (greedy: they must).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.engine.cli_args import (
    add_block_size,
    add_threads,
    int_at_least,
    positive_int,
    seed_int,
    use_threads,
)
from pagedkv.percentiles import percentile

GROUNDED_MODULES = (
    "json", "argparse", "csv", "logging", "pickle", "sqlite3", "subprocess", "threading", "heapq", "bisect",
    "textwrap", "difflib", "unittest", "doctest", "tarfile", "zipfile", "shutil", "tempfile", "string", "re",
)  # fmt: skip
WORKLOADS = ("grounded", "conversation")


@dataclass(frozen=True, slots=True)
class SpecRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool


def passages(num: int, min_chars: int = 200, max_chars: int = 900) -> list[str]:
    """Up to `num` real-text passages: the first docstring paragraph of at least `min_chars` characters of
    each module in `GROUNDED_MODULES` (cut at a sentence end before `max_chars`)."""
    out: list[str] = []
    for name in GROUNDED_MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:
            continue
        for para in doc.split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= min_chars and not text.startswith((">>>", "-", "*")):
                if len(text) > max_chars:
                    text = text[: text.rfind(". ", 0, max_chars) + 1] or text[:max_chars]
                out.append(text)
                break
        if len(out) == num:
            break
    return out


def grounded_workload(tokenizer: Any, num: int) -> list[SpecRequest]:
    """One request per passage: the instruction in the tokenizer's chat template (the plain message where
    it has none: a base model), stopped at the passage's token length + 16."""
    out = []
    for i, text in enumerate(passages(num)):
        message = f"Here is a passage:\n\n{text}\n\nRepeat the passage above exactly, word for word."
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                tokenize=True)  # fmt: skip
        else:
            ids = tokenizer(message)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(SpecRequest(f"g{i}", ids, len(tokenizer(text)["input_ids"]) + 16, False))
    return out


def conversation_workload(args: argparse.Namespace, vocab_size: int) -> list[SpecRequest]:
    from pagedkv.bench.e2e import build_workload

    rows = build_workload(args.num_requests, args.prompt_scale, args.output_scale, vocab_size, args.seed,
                          args.trace_offset)  # fmt: skip
    return [SpecRequest(r.request_id, r.prompt_token_ids, r.output_len, True) for r in rows]


def run_once(model: Any, workload: Sequence[SpecRequest], batch: int, spec: Any, args: argparse.Namespace
             ) -> dict[str, Any]:  # fmt: skip
    """One system on one workload: figures and output ids."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.scheduler import SchedulerConfig

    config = EngineConfig(
        num_blocks=args.num_blocks, block_size=args.block_size, speculative=spec,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=args.max_num_batched_tokens),
    )  # fmt: skip
    engine = Engine(model, None, config)
    times: dict[str, list[float]] = {r.request_id: [] for r in workload}
    t0 = time.perf_counter()

    def on_token(out: Any) -> None:
        stamp = time.perf_counter() - t0
        got = times[out.request_id]
        got.extend([stamp] * (len(out.output_token_ids) - len(got)))

    for r in workload:
        params = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos)
        engine.add_request(r.prompt_token_ids, params, request_id=r.request_id, arrival_time=t0, on_token=on_token)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = list(out.output_token_ids)
    wall = time.perf_counter() - t0
    ttft = [t[0] for t in times.values() if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    tokens = sum(len(o) for o in outputs.values())
    figure: dict[str, Any] = {
        "tokens_per_s": tokens / wall, "output_tokens": tokens, "wall_s": wall, "num_steps": engine.stats.num_steps,
        "ttft_p50_s": percentile(ttft, 50), "tpot_p50_s": percentile(tpot, 50),
    }  # fmt: skip
    if engine.stats.spec is not None:
        figure.update(engine.stats.spec.as_dict())
    return {"figure": figure, "outputs": outputs}


def compare(model: Any, workload: list[SpecRequest], batch: int, spec: Any, args: argparse.Namespace,
            label: str) -> dict[str, Any]:  # fmt: skip
    """Both systems, `--repeat` interleaved pairs (the order alternates), on one workload and batch size."""
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
    outputs: dict[str, dict[str, list[int]]] = {}
    for i in range(args.repeat):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        for system in order:
            got = run_once(model, workload, batch, spec if system == "spec" else None, args)
            runs[system].append(got["figure"])
            outputs.setdefault(system, got["outputs"])
            print(f"[bench spec] {label} {system} run {i + 1}/{args.repeat}: "
                  f"{got['figure']['tokens_per_s']:.1f} tok/s", file=sys.stderr)  # fmt: skip
    ratios = [s["tokens_per_s"] / p["tokens_per_s"] for p, s in zip(runs["plain"], runs["spec"])]
    return {
        "plain": _median(runs["plain"]), "spec": _median(runs["spec"]),
        "ratio": float(np.median(ratios)), "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
        "identical": outputs["plain"] == outputs["spec"],
    }  # fmt: skip


def _median(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda f: f["tokens_per_s"])
    figure = dict(ordered[(len(ordered) - 1) // 2])
    figure["runs_tokens_per_s"] = [f["tokens_per_s"] for f in runs]
    return figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, a local transformers folder or a .gguf file")
    add_threads(parser)
    parser.add_argument("--speculative", default="ngram:k=4", help="ngram:k=4 (min=, max=, off_above=, budget=0|1) or draft:MODEL,k=3")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of grounded, conversation")
    parser.add_argument("--batches", default="1,4,saturated", help="comma-separated batch sizes (ints or saturated)")
    parser.add_argument("--num-grounded", type=int_at_least(1, len(GROUNDED_MODULES)), default=8,
                        help="grounded requests (one passage each)")  # fmt: skip
    parser.add_argument("--num-requests", type=int_at_least(1, 10_000), default=16, help="conversation requests")
    parser.add_argument("--trace-offset", type=int_at_least(0, 10_000), default=0)
    parser.add_argument("--prompt-scale", type=positive_int, default=16, help="prompt len = ContextTokens // this")
    parser.add_argument("--output-scale", type=positive_int, default=4, help="output len = GeneratedTokens // this")
    parser.add_argument("--num-blocks", type=int_at_least(2, 1 << 24), default=1024)
    add_block_size(parser)
    parser.add_argument("--max-num-batched-tokens", type=int_at_least(1, 1 << 20), default=256)
    parser.add_argument("--repeat", type=int_at_least(1, 1000), default=2, help="interleaved pairs per cell")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _batches(text: str, saturated: int) -> list[tuple[str, int]]:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "saturated":
            out.append((part, max(saturated, 1)))
        elif part.isdigit() and int(part) >= 1:
            out.append((part, int(part)))
        else:
            raise argparse.ArgumentTypeError(f"--batches: {part!r} is neither an int >= 1 nor saturated")
    return out


def run(args: argparse.Namespace) -> int:
    from pagedkv.bench.e2e import warm_up
    from pagedkv.core.errors import InvalidArgumentError
    from pagedkv.engine.speculative import parse_speculative
    from pagedkv.hf.loading import load_model

    args.threads = use_threads(args.threads)
    try:
        spec = parse_speculative(args.speculative)
        workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        if not workloads or any(w not in WORKLOADS for w in workloads):
            raise InvalidArgumentError(f"--workloads: pick from {', '.join(WORKLOADS)}, got {args.workloads!r}")
        _batches(args.batches, 0)  # checked before the model loads
    except (InvalidArgumentError, argparse.ArgumentTypeError) as e:
        print(f"pagedkv bench spec: error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model)
    warm_up(model, args.max_num_batched_tokens)
    cells: dict[str, dict[str, Any]] = {}
    for name in workloads:
        workload = (grounded_workload(tokenizer, args.num_grounded) if name == "grounded"
                    else conversation_workload(args, model.config.vocab_size))  # fmt: skip
        for label, batch in _batches(args.batches, len(workload)):
            cells[f"{name}/{label}"] = compare(model, workload, batch, spec, args, f"{name}/{label}")
    result = {"speculative": spec.describe(), "model": args.model, "threads": args.threads,
              "repeat": args.repeat, "cells": cells}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"pagedkv bench spec: {spec.describe()} vs none, model {args.model}, {args.threads} thread(s), "
          f"{args.repeat} interleaved pair(s) per cell")  # fmt: skip
    head = f"{'workload/batch':24} {'tok/s plain':>11} {'tok/s spec':>10} {'ratio (range)':>20} {'TTFT p50':>17} "
    print(head + f"{'TPOT p50 ms':>15} {'accept':>7} {'mean len':>8} identical")
    for key, c in cells.items():
        p, s = c["plain"], c["spec"]
        print(f"{key:24} {p['tokens_per_s']:11.1f} {s['tokens_per_s']:10.1f} "
              f"{c['ratio']:6.2f}x ({c['ratio_min']:.2f}-{c['ratio_max']:.2f}) "
              f"{p['ttft_p50_s'] * 1e3:7.0f}/{s['ttft_p50_s'] * 1e3:<7.0f}ms "
              f"{p['tpot_p50_s'] * 1e3:6.1f}/{s['tpot_p50_s'] * 1e3:<6.1f}   "
              f"{s.get('acceptance_rate', 0.0):6.0%} {s.get('mean_accepted_length', 0.0):8.2f} {c['identical']}")  # fmt: skip
    return 0
