"""The seed's serving claims on one GPU: pagedkv's engine, four allocators, the A100-40GB KV budget.

    python benchmarks/gpu_serving.py --out results/             # Llama-2-7B shape, 100 requests (GPU)
    python benchmarks/gpu_serving.py --out /tmp/smoke --tiny    # tiny model, 6 requests (CPU smoke run)

What it runs (one command, nothing downloaded):

- model: a Llama-2-7B-shaped `LlamaForCausalLM` (hidden 4096, 32 layers, 32 heads, 32 KV heads, vocab
  32000, 4096 positions) with random bf16 weights, built on the GPU; `--tiny` swaps in a 2-layer model;
- KV budget: exactly what `pagedkv plan` gives Llama-2-7B on an A100-40GB (0.9 x 40 GiB - weights -
  activation reserve = 22.83 GiB, 2,922 blocks of 16 tokens), read from the planner itself
  (`pagedkv plan --json`), not hard-coded;
- workload: the first `--num-requests` requests of the Azure LLM inference trace 2023, conv (Patel et al.,
  "Splitwise", ISCA 2024; CC-BY 4.0, shipped in the package), all arriving at t=0 (burst), prompts of the
  trace's lengths (random token ids), outputs of the trace's lengths (EOS ignored, each request stopped at
  its trace length), cut to the model's 4096 positions as the simulator does;
- systems, all the same engine and scheduler (token budget 8192 per step, as the planner assumes) with
  only the allocator changed: `paged` (prefix caching off), `paged-prefix` (on), `contiguous-max` (the
  contiguous baseline reserving the model's maximum length per request, as systems before paging did) and
  `contiguous-oracle` (the contiguous baseline told each request's true output length);
- figures per system: output tokens/s, requests/s, mean (time-weighted) and peak concurrency, KV
  utilisation (time-weighted live KV tokens / capacity), TTFT and TPOT p50/p99, and next to each the value
  `pagedkv simulate` predicts for the same model, KV budget, workload and scheduler limits, on a GPU entry
  with this device's bandwidth and FLOP/s (a catalog file the script writes; A100-40GB memory, so the
  budget is the same 22.83 GiB).

Writes `serving.json` (and the simulator's own JSON) into `--out`; prints a table. Exit status 0 when
every system served every request.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SYSTEMS = ("paged", "paged-prefix", "contiguous-max", "contiguous-oracle")
MAX_MODEL_LEN = 4096
TINY_MAX_LEN = 64
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256

# Published peak figures (vendor datasheets, as in pagedkv.sim.catalog) used for the simulator's step-time
# model of the device this runs on; the memory is the A100-40GB's so the KV budget is the planner's.
GPU_PEAKS = {
    "h200": (4.8e12, 989e12),
    "h100": (3.35e12, 989e12),
    "a100": (1.555e12, 312e12),
}


def llama2_7b_config(tiny: bool) -> Any:
    import transformers as tf

    if tiny:
        return tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_MODEL_LEN)
    return tf.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=MAX_MODEL_LEN,
                          rms_norm_eps=1e-5)


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """Random weights created directly on `device` in `dtype` (no 27 GB float32 detour through the host)."""
    import transformers as tf

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = tf.LlamaForCausalLM(llama2_7b_config(tiny))
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def cli(*args: str) -> dict[str, Any]:
    """Run `pagedkv <args> --json` in a subprocess (the planner/simulator never load torch there)."""
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", *args, "--json"], capture_output=True, text=True,
                         check=False, env=os.environ.copy())  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"pagedkv {args[0]} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def planned_kv_budget() -> tuple[int, dict[str, Any]]:
    """The KV budget `pagedkv plan` gives Llama-2-7B on an A100-40GB (bytes), and the planner's JSON."""
    plan = cli("plan", "--model", "llama-2-7b", "--gpu", "a100-40gb", "--num-requests", "10", "--arrivals", "burst")
    return int(plan["kv_budget_bytes"]), plan


