"""`pagedkv bench attention`: paged attention against contiguous SDPA over the same KV.

For every (batch, context) shape: the KV of `batch` sequences of `context` tokens sits in a paged cache
(block size 16 by default, blocks at shuffled ids, block 0 left as the guard block) and, copied, in
contiguous `[batch, num_kv_heads, context, head_dim]` tensors. Decode times one query per sequence; prefill
times a full causal prefill of every sequence. The baseline is one batched torch SDPA call over the
contiguous copy (`enable_gqa`, `is_causal` for prefill). The two sides run alternately for `--repeats`
rounds after a warm-up and each one's minimum is reported (on a shared machine the minimum is the least
noisy statistic, and alternating exposes both sides to the same background load).
Both sides' outputs are compared, and the max abs difference is part of the table.

Target (issue 3): paged decode within 1.25x of contiguous SDPA at batch 32, context 2048, on the CPU.

`--backend cpu-decode` times the C decode kernel the transformers integration runs for float32 decode on a
one-thread CPU (`pagedkv.ops.cpu_decode`, K and V in one `[2, NB, BS, Hkv, D]` tensor) instead of
`paged_attention`; decode shapes only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedkv.engine.cli_args import (
    add_block_size,
    available_memory_bytes,
    int_at_least,
    positive_float,
    positive_int,
    token_count,
)
from pagedkv.ops import cpu_decode, paged_attention
from pagedkv.ops.contiguous_oracle import gather_kv
from pagedkv.ops.options import NO_OPTIONS
from pagedkv.storage.kv import torch_dtype
from pagedkv.storage.kv_spec import normalize_dtype_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch", type=int_at_least(1, 1 << 16), nargs="+", default=[1, 8, 32, 64], help="batch sizes"
    )
    parser.add_argument(
        "--context", type=token_count, nargs="+", default=[128, 512, 2048, 8192], help="context lengths"
    )
    add_block_size(parser)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--num-heads", type=int_at_least(1, 1024), default=32)
    parser.add_argument("--num-kv-heads", type=int_at_least(1, 1024), default=8, help="must divide --num-heads")
    parser.add_argument("--head-dim", type=int_at_least(1, 4096), default=64)
    parser.add_argument("--mode", choices=["decode", "prefill", "both"], default="both")
    parser.add_argument(
        "--prefill-max-tokens", type=positive_int, default=8192, help="skip prefills of more tokens"
    )
    parser.add_argument(
        "--max-gb", type=positive_float, default=3.0,
        help="skip shapes whose KV (paged + copy) exceeds this many GiB (or the memory available)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int_at_least(1, 10_000), default=5)
    parser.add_argument("--threads", type=int_at_least(1, 1024), default=1, help="torch CPU threads")
    parser.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--backend",
        choices=["reference", "triton", "cpu-decode"],
        default=None,
        help="default: by device; cpu-decode: the C decode kernel (float32, one thread, decode only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small subset for smoke tests")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _device(text: str) -> str:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda:0, got {text!r}") from None
    return text


def time_interleaved(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Best wall time (ms) of each function over `repeats` rounds, the functions alternating within a round
    so that load from other processes on a shared machine hits both sides alike."""
    for fn in fns:
        fn()  # warm-up
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def bench_shape(args: argparse.Namespace, mode: str, batch: int, context: int) -> dict[str, object]:
    """Time one shape; returns a JSON-ready row."""
    device = torch.device(args.device)
    dtype = torch_dtype(normalize_dtype_name(args.dtype))
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    bs, hkv, hq, dim = args.block_size, args.num_kv_heads, args.num_heads, args.head_dim
    blocks_per_seq = -(-context // bs)
    num_blocks = 1 + batch * blocks_per_seq
    key_cache = torch.randn((num_blocks, bs, hkv, dim), generator=gen).to(device=device, dtype=dtype)
    value_cache = torch.randn((num_blocks, bs, hkv, dim), generator=gen).to(device=device, dtype=dtype)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = ids.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    keys, values = gather_kv(key_cache, value_cache, block_table, seq_lens)
    k = keys.transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    v = values.transpose(1, 2).contiguous()
    del keys, values
    q_per_seq = 1 if mode == "decode" else context
    query = torch.randn((batch * q_per_seq, hq, dim), generator=gen).to(device=device, dtype=dtype)
    cu = torch.arange(0, batch * q_per_seq + 1, q_per_seq, dtype=torch.int32, device=device)
    q_sdpa = query.view(batch, q_per_seq, hq, dim).transpose(1, 2)

    if args.backend == "cpu-decode":
        kv = torch.stack([key_cache, value_cache])  # the layout of a PagedKVCache layer

        def paged() -> torch.Tensor:  # the default scale, 1/sqrt(head_dim), as the contiguous side's SDPA
            return cpu_decode.decode_attention(query, kv, block_table, seq_lens, NO_OPTIONS)

    else:

        def paged() -> torch.Tensor:
            return paged_attention(
                query, key_cache, value_cache, block_table, seq_lens, cu, max_seqlen_q=q_per_seq, backend=args.backend
            )

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k, v, is_causal=mode == "prefill", enable_gqa=True)

    diff = (paged().float() - contiguous().transpose(1, 2).reshape(query.shape).float()).abs().max().item()
    paged_ms, contiguous_ms = time_interleaved([paged, contiguous], device, args.repeats)
    kv_bytes = 2 * batch * context * hkv * dim * key_cache.element_size()
    return {
        "mode": mode,
        "batch": batch,
        "context": context,
        "paged_ms": paged_ms,
        "contiguous_ms": contiguous_ms,
        "ratio": paged_ms / contiguous_ms,
        "max_abs_diff": diff,
        "kv_bytes": kv_bytes,
    }


