"""`pagedkv bench kv-dtype`: every KV cache dtype side by side in one run: accuracy, capacity, attention speed.

For each `--kv-cache-dtypes` entry (default: auto, bf16, int8, int8/block, fp8_e4m3, fp8_e4m3/block, fp8_e5m2,
fp8_e5m2/block; "auto" is the model's float32, the baseline every difference is taken against; `dtype/block`
is a quantized dtype with one scale per block and KV head, `--kv-scale-scheme block`, the others per token):

- accuracy, on a real model (SmolLM2-135M by default) over real text (`--text-file`, several thousand
  tokens): the text goes through the engine as one prompt in chunks of `--chunk` tokens with
  `prompt_logprobs`, so every token after the first is scored against KV read back from the pages (the
  quantized path: codes and scales). Reported: mean and max |logprob - baseline's| per token, perplexity
  and its change, and greedy agreement on `--prompts` windows of the text (`--max-new-tokens` tokens each):
  the share of generated tokens equal to the baseline's before the first difference, and how many
  completions are identical;
- capacity at one budget: `pagedkv plan` (`--plan-model` on `--plan-gpu`, max concurrent requests with the
  paged allocator by memory), `pagedkv simulate` (peak and mean concurrency, preemptions and tokens/s on the
  same model and GPU under a burst of Poisson arrivals at `--sim-rate` that fills the KV cache), and the
  CPU engine: sequences of `--request-tokens` tokens its allocator admits, one after another, into a
  `--budget` KV cache of the real model (the blocks that budget buys in that dtype);
- speed: one decode attention call (`--batch` sequences, the model's heads, one layer) at each of
  `--contexts` tokens through the path the engine takes on a one-thread CPU: float32 pages and quantized
  pages through the C kernel (`pagedkv.ops.cpu_decode`), bf16 pages with a bf16 query through the entry a
  bf16 model uses (`pagedkv.hf.sdpa.paged_sdpa`: the C kernel where it is built, else the SDPA gather); the
  median of `--repeat` calls, the dtypes' calls interleaved (one call of each dtype in turn), in CPU time of the calling thread (`time.thread_time`: on a shared machine the
  time the thread is descheduled does not count; one torch thread, so the calls do all their work on it).

Timings are taken on whatever machine runs this, with whatever else it runs: say which when quoting them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.cli_args import byte_size, int_at_least, positive_int, use_threads
from pagedkv.storage.kv_spec import KV_CACHE_DTYPES, check_kv_scale_scheme

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
DEFAULT_DTYPES = ("auto", "bf16", "int8", "int8/block", "fp8_e4m3", "fp8_e4m3/block", "fp8_e5m2", "fp8_e5m2/block")
BLOCK_SIZE = 16


def kv_choice(entry: str) -> tuple[str, str]:
    """(kv_cache_dtype, kv_scale_scheme) of a `--kv-cache-dtypes` entry: `dtype` or `dtype/scheme`."""
    dtype, _, scheme = entry.partition("/")
    return dtype, scheme or "token"


def _dtype_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if kv_choice(n)[0] not in KV_CACHE_DTYPES]
    for name in names:
        try:
            check_kv_scale_scheme(kv_choice(name)[1], kv_choice(name)[0])
        except InvalidArgumentError:
            bad.append(name)
    if not names or bad or names[0] != "auto" or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of {', '.join(KV_CACHE_DTYPES)} (a quantized one may end in /block: "
            "one scale per block), starting with auto (the baseline)"
        )
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive token counts")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, a local transformers folder or a .gguf file"
    )
    parser.add_argument(
        "--text-file",
        type=Path,
        default=Path(DEFAULT_TEXT),
        help=f"real text to score (default: {DEFAULT_TEXT})",
    )
    parser.add_argument("--kv-cache-dtypes", type=_dtype_list, default=list(DEFAULT_DTYPES),
                        help="comma-separated, auto first (the baseline): " + ",".join(DEFAULT_DTYPES))  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int_at_least(64, 1 << 16), default=4096, help="text tokens scored (default 4096)"
    )
    parser.add_argument(
        "--chunk", type=int_at_least(16, 1 << 16), default=512, help="prefill chunk in tokens (default 512)"
    )
    parser.add_argument(
        "--prompts", type=int_at_least(1, 256), default=16, help="greedy prompts from the text (default 16)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int_at_least(8, 4096),
        default=128,
        help="tokens per greedy prompt (default 128)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int_at_least(1, 1024),
        default=32,
        help="greedy tokens per prompt (default 32)",
    )
    _add_capacity_and_speed_arguments(parser)


def _add_capacity_and_speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget", type=byte_size, default=512 << 20, help="the CPU engine's KV budget (default 512MiB)"
    )
    parser.add_argument("--request-tokens", type=int_at_least(1, 1 << 20), default=1024,
                        help="tokens per request the CPU engine admits (default 1024)")  # fmt: skip
    parser.add_argument(
        "--plan-model", default="llama-3-8b", help="model of plan/simulate (default llama-3-8b)"
    )
    parser.add_argument("--plan-gpu", default="a100-40gb", help="GPU of plan/simulate (default a100-40gb)")
    parser.add_argument("--plan-requests", type=int_at_least(10, 100_000), default=300,
                        help="trace requests of plan/simulate (default 300)")  # fmt: skip
    parser.add_argument("--sim-rate", type=positive_int, default=100,
                        help="simulate's Poisson arrivals, requests/s: a burst that fills the KV cache (default 100)")  # fmt: skip
    parser.add_argument("--contexts", type=_int_list, default=[2048, 4096, 8192, 16384],
                        help="context lengths of the attention timing (default 2048,4096,8192,16384)")  # fmt: skip
    parser.add_argument(
        "--batch", type=positive_int, default=4, help="sequences per attention call (default 4)"
    )
    parser.add_argument(
        "--repeat", type=int_at_least(1, 1000), default=7, help="timed calls per point (default 7)"
    )
    parser.add_argument(
        "--parts", default="accuracy,capacity,speed", help="which parts to run (default: all three)"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads (default 1: the C decode kernel runs on one)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def run(args: argparse.Namespace) -> int:
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"accuracy", "capacity", "speed"}:
        print("pagedkv bench kv-dtype: --parts takes accuracy,capacity,speed", file=sys.stderr)
        return 2
    if "accuracy" in parts and not args.text_file.is_file():
        print(
            f"pagedkv bench kv-dtype: --text-file {args.text_file} not found; pass a text file",
            file=sys.stderr,
        )
        return 2
    args.threads = use_threads(args.threads)
    from pagedkv.hf.loading import load_model

    model, tokenizer = load_model(args.model, dtype="float32", progress=False)
    result: dict[str, Any] = {
        "model": args.model,
        "torch_threads": args.threads,
        "dtypes": args.kv_cache_dtypes,
    }
    if "accuracy" in parts:
        result["accuracy"] = accuracy(model, tokenizer, args)
    if "capacity" in parts:
        result["capacity"] = capacity(model, args)
    if "speed" in parts:
        result["speed"] = speed(model, args)
    print(json.dumps(result, indent=2) if args.json else text(result))
    return 0


# --- accuracy --------------------------------------------------------------------------------------------


def _engine(model: Any, entry: str, num_blocks: int, chunk: int) -> Any:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.scheduler import SchedulerConfig

    dtype, scheme = kv_choice(entry)
    scheduler = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=256)
    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, kv_cache_dtype=dtype, kv_scale_scheme=scheme,
                          enable_prefix_caching=False, scheduler=scheduler)  # fmt: skip
    return Engine(model, None, config)  # token ids in and out: no text


def accuracy(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Per-token logprobs, perplexity and greedy agreement of every dtype against the first (auto)."""
    import numpy as np

    from pagedkv.engine.params import SamplingParams

    ids = tokenizer(args.text_file.read_text(encoding="utf-8"))["input_ids"][: args.max_tokens]
    step = max(1, (len(ids) - args.prompt_tokens) // args.prompts)
    prompts = [ids[i * step : i * step + args.prompt_tokens] for i in range(args.prompts)]
    num_blocks = (
        2
        + -(-len(ids) // BLOCK_SIZE)
        + args.prompts * -(-(args.prompt_tokens + args.max_new_tokens) // BLOCK_SIZE)
    )
    score = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows: dict[str, Any] = {}
    base_lp: Any = None
    base_tokens: list[list[int]] = []
    for dtype in args.kv_cache_dtypes:
        engine = _engine(model, dtype, num_blocks, args.chunk)
        t0 = time.perf_counter()
        out = engine.generate([ids], score)[0]
        lp = np.array([out.prompt_logprobs[i].logprob for i in range(1, len(ids))], dtype=np.float64)
        tokens = [o.output_token_ids for o in engine.generate(prompts, greedy)]
        row: dict[str, Any] = {"tokens_scored": int(lp.size), "perplexity": float(np.exp(-lp.mean())),
                               "seconds": time.perf_counter() - t0}  # fmt: skip
        if base_lp is None:
            base_lp, base_tokens = lp, tokens
        else:
            diff = np.abs(lp - base_lp)
            same = [_common_prefix(a, b) for a, b in zip(tokens, base_tokens, strict=True)]
            row.update(
                logprob_abs_diff_mean=float(diff.mean()), logprob_abs_diff_p99=float(np.quantile(diff, 0.99)),
                logprob_abs_diff_max=float(diff.max()),
                perplexity_change=float(row["perplexity"] / rows[args.kv_cache_dtypes[0]]["perplexity"] - 1.0),
                greedy_token_agreement=sum(same) / sum(len(t) for t in base_tokens),
                greedy_identical=sum(a == b for a, b in zip(tokens, base_tokens, strict=True)),
            )  # fmt: skip
        row["greedy_prompts"] = len(prompts)
        rows[dtype] = row
    return {"text": str(args.text_file), "tokens": len(ids), "chunk": args.chunk, "rows": rows}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- capacity --------------------------------------------------------------------------------------------


def _quiet_json(main: Any, argv: list[str]) -> dict[str, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"{main.__module__} {' '.join(argv)} exited {code}")
    data: dict[str, Any] = json.loads(buf.getvalue())
    return data


def capacity(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Requests at once at one budget per dtype: the planner, the simulator and the CPU engine's allocator."""
    import numpy as np

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.sim.commands_plan import plan_main
    from pagedkv.sim.commands_simulate import simulate_main

    common = ["--model", args.plan_model, "--gpu", args.plan_gpu, "--num-requests", str(args.plan_requests),
              "--max-num-seqs", "4096", "--json"]  # fmt: skip
    rows: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for entry in args.kv_cache_dtypes:
        dtype, scheme = kv_choice(entry)
        kv = ["--kv-cache-dtype", dtype, "--kv-scale-scheme", scheme]
        plan = _quiet_json(plan_main, [*common, *kv, "--allocators", "paged"])
        burst = ["--arrivals", "poisson", "--rate", str(args.sim_rate), "--allocators", "paged", "--no-progress"]
        sim = _quiet_json(simulate_main, [*common, *kv, *burst])
        engine = Engine(model, None, EngineConfig(kv_budget_bytes=args.budget, block_size=BLOCK_SIZE, kv_cache_dtype=dtype,
                                                  kv_scale_scheme=scheme, enable_prefix_caching=False))  # fmt: skip
        admitted = 0
        while engine.manager.admit(rng.integers(3, 1000, size=args.request_tokens)) is not None:
            admitted += 1
        rows[entry] = {
            "plan_bytes_per_token": plan["bytes_per_token"],
            "plan_max_concurrent": plan["allocators"]["paged"]["max_concurrent_memory"],
            "simulate_peak_concurrency": sim["allocators"]["paged"]["peak_concurrency"],
            "simulate_mean_concurrency": sim["allocators"]["paged"]["mean_concurrency"],
            "simulate_tokens_per_s": sim["allocators"]["paged"]["tokens_per_s"],
            "simulate_preemptions": sim["allocators"]["paged"]["preemptions"],
            "engine_bytes_per_block": engine.cache.bytes_per_block,
            "engine_num_blocks": engine.cache.num_blocks,
            "engine_requests_admitted": admitted,
        }
    return {"plan_model": args.plan_model, "plan_gpu": args.plan_gpu, "sim_rate": args.sim_rate,
            "budget_bytes": args.budget, "request_tokens": args.request_tokens, "rows": rows}  # fmt: skip


# --- speed -----------------------------------------------------------------------------------------------


def speed(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds of one decode attention call per dtype and context (see the module docstring)."""
    import torch

    from pagedkv.hf.model_spec import model_spec
    from pagedkv.hf.sdpa import SdpaPlan, paged_sdpa
    from pagedkv.ops import cpu_decode
    from pagedkv.ops.options import AttentionOptions
    from pagedkv.storage.block_scales import quantize_blocks
    from pagedkv.storage.kv import torch_dtype
    from pagedkv.storage.kv_spec import resolve_kv_cache_dtype
    from pagedkv.storage.slots import quantize_rows

    spec = model_spec(model)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    gen = torch.Generator().manual_seed(0)
    options = AttentionOptions()
    rows: dict[str, dict[str, float]] = {d: {} for d in args.kv_cache_dtypes}
    paths: dict[str, str] = {}
    for context in args.contexts:
        width = -(-context // BLOCK_SIZE)
        num_blocks = args.batch * width + 1
        kv32 = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
        table = (1 + torch.randperm(num_blocks - 1, generator=gen)[: args.batch * width]).view(
            args.batch, width
        )
        table = table.to(torch.int32)
        lens = torch.full((args.batch,), context, dtype=torch.int32)
        q32 = torch.randn(args.batch, heads, dim, generator=gen)
        calls = {}
        for dtype in args.kv_cache_dtypes:
            storage = resolve_kv_cache_dtype(kv_choice(dtype)[0], "float32")
            if storage == "float32":
                call, paths[dtype] = (
                    partial(cpu_decode.decode_attention, q32, kv32, table, lens, options),
                    "C kernel",
                )
            elif storage in ("int8", "float8_e4m3fn", "float8_e5m2"):
                per_block = kv_choice(dtype)[1] == "block"
                codes, scales = (quantize_blocks if per_block else quantize_rows)(kv32, torch_dtype(storage))
                call = partial(
                    cpu_decode.decode_attention, q32, codes, table, lens, options, scales=scales.contiguous()
                )
                paths[dtype] = "C kernel (codes)"
            else:
                kv16, q16 = kv32.to(torch_dtype(storage)), q32.to(torch_dtype(storage))
                plan = SdpaPlan.build(table, lens, 1, context, BLOCK_SIZE)
                call = partial(paged_sdpa, q16, kv16, plan, options)
                paths[dtype] = "C kernel (bf16)" if cpu_decode.available(q16, kv16) else "SDPA gather"
            call()  # warm-up (the SDPA plan's masks and buckets are made here)
            calls[dtype] = call
        for dtype, seconds in _interleaved_medians(calls, args.repeat).items():
            rows[dtype][str(context)] = seconds
    return {"batch": args.batch, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "block_size": BLOCK_SIZE,
            "contexts": args.contexts, "paths": paths, "seconds": rows}  # fmt: skip



def _interleaved_medians(calls: dict[str, Any], repeat: int) -> dict[str, float]:
    """Median CPU seconds of each call over `repeat` rounds, one call of each per round (interleaved: a slow
    spell of the machine touches every dtype alike); CPU time of this thread, so the time it is descheduled
    on a shared machine does not count."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            t0 = time.thread_time()
            call()
            times[name].append(time.thread_time() - t0)
    return {name: statistics.median(samples) for name, samples in times.items()}

# --- output ----------------------------------------------------------------------------------------------


def text(result: dict[str, Any]) -> str:
    dtypes = result["dtypes"]
    out = [f"pagedkv bench kv-dtype: model {result['model']}, {result['torch_threads']} torch thread(s); "
           f"baseline: {dtypes[0]}"]  # fmt: skip
    if "accuracy" in result:
        acc = result["accuracy"]
        out += ["", f"accuracy: {acc['tokens']} tokens of {acc['text']}, prefill chunks of {acc['chunk']}",
                f"{'kv dtype':<15} {'ppl':>9} {'d ppl':>8} {'|d lp| mean':>12} {'p99':>8} {'max':>8} "
                f"{'greedy agree':>13} {'identical':>10}"]  # fmt: skip
        for d in dtypes:
            r = acc["rows"][d]
            if "perplexity_change" not in r:
                out.append(
                    f"{d:<15} {r['perplexity']:>9.4f} {'-':>8} {'-':>12} {'-':>8} {'-':>8} {'-':>13} {'-':>10}"
                )
                continue
            out.append(
                f"{d:<15} {r['perplexity']:>9.4f} {100 * r['perplexity_change']:>+7.3f}% "
                f"{r['logprob_abs_diff_mean']:>12.5f} {r['logprob_abs_diff_p99']:>8.4f} {r['logprob_abs_diff_max']:>8.4f} "
                f"{100 * r['greedy_token_agreement']:>12.1f}% {r['greedy_identical']:>5}/{r['greedy_prompts']:<4}"
            )
    if "capacity" in result:
        cap = result["capacity"]
        ref = "bf16" if "bf16" in dtypes else dtypes[0]  # the ratios' reference
        out += ["", f"capacity: plan and simulate (Poisson arrivals at {cap['sim_rate']}/s) of {cap['plan_model']} on "
                f"{cap['plan_gpu']}, paged; CPU engine: {cap['budget_bytes'] / 2**20:g} MiB of KV, requests of "
                f"{cap['request_tokens']} tokens admitted; x {ref}: ratios to the {ref} row",
                f"{'kv dtype':<15} {'bytes/tok':>10} {'plan conc':>10} {'x ' + ref:>7} {'sim peak':>9} {'sim mean':>9} "
                f"{'preempt':>8} {'sim tok/s':>10} {'cpu blocks':>11} {'cpu reqs':>9} {'x ' + ref:>7}"]  # fmt: skip
        base = cap["rows"][ref]
        for d in dtypes:
            r = cap["rows"][d]
            plan_x = r["plan_max_concurrent"] / base["plan_max_concurrent"] if base["plan_max_concurrent"] else math.nan
            cpu_x = (r["engine_requests_admitted"] / base["engine_requests_admitted"]
                     if base["engine_requests_admitted"] else math.nan)  # fmt: skip
            out.append(f"{d:<15} {r['plan_bytes_per_token']:>10,} {r['plan_max_concurrent']:>10} {plan_x:>7.2f} "
                       f"{r['simulate_peak_concurrency']:>9} {r['simulate_mean_concurrency']:>9.1f} "
                       f"{r['simulate_preemptions']:>8} {r['simulate_tokens_per_s']:>10.0f} "
                       f"{r['engine_num_blocks']:>11} {r['engine_requests_admitted']:>9} {cpu_x:>7.2f}")  # fmt: skip
    if "speed" in result:
        sp = result["speed"]
        ctx = [str(c) for c in sp["contexts"]]
        out += ["", f"decode attention, one call: batch {sp['batch']}, {sp['heads']} heads / {sp['kv_heads']} KV "
                f"heads x {sp['head_dim']}, block {sp['block_size']}; CPU ms of the calling thread (median)",
                f"{'kv dtype':<15} {'path':<17} " + " ".join(f"{c:>8}" for c in ctx)]  # fmt: skip
        for d in dtypes:
            ms = " ".join(f"{1000 * sp['seconds'][d][c]:>8.3f}" for c in ctx)
            out.append(f"{d:<15} {sp['paths'][d]:<17} {ms}")
    return "\n".join(out)
