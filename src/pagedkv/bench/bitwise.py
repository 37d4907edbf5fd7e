"""`pagedkv bench bitwise`: what exactly is bit-identical, measured.

Three comparisons, each on logits (or attention outputs), reported as `bitwise_equal` (every element equal
as bits), `max_abs_diff`, and for generation whether the greedy tokens are identical:

1. `allocator`: the pagedkv engine with the paged allocator vs the contiguous allocator, same model, same
   requests served together, greedy, prefix caching off, a KV budget large enough that both schedule the
   same chunks in the same steps (`same_schedule` checks it). Both run the same kernels over different
   block ids, so the logits should be equal bit for bit. `allocator_tight` repeats it with a budget that
   holds the prompts but not the outputs, so the two batch differently (and paged preempts), and compares
   that paged run with the ample one, to tell the allocator's effect from the schedule's.
2. `vs-transformers`: the engine (attention backend `sdpa`: block gather + torch SDPA, the CPU default; and
   `ops`: `pagedkv.ops.paged_attention`'s reference path) vs transformers' own forward with `DynamicCache`
   and `sdpa` (`eager` for models transformers runs on eager only, e.g. Gemma2), teacher-forced on the
   engine's tokens so both compute logits for the same positions; plus
   whether `model.generate` (greedy, `pagedkv.hf.oracle.reference_generate`) produces the same tokens.
   Different kernels sum in a different order, so equality is not expected; the size of the difference is
   the figure. Families: every tiny model of `pagedkv.hf.tiny` (random weights, seeded) and SmolLM2-135M.
3. `triton`: `pagedkv.ops.paged_attention` and `write_kv`, Triton kernels (under `TRITON_INTERPRET=1` on
   CPU; set before triton is imported) vs the reference backend, on random paged batches (decode, chunked
   prefill, sliding window, soft-cap; fp32 and bf16).

`--quick` skips SmolLM2 and uses shorter generations (for smoke runs).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv.engine.cli_args import add_threads, int_at_least, use_threads
from pagedkv.progress import Progress

FAMILIES_DEFAULT = ("llama", "qwen2", "qwen2-sw", "qwen3", "mistral", "gemma2", "phi3", "gpt2")


def _compare(a: Sequence[Any], b: Sequence[Any]) -> dict[str, Any]:
    """Bitwise equality and max |diff| over paired tensors (shapes must match)."""
    import torch

    equal, worst = True, 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(y.shape)}")
        equal = equal and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        worst = max(worst, float((x.float() - y.float()).abs().max()) if x.numel() else 0.0)
    return {"bitwise_equal": equal, "max_abs_diff": worst, "compared": len(a)}


def _prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def engine_logits(
    model: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    allocator: str,
    backend: str = "auto",
    num_blocks: int | None = None,
) -> tuple[list[list[int]], list[list[Any]], list[list[tuple[int, int]]], int]:
    """Greedy outputs, per-request logits rows (one per generated token), the schedule (per step, the
    (request index, new tokens) chunks) and the number of preemptions of one engine run. `num_blocks`
    None: ample for every request at once."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.scheduler import SchedulerConfig

    need = sum(len(p) + new_tokens for p in prompts)
    config = EngineConfig(
        num_blocks=num_blocks or 2 * (need // 16 + len(prompts)) + 4,
        block_size=16,
        allocator=allocator,  # type: ignore[arg-type]
        enable_prefix_caching=False,
        attention_backend=backend,  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_batched_tokens=4096),
    )
    engine = Engine(model, None, config)
    rows: dict[str, list[Any]] = {}
    schedule: list[list[tuple[int, int]]] = []
    original = engine.runner.execute

    def execute(manager: Any, out: Any) -> Any:
        logits = original(manager, out)
        producing = [c for c in out.scheduled if c.produces_token]
        for c, row in zip(producing, logits):
            rows.setdefault(c.request.request_id, []).append(row.detach().clone())
        schedule.append([(int(c.request.request_id[1:]), int(c.num_new_tokens)) for c in out.scheduled])
        return logits

    engine.runner.execute = execute  # type: ignore[method-assign,assignment]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(list(p), params, request_id=f"r{i}")
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = list(out.output_token_ids)
    ids = [f"r{i}" for i in range(len(prompts))]
    return [outputs[r] for r in ids], [rows[r] for r in ids], schedule, engine.stats.num_preemptions


def reference_attention(model: Any) -> str:
    """ "sdpa" where transformers supports it for this model, else "eager" (e.g. Gemma2's soft-cap)."""
    from pagedkv.hf.oracle import attention_implementation

    try:
        with attention_implementation(model, "sdpa"):
            return "sdpa"
    except ValueError:
        return "eager"


