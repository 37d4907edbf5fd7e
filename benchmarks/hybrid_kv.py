"""Hybrid KV cache groups, measured: uniform vs hybrid, side by side.

    python benchmarks/hybrid_kv.py [--json OUT.json] [--plot docs/figures/hybrid_concurrency.png]
    python benchmarks/hybrid_kv.py --allocator full,sliding-512 [--repeat 3]   # with any tree on PYTHONPATH

1. Planner (no simulation): on an H100-80GB, concurrent requests of 8k-128k tokens and the KV a uniform
   allocator wastes on sliding layers, for Gemma-3-27B, Gemma-2-27B, gpt-oss-120b, Mistral-7B-v0.1 and
   Ministral-8B (`pagedkv.sim.hybrid_kv.context_rows`), plus the RFC #11382 waste at each model's context.
2. A real CPU engine run per tiny windowed family (random weights, `pagedkv.hf.tiny`): the same requests
   (prompts 3-8 windows long) through the uniform paged allocator and the hybrid one; greedy tokens must be
   identical; reports the peak blocks in use and the bytes they hold (a uniform block holds every layer, a
   hybrid block one group's layer slots).
3. `--allocator GROUPS`: only the allocator's cost with those KV cache groups (`full`, `sliding-W`,
   `chunked-W`, comma-separated): `pagedkv bench allocator --allocator hybrid`'s loop and defaults (Azure
   conv, 3,000 requests, 16,384 blocks of 16), whose own hybrid run is one full group, with the manager
   built over GROUPS; prints the median us/token of `--repeat` runs and the schedule (steps, preemptions,
   hit rate) as JSON. It patches only how the bench builds its manager, so it runs against older trees too.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

MODELS = ("gemma-3-27b", "gemma-2-27b", "gpt-oss-120b", "mistral-7b-v0.1", "ministral-8b")


def plan_rows() -> list[dict[str, Any]]:
    from pagedkv.sim.catalog import BUILTIN_GPUS, BUILTIN_MODELS
    from pagedkv.sim.hybrid_kv import GroupedKV, context_rows
    from pagedkv.sim.kv_budget import KVBudget, activation_reserve_bytes

    out = []
    for name in MODELS:
        m = BUILTIN_MODELS[name]
        budget = KVBudget(m, BUILTIN_GPUS["h100-80gb"], 0.9, 16, activation_reserve_bytes(m, 8192, 256))
        for r in context_rows(budget):
            out.append({"model": name, **r})
        out.append({"model": name, "context": m.max_model_len, "rfc_waste": GroupedKV(m, 16).waste(m.max_model_len)})
    return out


def engine_rows(families: tuple[str, ...] = ("gemma2", "qwen2-sw", "mistral")) -> list[dict[str, Any]]:
    import torch

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.hf.tiny import VOCAB, tiny_model

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(20, 50, size=16)]
    rows = []
    for family in families:
        result: dict[str, Any] = {"family": family}
        for allocator in ("paged", "hybrid"):
            engine = Engine(tiny_model(family, 0), None, EngineConfig(num_blocks=512, block_size=4, allocator=allocator))  # type: ignore[arg-type]
            ids = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
            outs, peak = {}, 0
            while engine.has_unfinished():
                for o in engine.step():
                    outs[o.request_id] = o.output_token_ids
                peak = max(peak, engine.manager.num_used_blocks)
            block_bytes = engine.kv_budget_bytes // (engine.manager.num_blocks + 1)
            result[allocator] = {"peak_blocks": peak, "peak_bytes": peak * block_bytes, "block_bytes": block_bytes}
            result[f"{allocator}_tokens"] = [outs[i] for i in ids]
        result["identical"] = result.pop("paged_tokens") == result.pop("hybrid_tokens")
        rows.append(result)
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(3.2 * len(MODELS), 3.2), sharey=False)
    for ax, name in zip(axes, MODELS):
        rs = [r for r in rows if r["model"] == name and "uniform_concurrent" in r]
        x = np.arange(len(rs))
        ax.bar(x - 0.2, [r["uniform_concurrent"] for r in rs], 0.4, label="uniform")
        ax.bar(x + 0.2, [r["hybrid_concurrent"] for r in rs], 0.4, label="hybrid")
        ax.set_xticks(x, [f"{r['context'] // 1024}k" for r in rs])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("tokens per request")
    axes[0].set_ylabel("concurrent requests (H100-80GB)")
    axes[0].legend(fontsize=8)
    fig.suptitle("KV cache groups: requests that fit, uniform vs hybrid (pagedkv plan arithmetic)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def allocator_row(groups: str, repeat: int) -> dict[str, Any]:
    """`pagedkv bench allocator --allocator hybrid` over KV cache groups `groups` (see the docstring)."""
    import functools

    from pagedkv.bench import allocator as bench
    from pagedkv.core.group import KVGroupSpec
    from pagedkv.workloads.traces import default_trace_path, load_trace

    specs = []
    for name in groups.split(","):
        kind, _, window = name.partition("-")
        specs.append(KVGroupSpec() if kind == "full" else KVGroupSpec(kind, int(window)))  # type: ignore[arg-type]
    bench.make_manager = functools.partial(bench.make_manager, groups=tuple(specs))  # type: ignore[assignment]
    reqs = load_trace(default_trace_path())[:3000]
    runs = [bench.replay(reqs, "hybrid") for _ in range(repeat)]
    us = sorted(r.us_per_token for r in runs)
    return {"groups": groups, "us_per_token": us[len(us) // 2], "runs": [r.us_per_token for r in runs],
            "steps": runs[0].steps, "preemptions": runs[0].preemptions, "hit_rate": runs[0].prefix_hit_rate}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--plot", help="write the concurrency figure (PNG)")
    p.add_argument("--no-engine", action="store_true", help="skip the CPU engine runs")
    p.add_argument("--allocator", metavar="GROUPS", help="only the allocator bench over these groups")
    p.add_argument("--repeat", type=int, default=3, help="allocator runs (median reported)")
    args = p.parse_args()
    if args.allocator:
        print(json.dumps(allocator_row(args.allocator, args.repeat)))
        return
    rows = plan_rows()
    print(f"{'model':<16}{'context':>9}{'uniform':>9}{'hybrid':>8}{'waste':>8}")
    for r in rows:
        if "rfc_waste" in r:
            print(f"{r['model']:<16}{r['context']:>9,}  uniform KV wasted at the model's context: {r['rfc_waste']:.2%}")
        else:
            print(f"{r['model']:<16}{r['context']:>9,}{r['uniform_concurrent']:>9,}{r['hybrid_concurrent']:>8,}{r['waste']:>8.1%}")
    engine = [] if args.no_engine else engine_rows()
    for e in engine:
        u, h = e["paged"], e["hybrid"]
        print(f"engine {e['family']:<9} peak blocks uniform {u['peak_blocks']} ({u['peak_bytes']:,} B) vs hybrid "
              f"{h['peak_blocks']} ({h['peak_bytes']:,} B): {h['peak_bytes'] / u['peak_bytes']:.2f}x; "
              f"outputs identical: {e['identical']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": rows, "engine": engine}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