def load_requests(num_requests: int, tiny: bool, max_len: int) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of the first requests of the Azure conv trace, cut to the model length."""
    from pagedkv.workloads.traces import default_trace_path, load_trace

    rows = []
    for r in load_trace(default_trace_path(), limit=None):
        if len(rows) == num_requests:
            break
        prompt, output = r.prompt_len, r.output_len
        if tiny:  # a CPU smoke run: the trace's shape, 64x shorter
            prompt, output = max(4, prompt // 64), max(2, output // 16)
        if prompt >= max_len:
            continue  # the simulator drops these too
        rows.append((prompt, max(1, min(output, max_len - prompt))))
    return rows


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def serve(model: Any, system: str, requests: list[tuple[int, int]], kv_budget_bytes: int, vocab: int,
          block_size: int, max_len: int) -> dict[str, Any]:
    """Serve `requests` (burst) with one allocator; return the figures."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.scheduler import SchedulerConfig

    config = EngineConfig(
        kv_budget_bytes=kv_budget_bytes,
        block_size=block_size,
        allocator="paged" if system.startswith("paged") else "contiguous",
        enable_prefix_caching=system == "paged-prefix",
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS),
    )
    engine = Engine(model, config=config)
    rng = np.random.default_rng(0)
    target: dict[str, int] = {}

    def stop_at_trace_length(out: Any) -> None:  # the client's stop: the trace's output length
        if len(out.output_token_ids) >= target[out.request_id] and not out.finished:
            engine.finish(out.request_id, "stop")

    t0 = time.perf_counter()
    for i, (prompt_len, output_len) in enumerate(requests):
        rid = f"r{i}"
        target[rid] = output_len
        # contiguous-max reserves what a client may ask for (the model's length); the others declare the
        # trace's own output length (the paged allocator reserves nothing ahead either way)
        declared = max_len - prompt_len if system == "contiguous-max" else output_len
        ids = rng.integers(3, vocab, size=prompt_len).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=declared, ignore_eos=True), request_id=rid,
                           arrival_time=t0, on_token=stop_at_trace_length)
    while engine.has_unfinished():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    outputs = [engine.output(rid) for rid in target]
    stats = engine.stats
    num_tokens = sum(len(o.output_token_ids) for o in outputs)
    ttft = [o.ttft_s for o in outputs if o.ttft_s is not None]
    tpot = [o.tpot_s for o in outputs if o.tpot_s is not None]
    times = [t0, *stats.step_times]
    spans = np.diff(np.asarray(times))
    running = np.asarray(stats.running, dtype=float)
    mean_conc = float((running * spans).sum() / spans.sum()) if spans.size and spans.sum() > 0 else 0.0
    result = {
        "system": system,
        "num_requests": len(requests),
        "num_finished": sum(1 for o in outputs if o.finished and o.finish_reason in ("stop", "length")),
        "output_tokens": num_tokens,
        "wall_s": wall,
        "tokens_per_s": num_tokens / wall,
        "requests_per_s": len(outputs) / wall,
        "mean_concurrency": mean_conc,
        "peak_concurrency": stats.peak_concurrency,
        "kv_utilisation": stats.kv_utilization(engine.capacity_tokens),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "num_steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "num_blocks": engine.manager.num_blocks,
        "capacity_tokens": engine.capacity_tokens,
        "attention_backend": engine.cache.attention_backend,
    }
    return result