def _backend_problem(args: argparse.Namespace) -> str | None:
    """One line saying why these arguments cannot run (heads, or `--backend cpu-decode`'s limits), or None."""
    if args.num_heads % args.num_kv_heads:
        return f"--num-kv-heads {args.num_kv_heads} must divide --num-heads {args.num_heads}"
    if args.backend != "cpu-decode":
        return None
    if cpu_decode.isa() is None:
        return "--backend cpu-decode: pagedkv.ops._cpu_decode is not built (or PAGEDKV_NATIVE=0)"
    dtype = normalize_dtype_name(args.dtype)
    if args.mode == "prefill" or args.device != "cpu" or dtype != "float32" or args.threads != 1:
        return (
            "--backend cpu-decode times float32 decode on one CPU thread: use --mode decode and the default "
            "device, dtype and threads"
        )
    return None


def run(args: argparse.Namespace) -> int:
    problem = _backend_problem(args)
    if problem:
        print(f"pagedkv bench attention: {problem}", file=sys.stderr)
        return 2
    if args.backend == "cpu-decode":
        args.mode = "decode"
    torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.context, args.repeats = [1, 4], [128, 256], min(args.repeats, 2)
    modes = ["decode", "prefill"] if args.mode == "both" else [args.mode]
    elem = torch_dtype(normalize_dtype_name(args.dtype)).itemsize
    free = available_memory_bytes()
    max_gb = args.max_gb if free is None else min(args.max_gb, free / 2**30 / 2)  # inputs and outputs too
    rows: list[dict[str, object]] = []
    skipped: list[str] = []
    for mode in modes:
        for batch in args.batch:
            for context in args.context:
                kv_gb = 2 * 2 * batch * context * args.num_kv_heads * args.head_dim * elem / 2**30
                if kv_gb > max_gb:
                    skipped.append(f"{mode} batch={batch} context={context}: KV {kv_gb:.1f} GiB > --max-gb")
                    continue
                if mode == "prefill" and batch * context > args.prefill_max_tokens:
                    skipped.append(f"prefill batch={batch} context={context}: > --prefill-max-tokens")
                    continue
                rows.append(bench_shape(args, mode, batch, context))
    config = {
        "device": args.device,
        "dtype": normalize_dtype_name(args.dtype),
        "block_size": args.block_size,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "threads": args.threads,
        "repeats": args.repeats,
        "backend": args.backend or "auto",
        "isa": cpu_decode.isa() if args.backend == "cpu-decode" else None,
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps({"config": config, "results": rows, "skipped": skipped}, indent=2))
        return 0
    print("paged attention vs contiguous SDPA (" + ", ".join(f"{k}={v}" for k, v in config.items()) + ")")
    print(f"{'mode':8} {'batch':>5} {'context':>7} {'paged ms':>10} {'contig ms':>10} {'ratio':>7} {'max|diff|':>10}")
    for r in rows:
        print(
            f"{r['mode']:8} {r['batch']:>5} {r['context']:>7} {r['paged_ms']:>10.3f} {r['contiguous_ms']:>10.3f} "
            f"{r['ratio']:>7.3f} {r['max_abs_diff']:>10.2e}"
        )
    for line in skipped:
        print(f"skipped: {line}")
    return 0
