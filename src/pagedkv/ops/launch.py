"""Launch configuration of the Triton attention kernel: one pure function per choice, no torch, no triton.

Everything here is a function of (decode or not, GQA group, head dim, block size, cache dtype) and, for
the split count, of the grid and the longest context, so it is computed once per step (`pagedkv.ops.plan`)
and the compile test (`tests/ops/test_triton_compile.py`) can enumerate every specialization it can pick.

Heuristics (why each value). For comparison, the public Triton decoders pick similar shapes: SGLang's
grouped decode kernel (python/sglang/srt/layers/attention/triton_ops/decode_attention.py) packs 16 query
heads per program, loads 32-key tiles transposed, 4 warps, 2 stages, and splits KV across programs with a
second merge kernel; vLLM's unified attention (vllm/v1/attention/ops/triton_unified_attention.py) packs
(query token, head) rows into BLOCK_M = 16 (or the next power of two of the group) with 64-key tiles, and
has a segmented variant with a reduction for small grids. The 16-bit decode values are measured on an
H200; the others are not yet: `benchmarks/gpu_attention.py` and `benchmarks/gpu_decode_sweep.py` sweep them.

- `dim_pad = max(16, next_pow2(head_dim))`: `tl.arange` and `tl.dot` want powers of two >= 16; 80 and 96
  pad to 128 with a mask on the tail.
- rows: decode packs the GQA group into the M dimension of `tl.dot` (`block_q = 1`,
  `block_m = max(16, group_pad)`): the 16-row minimum of the tensor-core dot is paid with zero rows when
  the group is small; decode is bound by reading K/V, not by the dot. Prefill tiles `block_q` query tokens
  of one sequence times the group (`block_m = 64` rows), so each K/V tile is read once per 64 rows instead
  of once per query token. float32 caches dot in IEEE float32 on the FMA units with both operands in
  registers, so they get 16 prefill rows and 16-key tiles (larger ones spill on sm_80 and sm_90).
- decode over 16-bit caches (`block_m x dim_pad <= 16 x 128`): 16-key tiles, ONE warp, 5 stages, and
  enough splits for 16 programs per SM. Measured on an H200 (`benchmarks/gpu_decode_sweep.py`,
  docs/benchmarks.md "GPU"): against SDPA flash over contiguous KV, 0.70x at batch 64 / 4096, 0.69x at
  64 / 8192 (2 splits), 1.04x at batch 16 (32 splits), 1.20x at batch 1 (32 splits), where the 64-key,
  4-warp, 2-stage tile took 1.69-2.18x. Small programs, many of them, each streaming one page a step
  through a deep pipeline: decode is a gather of pages, and many loads in flight is what it needs.
- `tile_n` (key positions per loop step), every other call: 64 for head dims up to 128, 32 for 256 (K and V tiles of
  `tile_n x dim_pad` stay at 16 KiB each in 16-bit dtypes, what fits two pipeline stages in shared memory
  on sm_80 with room to spare); 16 for float32 caches.
- `block_size_const`: the block size when it is a power of two (the kernel then loads ONE table entry per
  block: a scalar when a block holds the whole key tile, a vector of `tile_n / block_size` ids otherwise),
  else 0 (runtime block size, the table read per key position; one compile for every odd size).
- `num_warps`: 4, or 8 once the accumulator reaches 8192 float32 values (64 rows x 128 dims; 4096 for
  float32 caches and for one-byte caches, whose tiles are converted and scaled in registers: an int8 prefill
  at head dim 64 with soft cap and sinks spills 16 bytes on sm_80 with 4 warps, none with 8), which keeps the
  per-thread registers below the spill line (the compile test fails on spills).
- `num_stages = 2`: double-buffered K/V loads; more stages buy little for a loop whose addresses come
  from the block table and cost shared memory the 256-dim tiles need.
- `num_splits` (flash-decoding): when (query tiles x KV heads) programs are fewer than twice the SM count
  (sixteen times for one-warp programs), split each tile's keys into a power of two of runs, each at least
  two key tiles long, at most 32.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_ROWS_MIN = 16  # tl.dot's smallest M
PREFILL_ROWS = 64
PREFILL_ROWS_FP32 = 16
MAX_SPLITS = 32
MIN_TILES_PER_SPLIT = 2
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_PROGRAMS_PER_SM_ONE_WARP = 16
DECODE_ONE_WARP_MAX_TILE = 16 * 128  # block_m x dim_pad of the one-warp decode (group <= 16, head dim <= 128)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Compile-time shape of one kernel specialization and its launch options."""

    block_q: int  # query tokens per tile
    block_m: int  # rows of the tile: block_q x group_pad, at least 16
    group_pad: int
    dim_pad: int
    tile_n: int  # key positions per loop step
    block_size_const: int  # the block size (power of two) or 0 (runtime)
    num_warps: int
    num_stages: int


def choose_launch(*, decode: bool, group: int, head_dim: int, block_size: int, cache_bits: int) -> LaunchConfig:
    """The kernel specialization for one call shape (see the module docstring for the reasons)."""
    group_pad = next_pow2(group)
    dim_pad = max(16, next_pow2(head_dim))
    fp32 = cache_bits == 32  # float32 dots run on FMA units (IEEE), with operands in registers
    block_q = 1 if decode else max(1, (PREFILL_ROWS_FP32 if fp32 else PREFILL_ROWS) // group_pad)
    block_m = max(DECODE_ROWS_MIN, block_q * group_pad)
    block_size_const = block_size if block_size & (block_size - 1) == 0 else 0
    if decode and cache_bits == 16 and block_m * dim_pad <= DECODE_ONE_WARP_MAX_TILE:
        return LaunchConfig(block_q, block_m, group_pad, dim_pad, 16, block_size_const, 1, 5)
    tile_n = 16 if fp32 else (64 if dim_pad <= 128 else 32)
    num_warps = 8 if block_m * dim_pad >= 8192 or (cache_bits in (8, 32) and block_m * dim_pad >= 4096) else 4
    return LaunchConfig(block_q, block_m, group_pad, dim_pad, tile_n, block_size_const, num_warps, 2)


def choose_num_splits(num_programs: int, max_context: int, tile_n: int, num_sms: int, num_warps: int = 4) -> int:
    """Splits per query tile: enough to give `num_sms` SMs two programs each (sixteen for one-warp programs),
    each split >= 2 key tiles."""
    if num_sms <= 0:
        return 1
    splits = 1
    target = (SPLIT_PROGRAMS_PER_SM_ONE_WARP if num_warps == 1 else SPLIT_PROGRAMS_PER_SM) * num_sms
    while (
        splits < MAX_SPLITS
        and num_programs * splits < target
        and max_context >= 2 * splits * MIN_TILES_PER_SPLIT * tile_n
    ):
        splits *= 2
    return splits


def num_tiles_upper_bound(num_q_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles to launch without knowing the per-sequence counts: every sequence may waste one."""
    if block_q == 1:
        return num_q_tokens
    return -(-num_q_tokens // block_q) + num_seqs