def release_memory() -> None:
    """Free the last engine's KV cache (the stop callback's closure keeps it in a reference cycle)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def simulate(out_dir: Path, num_requests: int, device_name: str, tiny: bool) -> dict[str, Any]:
    """`pagedkv simulate` on the same setup: model, A100-40GB memory (so the same KV budget), this device's
    bandwidth and FLOP/s, the same requests (burst) and scheduler limits."""
    key = next((k for k in GPU_PEAKS if k in device_name.lower()), "a100")
    bandwidth, flops = GPU_PEAKS[key]
    catalog = {"gpus": {"this-gpu-a100-40gb-budget": {
        "memory_bytes": 40960 * 1024**2, "hbm_bandwidth_bytes_per_s": bandwidth, "bf16_flops_per_s": flops,
        "source": f"{device_name}: {key} datasheet bandwidth and bf16 FLOP/s; A100-40GB memory (the planned budget)"}}}
    path = out_dir / "sim_catalog.json"
    path.write_text(json.dumps(catalog, indent=2))
    result = cli("simulate", "--model", "llama-2-7b", "--gpu", "this-gpu-a100-40gb-budget", "--catalog", str(path),
                 "--num-requests", str(num_requests), "--arrivals", "burst", "--block-size", str(BLOCK_SIZE),
                 "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
                 "--max-model-len", str(MAX_MODEL_LEN), "--no-progress")
    (out_dir / "simulate.json").write_text(json.dumps(result, indent=2))
    result["note"] = "tiny run: the prediction is for the full Llama-2-7B setup, not the tiny model" if tiny else ""
    return result


FIGURES = [  # (our key, simulator key, format)
    ("tokens_per_s", "tokens_per_s", "{:.0f}"),
    ("requests_per_s", "requests_per_s", "{:.2f}"),
    ("mean_concurrency", "mean_concurrency", "{:.1f}"),
    ("peak_concurrency", "peak_concurrency", "{:.0f}"),
    ("kv_utilisation", "kv_utilisation", "{:.2f}"),
    ("ttft_p50_s", "ttft_p50_s", "{:.2f}"),
    ("ttft_p99_s", "ttft_p99_s", "{:.2f}"),
    ("tpot_p50_s", "tpot_p50_s", "{:.4f}"),
    ("tpot_p99_s", "tpot_p99_s", "{:.4f}"),
]


def fmt(fmt_str: str, value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt_str.format(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for serving.json, simulate.json")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 100 (--tiny: 6)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--tiny", action="store_true", help="2-layer model, short requests: a CPU smoke run")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--no-simulate", action="store_true", help="skip the simulator's predictions")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if not set(systems) <= set(SYSTEMS):
        parser.error(f"--systems must be a subset of {SYSTEMS}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.tiny:
        print("no CUDA device: the full run needs a GPU; use --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    num_requests = args.num_requests or (6 if args.tiny else 100)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    kv_budget, plan = planned_kv_budget()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.tiny, device, dtype)
    vocab = int(model.config.vocab_size)
    max_len = TINY_MAX_LEN if args.tiny else MAX_MODEL_LEN
    requests = load_requests(num_requests, args.tiny, max_len)
    block_size = BLOCK_SIZE
    if args.tiny:
        # Tiny numbers with the same kind of pressure: 48 blocks of 4 tokens, requests declaring up to 64.
        block_size = 4
        from pagedkv.hf.model_spec import model_spec

        kv_budget = 48 * model_spec(model).kv_cache_spec().bytes_per_block(block_size)
    print(f"device {device_name}, torch {torch.__version__}, model {'tiny' if args.tiny else 'llama-2-7b shape'} "
          f"({dtype}), KV budget {kv_budget / 2**20:.1f} MiB (pagedkv plan: {plan['kv_budget_bytes'] / 2**30:.2f} "
          f"GiB), {len(requests)} requests (burst)", flush=True)

    # Warm-up: compiles the Triton kernels (decode and prefill specializations) before anything is timed.
    serve(model, "paged", [(min(p, 600), min(o, 8)) for p, o in requests[:4]], kv_budget, vocab, block_size, max_len)
    release_memory()
    results = {}
    for system in systems:
        results[system] = serve(model, system, requests, kv_budget, vocab, block_size, max_len)
        release_memory()
        r = results[system]
        print(f"  {system:18s} {r['tokens_per_s']:8.0f} tok/s  peak {r['peak_concurrency']:3d}  "
              f"{r['num_steps']} steps  {r['wall_s']:.1f} s", flush=True)
    predicted = {} if args.no_simulate else simulate(out_dir, num_requests, device_name, args.tiny)
    sim_rows = predicted.get("allocators", {})

    print(f"\n{'system':18s} " + " ".join(f"{k:>20s}" for k, _, _ in FIGURES))
    for system, r in results.items():
        sim = sim_rows.get(system, {})
        cells = [f"{fmt(f, r[k])} ({fmt(f, sim.get(sk))})" for k, sk, f in FIGURES]
        print(f"{system:18s} " + " ".join(f"{c:>20s}" for c in cells))
    print("(measured (simulated)); simulate: same model, KV budget, requests and scheduler limits")
    ok = all(r["num_finished"] == r["num_requests"] for r in results.values())
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "triton": _version("triton"),
        "tiny": args.tiny,
        "kv_budget_bytes": kv_budget,
        "planned_kv_budget_bytes": plan["kv_budget_bytes"],
        "num_requests": len(requests),
        "workload": "Azure LLM inference trace 2023, conv (Patel et al., ISCA 2024), first requests, burst",
        "results": results,
        "simulated": sim_rows,
        "simulate_note": predicted.get("note", ""),
        "all_served": ok,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    (out_dir / "serving.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out_dir / 'serving.json'}")
    return 0 if ok else 1


def _version(name: str) -> str | None:
    try:
        return str(__import__(name).__version__)
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