def transformers_logits(model: Any, prompt: Sequence[int], tokens: Sequence[int], impl: str) -> list[Any]:
    """transformers' logits (attention `impl`, DynamicCache, one token at a time after the prompt) for the
    positions that predict `tokens`, teacher-forced on them."""
    import torch
    from transformers import DynamicCache

    from pagedkv.hf.oracle import attention_implementation

    out_rows = []
    with torch.inference_mode(), attention_implementation(model, impl):
        cache = DynamicCache()
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        for k in range(len(tokens)):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
            out_rows.append(logits.detach().clone())
            ids = torch.tensor([[tokens[k]]], dtype=torch.long)
    return out_rows


def check_allocators(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, num_blocks: int | None = None
) -> dict[str, Any]:
    """Paged vs contiguous engine logits; with a small `num_blocks` the two batch (and preempt) differently."""
    paged = engine_logits(model, prompts, new_tokens, "paged", num_blocks=num_blocks)
    contiguous = engine_logits(model, prompts, new_tokens, "contiguous", num_blocks=num_blocks)
    result = _compare([r for rows in paged[1] for r in rows], [r for rows in contiguous[1] for r in rows])
    result["same_schedule"] = paged[2] == contiguous[2]
    result["tokens_identical"] = paged[0] == contiguous[0]
    result["preemptions"] = {"paged": paged[3], "contiguous": contiguous[3]}
    if num_blocks is not None:  # is it the allocator or the schedule? the same allocator, ample budget
        ample = engine_logits(model, prompts, new_tokens, "paged")
        same = _compare([r for rows in paged[1] for r in rows], [r for rows in ample[1] for r in rows])
        result["paged_tight_vs_paged_ample"] = same
    return result


