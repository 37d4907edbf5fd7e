"""GPU check and benchmark of the Triton paged-attention kernels.

    python benchmarks/gpu_attention.py --json out.json    # on a GPU: checks, decode/prefill tables, sweep
    TRITON_INTERPRET=1 python benchmarks/gpu_attention.py --device cpu   # CPU smoke: the checks, tiny shapes

1. Correctness: Triton `write_kv` and `paged_attention` against the reference path on the same tensors
   (decode, chunked prefill, GQA/MQA, sliding window, soft cap, block sizes 1/7/16/256, fp16/bf16/fp32,
   forced split-K, and fp8 caches on compute capability >= 8.9). Exit status 1 if one fails.
2. Copy bandwidth of the card: `dst.copy_(src)` of 2 GiB, bytes read + written per second.
3. Decode (bf16, 32 query / 8 KV heads, head dim 128, block size 16 by default): the paged Triton kernel
   with a per-step plan (what every layer of an engine step pays) and without one (plan + run, a one-off
   call), against torch SDPA (flash backend where it accepts the call) over the same KV laid out
   contiguously. Bandwidth counts the bytes decode must read (K and V of every context token, plus queries
   and outputs). Goals (issue 11): paged <= 1.10x SDPA at batch 64 / context 4096 and 8192, <= 1.25x at
   batch 1 and 16.
4. Prefill: one prompt of 2k/4k/8k tokens (KV already written, causal), paged Triton vs SDPA flash with
   `is_causal`. Goal: <= 1.5x.
5. Launch sweep: decode time per (tile_n, num_warps, num_stages) at batch 64 / context 4096 and per split
   count at batch 1 / context 4096: data for `pagedkv.ops.launch`'s heuristics.

Runs on torch >= 2.5 (SDPA `enable_gqa`), Triton >= 3.2; nothing newer is used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.ops import paged_attention, write_kv
from pagedkv.ops.contiguous_oracle import gather_kv
from pagedkv.ops.plan import plan_attention
from pagedkv.storage.slots import quantize_fp8


def cuda_time_ms(fn: Any, repeats: int = 20) -> float:
    """Median over `repeats` CUDA-event timings after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def make_paged(device: str, seq_lens: list[int], q_lens: list[int], *, block_size: int, hkv: int, group: int,
               dim: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """KV written through the reference write at shuffled block ids; block 0 (guard) and spares hold NaN."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(seq_lens)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks) + 4
    ids = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    table = torch.zeros((batch, max(blocks) + 1), dtype=torch.int32, device=device)
    kc = torch.full((num_blocks, block_size, hkv, dim), float("nan"), dtype=dtype, device=device)
    vc = kc.clone()
    used = 0
    for b, n in enumerate(seq_lens):
        table[b, : blocks[b]] = ids[used : used + blocks[b]].int()
        used += blocks[b]
        pos = torch.arange(n, device=device)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn((n, hkv, dim), generator=gen, device=device).to(dtype)
        v = torch.randn((n, hkv, dim), generator=gen, device=device).to(dtype)
        write_kv(kc, vc, k, v, slots, backend="reference")
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    q = torch.randn((sum(q_lens), hkv * group, dim), generator=gen, device=device).to(dtype)
    return {"query": q, "key_cache": kc, "value_cache": vc, "block_table": table,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device), "cu_seqlens_q": cu}


CASES = [
    # seq_lens, q_lens, block_size, hkv, group, dim, window, cap, dtype, forced splits
    ([1, 17, 300, 64], [1, 1, 1, 1], 16, 8, 4, 128, None, None, torch.float16, None),
    ([100, 257, 33], [100, 5, 1], 16, 2, 8, 64, None, None, torch.bfloat16, None),
    ([500, 129, 77], [3, 129, 1], 7, 4, 1, 128, 64, None, torch.float32, None),
    ([1000, 4000], [1, 1], 256, 1, 16, 128, None, 30.0, torch.bfloat16, None),
    ([90, 45], [9, 45], 1, 2, 3, 80, 20, 50.0, torch.float16, None),
    ([3000, 70], [1, 1], 16, 8, 4, 128, None, None, torch.bfloat16, 16),
    ([2100, 600], [300, 1], 32, 4, 2, 256, 512, None, torch.bfloat16, 4),
    ([800, 33], [1, 33], 16, 4, 5, 96, None, None, torch.float16, None),
]
SMOKE_CASES = [  # the CPU interpreter: same modes, tiny shapes
    ([1, 17, 40, 9], [1, 1, 1, 1], 16, 2, 4, 16, None, None, torch.float16, None),
    ([30, 57, 13], [30, 5, 1], 4, 2, 2, 16, None, None, torch.bfloat16, None),
    ([50, 29], [3, 29], 7, 1, 3, 16, 9, 20.0, torch.float32, None),
    ([90, 20], [1, 1], 2, 2, 2, 32, None, None, torch.float32, 4),
]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def has_fp8(device: str) -> bool:
    return device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)


def check_correctness(device: str) -> tuple[bool, list[dict[str, Any]]]:
    ok = True
    rows = []
    cases = CASES if device == "cuda" else SMOKE_CASES
    for i, (lens, qls, bs, hkv, group, dim, window, cap, dtype, splits) in enumerate(cases):
        args = make_paged(device, lens, qls, block_size=bs, hkv=hkv, group=group, dim=dim, dtype=dtype, seed=i)
        ref = paged_attention(**args, sliding_window=window, soft_cap=cap, backend="reference")
        plan = plan_attention(*args.values(), max_seqlen_q=max(qls), backend="triton", num_splits=splits)
        tri = paged_attention(**args, sliding_window=window, soft_cap=cap, plan=plan)
        err = (tri.float() - ref.float()).abs().max().item()
        good = bool(torch.isfinite(tri).all()) and err <= TOL[dtype] * 4
        ok &= good
        rows.append({"case": i, "dtype": str(dtype), "max_abs_err": err, "ok": good})
        print(f"check attention case {i} ({dtype}, bs={bs}, group={group}, dim={dim}, window={window}, cap={cap}, "
              f"splits={plan.triton.num_splits if plan.triton else '-'}): max|triton-ref| = {err:.2e} "
              f"{'ok' if good else 'FAIL'}", flush=True)
    if has_fp8(device):
        args = make_paged(device, [700, 40], [1, 40], block_size=16, hkv=8, group=4, dim=128, dtype=torch.bfloat16)
        k8, v8 = (quantize_fp8(c.nan_to_num(0.0), s) for c, s in ((args["key_cache"], 0.05), (args["value_cache"], 0.02)))
        args.update(key_cache=k8, value_cache=v8)
        ref = paged_attention(**args, k_scale=0.05, v_scale=0.02, backend="reference")
        tri = paged_attention(**args, k_scale=0.05, v_scale=0.02, backend="triton")
        err = (tri.float() - ref.float()).abs().max().item()
        good = err <= 3e-2
        ok &= good
        rows.append({"case": "fp8", "max_abs_err": err, "ok": good})
        print(f"check attention fp8 cache (bf16 query): max|triton-ref| = {err:.2e} {'ok' if good else 'FAIL'}")
    kc = torch.full((64, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device=device)
    caches = [kc.clone() for _ in range(4)]
    slots = torch.randperm(64 * 16, device=device)[:300]
    key = torch.randn((300, 8, 128), device=device).to(torch.bfloat16)
    write_kv(caches[0], caches[1], key, key, slots, backend="reference")
    write_kv(caches[2], caches[3], key, key, slots, backend="triton")
    same = torch.equal(caches[0].view(torch.int16), caches[2].view(torch.int16))
    ok &= same
    rows.append({"case": "write_kv", "ok": same})
    print(f"check write_kv triton == reference (bit exact, untouched slots unchanged): {'ok' if same else 'FAIL'}")
    return ok, rows


def copy_bandwidth_gbps() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def contiguous_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> tuple[torch.Tensor, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), backend.name
        except RuntimeError:
            continue
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), "default"


def decode_inputs(batch: int, context: int, hq: int, hkv: int, dim: int, dtype: torch.dtype,
                  block_size: int) -> dict[str, torch.Tensor]:
    blocks = -(-context // block_size)
    num_blocks = 1 + batch * blocks
    kc = torch.randn((num_blocks, block_size, hkv, dim), device="cuda").to(dtype)
    vc = torch.randn_like(kc)
    table = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, blocks).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, hq, dim), device="cuda").to(dtype)
    return {"query": q, "key_cache": kc, "value_cache": vc, "block_table": table, "seq_lens": lens, "cu_seqlens_q": cu}


def bench_decode(batch: int, context: int, *, hq: int, hkv: int, dim: int, dtype: torch.dtype,
                 block_size: int, copy_gbps: float) -> dict[str, Any]:
    a = decode_inputs(batch, context, hq, hkv, dim, dtype, block_size)
    keys, values = gather_kv(a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"])
    k, v = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    del keys, values
    q4 = a["query"][:, :, None, :]
    out_c, sdpa_backend = contiguous_sdpa(q4, k, v)
    plan = plan_attention(*a.values(), max_seqlen_q=1, max_seqlen_k=context, backend="triton")
    out_p = paged_attention(**a, plan=plan)
    err = (out_p.float() - out_c[:, :, 0].float()).abs().max().item()
    paged_ms = cuda_time_ms(lambda: paged_attention(**a, plan=plan))
    unplanned_ms = cuda_time_ms(lambda: paged_attention(**a, max_seqlen_q=1, backend="triton"))
    contig_ms = cuda_time_ms(lambda: contiguous_sdpa(q4, k, v))
    moved = 2 * batch * context * hkv * dim * a["key_cache"].element_size() + 2 * a["query"].numel() * a["query"].element_size()
    gbps = moved / (paged_ms * 1e-3) / 1e9
    assert plan.triton is not None
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "paged_ms": paged_ms,
            "paged_unplanned_ms": unplanned_ms, "contiguous_ms": contig_ms, "ratio": paged_ms / contig_ms,
            "paged_gbps": gbps, "fraction_of_copy_bw": gbps / copy_gbps, "sdpa_backend": sdpa_backend,
            "num_splits": plan.triton.num_splits, "launch": repr(plan.triton.config), "max_abs_diff": err}


def bench_prefill(length: int, *, hq: int, hkv: int, dim: int, dtype: torch.dtype, block_size: int) -> dict[str, Any]:
    a = make_paged("cuda", [length], [length], block_size=block_size, hkv=hkv, group=hq // hkv, dim=dim, dtype=dtype)
    keys, values = gather_kv(a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"])
    k, v = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    q = a["query"].transpose(0, 1)[None]
    out_c, sdpa_backend = contiguous_sdpa(q, k, v, causal=True)
    plan = plan_attention(*a.values(), max_seqlen_q=length, max_seqlen_k=length, backend="triton")
    out_p = paged_attention(**a, plan=plan)
    err = (out_p.float() - out_c[0].transpose(0, 1).float()).abs().max().item()
    paged_ms = cuda_time_ms(lambda: paged_attention(**a, plan=plan), repeats=10)
    contig_ms = cuda_time_ms(lambda: contiguous_sdpa(q, k, v, causal=True), repeats=10)
    flops = 4 * length * length / 2 * hq * dim
    return {"prompt": length, "paged_ms": paged_ms, "contiguous_ms": contig_ms, "ratio": paged_ms / contig_ms,
            "paged_tflops": flops / (paged_ms * 1e-3) / 1e12, "sdpa_backend": sdpa_backend, "max_abs_diff": err}


def sweep(*, hq: int, hkv: int, dim: int, dtype: torch.dtype, block_size: int, copy_gbps: float) -> list[dict[str, Any]]:
    """Decode time per launch configuration (batch 64) and per split count (batch 1), context 4096."""
    results = []
    a = decode_inputs(64, 4096, hq, hkv, dim, dtype, block_size)
    base = plan_attention(*a.values(), max_seqlen_q=1, max_seqlen_k=4096, backend="triton")
    assert base.triton is not None
    moved = 2 * 64 * 4096 * hkv * dim * a["key_cache"].element_size()
    print("launch sweep at batch 64, context 4096 (default: " + repr(base.triton.config) + "):")
    for tile_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                cfg = replace(base.triton.config, tile_n=tile_n, num_warps=warps, num_stages=stages)
                results.append(_time_config(a, cfg, 1, 4096, moved, copy_gbps, 64))
    b = decode_inputs(1, 4096, hq, hkv, dim, dtype, block_size)
    print("split sweep at batch 1, context 4096:")
    for splits in (1, 2, 4, 8, 16, 32):
        results.append(_time_config(b, None, splits, 4096, moved / 64, copy_gbps, 1))
    return results


def _time_config(a: dict[str, torch.Tensor], cfg: Any, splits: int | None, context: int, moved: float,
                 copy_gbps: float, batch: int) -> dict[str, Any]:
    try:
        plan = plan_attention(*a.values(), max_seqlen_q=1, max_seqlen_k=context, backend="triton",
                              num_splits=splits, launch=cfg)
        ms = cuda_time_ms(lambda: paged_attention(**a, plan=plan), repeats=10)
    except Exception as exc:  # a config may not compile (registers, shared memory)
        print(f"  {cfg} splits={splits}: failed ({type(exc).__name__})")
        return {"batch": batch, "launch": repr(cfg), "num_splits": splits, "error": type(exc).__name__}
    frac = moved / (ms * 1e-3) / 1e9 / copy_gbps
    assert plan.triton is not None
    c = plan.triton.config
    print(f"  tile_n={c.tile_n} warps={c.num_warps} stages={c.num_stages} splits={plan.triton.num_splits}: "
          f"{ms:.3f} ms, {100 * frac:.1f}% of copy bandwidth", flush=True)
    return {"batch": batch, "launch": repr(c), "num_splits": plan.triton.num_splits, "ms": ms, "fraction_of_copy_bw": frac}


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The attention shape the GPU benchmarks time (the decode goal's by default)."""
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")


DECODE_GOALS = {(1, 4096): 1.25, (16, 4096): 1.25, (64, 4096): 1.10, (64, 8192): 1.10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the interpreter smoke run")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args()
    if args.device == "cpu":
        ok, checks = check_correctness("cpu")
        print(f"CPU smoke run (interpreter): checks {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU (or --device cpu with TRITON_INTERPRET=1 for the checks)")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {_triton_version()}")
    ok, checks = check_correctness("cuda")
    save(args.json, 0.0, checks, [], [], [], ok)  # each stage saved as it ends: a time limit keeps the rest
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s")
    dtype = getattr(torch, args.dtype)
    shape = {"hq": args.num_heads, "hkv": args.num_kv_heads, "dim": args.head_dim, "dtype": dtype,
             "block_size": args.block_size}
    rows = []
    print(f"{'batch':>5} {'context':>7} {'paged ms':>9} {'unplanned':>9} {'sdpa ms':>9} {'ratio':>6} {'GB/s':>7} "
          f"{'% copy':>7} {'splits':>6} goal  sdpa")
    for batch, context in [(1, 4096), (16, 4096), (64, 1024), (64, 4096), (64, 8192)]:
        r = bench_decode(batch, context, copy_gbps=copy_gbps, **shape)
        goal = DECODE_GOALS.get((batch, context))
        r["goal_ratio"] = goal
        r["goal_met"] = None if goal is None else r["ratio"] <= goal
        rows.append(r)
        verdict = "-" if goal is None else ("PASS" if r["goal_met"] else "MISS")
        print(f"{batch:>5} {context:>7} {r['paged_ms']:>9.3f} {r['paged_unplanned_ms']:>9.3f} {r['contiguous_ms']:>9.3f} "
              f"{r['ratio']:>6.2f} {r['paged_gbps']:>7.0f} {100 * r['fraction_of_copy_bw']:>6.1f}% {r['num_splits']:>6} "
              f"{verdict:>4}  {r['sdpa_backend']}", flush=True)
        ok &= math.isfinite(r["max_abs_diff"]) and r["max_abs_diff"] < 5e-2
    save(args.json, copy_gbps, checks, rows, [], [], ok)
    prefill = []
    print(f"{'prompt':>6} {'paged ms':>9} {'sdpa ms':>9} {'ratio':>6} {'TFLOP/s':>8} goal<=1.5x")
    for length in (2048, 4096, 8192):
        r = bench_prefill(length, **shape)
        r["goal_met"] = r["ratio"] <= 1.5
        prefill.append(r)
        print(f"{length:>6} {r['paged_ms']:>9.3f} {r['contiguous_ms']:>9.3f} {r['ratio']:>6.2f} {r['paged_tflops']:>8.1f} "
              f"{'PASS' if r['goal_met'] else 'MISS'}", flush=True)
        ok &= math.isfinite(r["max_abs_diff"]) and r["max_abs_diff"] < 5e-2
    save(args.json, copy_gbps, checks, rows, prefill, [], ok)
    tuning = [] if args.no_sweep else sweep(copy_gbps=copy_gbps, **shape)
    save(args.json, copy_gbps, checks, rows, prefill, tuning, ok)
    return 0 if ok else 1


def save(path: str | None, copy_gbps: float, checks: list[Any], decode: list[Any], prefill: list[Any],
         tuning: list[Any], ok: bool) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
                       "copy_gbps": copy_gbps, "checks": checks, "decode": decode, "prefill": prefill,
                       "tuning": tuning, "checks_ok": ok}, f, indent=2)


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    sys.exit(main())
