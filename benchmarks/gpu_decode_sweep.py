"""Decode launch sweep on a GPU: the paged Triton kernel's time per (split count, tile_n, warps, stages) at the
decode goal's shapes (bf16, 32 query / 8 KV heads, head dim 128, block size 16), against SDPA flash over the
same KV laid out contiguously: data for `pagedkv.ops.launch`'s heuristics where `gpu_attention.py`'s table
misses the goal.

    python benchmarks/gpu_decode_sweep.py --json sweep.json

Each line: the configuration, its median time over 10 CUDA-event timings, and its ratio to SDPA at that shape;
the best configuration per shape closes each block. A configuration that does not compile is reported and
skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from typing import Any

import torch
from gpu_attention import add_shape_arguments, contiguous_sdpa, cuda_time_ms, decode_inputs

from pagedkv.ops import paged_attention
from pagedkv.ops.contiguous_oracle import gather_kv
from pagedkv.ops.plan import plan_attention

SHAPES = {  # (batch, context): split counts tried
    (64, 4096): (1, 2, 4),
    (64, 8192): (1, 2, 4),
    (16, 4096): (2, 4, 8, 16),
    (1, 4096): (8, 16, 32),
}


def sweep_shape(
    batch: int, context: int, splits: tuple[int, ...], args: argparse.Namespace
) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    a = decode_inputs(
        batch, context, args.num_heads, args.num_kv_heads, args.head_dim, dtype, args.block_size
    )
    keys, values = gather_kv(a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"])
    k, v = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    del keys, values
    q4 = a["query"][:, :, None, :]
    sdpa_ms = cuda_time_ms(lambda: contiguous_sdpa(q4, k, v))
    base = plan_attention(*a.values(), max_seqlen_q=1, max_seqlen_k=context, backend="triton")
    assert base.triton is not None
    default_ms = cuda_time_ms(lambda: paged_attention(**a, plan=base), repeats=10)
    print(
        f"batch {batch} context {context}: sdpa {sdpa_ms:.3f} ms; default {base.triton.config} "
        f"splits={base.triton.num_splits}: {default_ms:.3f} ms ({default_ms / sdpa_ms:.2f}x)",
        flush=True,
    )
    rows = []
    for n, tile_n, warps, stages in itertools.product(splits, (32, 64), (2, 4), (2, 3, 4)):
        cfg = replace(base.triton.config, tile_n=tile_n, num_warps=warps, num_stages=stages)
        try:
            plan = plan_attention(
                *a.values(), max_seqlen_q=1, max_seqlen_k=context, backend="triton", num_splits=n, launch=cfg
            )
            ms = cuda_time_ms(lambda plan=plan: paged_attention(**a, plan=plan), repeats=10)
        except Exception as exc:  # a configuration may not compile (registers, shared memory)
            print(
                f"  splits={n} tile_n={tile_n} warps={warps} stages={stages}: failed ({type(exc).__name__})"
            )
            continue
        rows.append(
            {"splits": n, "tile_n": tile_n, "warps": warps, "stages": stages, "ms": ms, "ratio": ms / sdpa_ms}
        )
        print(
            f"  splits={n} tile_n={tile_n} warps={warps} stages={stages}: {ms:.3f} ms ({ms / sdpa_ms:.2f}x)",
            flush=True,
        )
    best = min(rows, key=lambda r: r["ms"]) if rows else None
    if best is not None:
        print(f"  best: {best}", flush=True)
    return {
        "batch": batch,
        "context": context,
        "sdpa_ms": sdpa_ms,
        "default_ms": default_ms,
        "default": repr(base.triton.config),
        "default_splits": base.triton.num_splits,
        "rows": rows,
        "best": best,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    results = [sweep_shape(b, c, s, args) for (b, c), s in SHAPES.items()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