def tight_blocks(prompts: Sequence[Sequence[int]], new_tokens: int, block_size: int = 16) -> int:
    """A budget that holds every prompt but not every full reservation (plus the null block and one spare):
    paging admits all requests and preempts as they grow; the contiguous allocator admits fewer."""
    need = max(len(p) + new_tokens for p in prompts)
    return max(sum(-(-len(p) // block_size) for p in prompts) + 2, -(-need // block_size) + 2)


def check_vs_transformers(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    from pagedkv.hf.oracle import reference_generate

    impl = reference_attention(model)
    reference_tokens = reference_generate(
        model, prompts, new_tokens, eos_token_id=None, attn_implementation=impl
    )
    result: dict[str, Any] = {"reference_attention": impl}
    for backend in ("sdpa", "ops"):
        outputs, rows, _, _ = engine_logits(model, prompts, new_tokens, "paged", backend)
        ref_rows = [transformers_logits(model, p, o, impl) for p, o in zip(prompts, outputs)]
        cmp = _compare([r for rs in rows for r in rs], [r for rs in ref_rows for r in rs])
        cmp["greedy_tokens_identical"] = outputs == reference_tokens
        cmp["requests_with_different_tokens"] = sum(o != r for o, r in zip(outputs, reference_tokens))
        result[backend] = cmp
    return result


def _random_batch(
    seed: int, lens: Sequence[int], q_lens: Sequence[int], block_size: int, group: int, dtype: Any
) -> Any:
    """A random paged batch: caches with shuffled block ids, queries for each sequence's last q tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hkv, d = 2, 16
    blocks_per = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(blocks_per):
        table[b, :nb] = perm[at : at + nb].to(torch.int32)
        at += nb
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g).to(dtype)
    cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    return q, k, v, table, torch.tensor(list(lens), dtype=torch.int32), cu, max(q_lens)


TRITON_CASES = (  # name, lens, q_lens, block_size, group, window, soft_cap, dtype name
    ("decode fp32", (20, 33, 7), (1, 1, 1), 16, 2, None, None, "float32"),
    ("chunked prefill fp32", (25, 40), (6, 17), 16, 1, None, None, "float32"),
    ("sliding window fp32", (30, 12, 50), (4, 1, 9), 16, 4, 7, None, "float32"),
    ("soft-cap fp32", (18, 27), (3, 1), 8, 2, None, 4.0, "float32"),
    ("decode bf16", (20, 33, 7), (1, 1, 1), 16, 2, None, None, "bfloat16"),
    ("chunked prefill bf16", (25, 40), (6, 17), 16, 2, None, None, "bfloat16"),
)


def check_triton() -> dict[str, Any]:
    import torch

    from pagedkv.ops import paged_attention, write_kv
    from pagedkv.ops.dispatch import triton_available, triton_interpreting

    if not triton_available() or not triton_interpreting():
        return {"skipped": "needs triton and TRITON_INTERPRET=1 before triton is imported"}
    out: dict[str, Any] = {}
    for i, (name, lens, q_lens, bs, group, window, cap, dt) in enumerate(TRITON_CASES):
        dtype = getattr(torch, dt)
        q, k, v, table, seq_lens, cu, max_q = _random_batch(i, lens, q_lens, bs, group, dtype)
        common = dict(sliding_window=window, soft_cap=cap, max_seqlen_q=max_q)
        ref = paged_attention(q, k, v, table, seq_lens, cu, backend="reference", **common)
        tri = paged_attention(q, k, v, table, seq_lens, cu, backend="triton", **common)
        out[f"attention {name}"] = _compare([tri], [ref])
    for dt in ("float32", "bfloat16"):
        dtype = getattr(torch, dt)
        caches = [torch.zeros(5, 4, 2, 8, dtype=dtype) for _ in range(4)]
        slots = torch.tensor([17, 0, 6, 19, 9], dtype=torch.int64)
        key, value = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
        write_kv(caches[0], caches[1], key, value, slots, backend="reference")
        write_kv(caches[2], caches[3], key, value, slots, backend="triton")
        out[f"write_kv {dt}"] = _compare(caches[2:], caches[:2])
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--families", type=_families, default=list(FAMILIES_DEFAULT), help="tiny families to test (comma-separated)"
    )
    parser.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2-135M")
    add_threads(parser)
    parser.add_argument(
        "--new-tokens", type=int_at_least(1, 4096), default=24, help="greedy tokens per request"
    )
    parser.add_argument("--quick", action="store_true", help="no SmolLM2, 6 new tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _families(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    bad = sorted(set(names) - set(FAMILIES_DEFAULT))
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown families {bad or text!r}; choose from {','.join(FAMILIES_DEFAULT)}")
    return names


def _check_all(models: list[tuple[str, Any]], new_tokens: int, result: dict[str, Any], *, enabled: bool | None) -> None:
    """Every check on every model, then Triton vs the reference, into `result`; a bar on a terminal."""
    with Progress("bench bitwise", total=3 * len(models) + 1, unit="checks", enabled=enabled) as bar:
        for name, model in models:
            vocab = int(model.config.vocab_size)
            prompts = _prompts(vocab, (5, 23, 40), seed=0)
            bar.update(0, note=f"{name}: allocators")
            result["allocator"][name] = check_allocators(model, prompts, new_tokens)
            tight = tight_blocks(prompts, new_tokens)
            bar.update(1, note=f"{name}: tight pool")
            result["allocator_tight"][name] = check_allocators(model, prompts, new_tokens, tight)
            bar.update(1, note=f"{name}: vs transformers")
            result["vs_transformers"][name] = check_vs_transformers(model, prompts, new_tokens)
            bar.update(1)
        bar.update(0, note="triton vs reference")
        result["triton"] = check_triton()
        bar.update(1)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (CPU only)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from pagedkv.hf.tiny import tiny_model

    use_threads(args.threads)
    new_tokens = 6 if args.quick else args.new_tokens
    models: list[tuple[str, Any]] = [(f, tiny_model(f)) for f in args.families]
    if not (args.quick or args.no_smollm2):
        from pagedkv.hf.loading import load_model

        models.append(("smollm2-135m", load_model("smollm2")[0]))
    result: dict[str, Any] = {
        "new_tokens": new_tokens,
        "allocator": {},
        "allocator_tight": {},
        "vs_transformers": {},
    }
    _check_all(models, new_tokens, result, enabled=False if args.no_progress else None)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"1. paged vs contiguous allocator in the engine ({new_tokens} greedy tokens x 3 requests, logits)")
    for name, r in result["allocator"].items():
        print(f"  {name:<14} bitwise {r['bitwise_equal']!s:<5} max|diff| {r['max_abs_diff']:.3g}  "
              f"same schedule {r['same_schedule']}  tokens identical {r['tokens_identical']}")  # fmt: skip
    print("1b. the same with a budget that holds the prompts but not the outputs (different batches)")
    for name, r in result["allocator_tight"].items():
        print(f"  {name:<14} bitwise {r['bitwise_equal']!s:<5} max|diff| {r['max_abs_diff']:.3g}  "
              f"same schedule {r['same_schedule']}  tokens identical {r['tokens_identical']}  "
              f"preemptions {r['preemptions']}; paged tight vs paged ample: bitwise "
              f"{r['paged_tight_vs_paged_ample']['bitwise_equal']}, "
              f"max|diff| {r['paged_tight_vs_paged_ample']['max_abs_diff']:.3g}")  # fmt: skip
    print(
        "2. pagedkv attention vs transformers + DynamicCache, sdpa (eager where unsupported): logits, greedy tokens"
    )
    for name, r in result["vs_transformers"].items():
        for backend, c in r.items():
            if backend == "reference_attention":
                continue
            print(f"  {name:<14} {backend:<5} bitwise {c['bitwise_equal']!s:<5} max|diff| {c['max_abs_diff']:.3g}  "
                  f"greedy tokens identical {c['greedy_tokens_identical']}")  # fmt: skip
    print("3. Triton (interpreter) vs reference")
    for case, c in result["triton"].items():
        print(f"  {case:<28} " + (f"bitwise {c['bitwise_equal']!s:<5} max|diff| {c['max_abs_diff']:.3g}" if isinstance(c, dict) else str(c)))  # fmt: skip
    return 0
