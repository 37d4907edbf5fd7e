"""Every Triton kernel compiles to sm_80 and sm_90 cubins, without register spills, on a CPU.

The interpreter (tests/ops/test_triton.py) runs the kernels' Python, which accepts things the compiler
refuses (a module-level float read inside a kernel was one: every GPU call failed while the interpreter
passed). This test runs the real compiler: `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch,
32))` through ptxas to a cubin (Triton's CPU wheel ships ptxas and cuobjdump; no GPU is needed), for the
specializations the launch heuristics (`pagedkv.ops.launch`) can choose, with the constexprs built by the
same functions the launches use (`attention_constexprs`, `merge_constexprs`, `write_constexprs`).

Coverage without the cross product: per architecture, a covering set in which every value of every
dimension appears (decode/prefill; GQA groups 1-16; head dims 64/80/96/128/256; block sizes 1-256, i.e.
every power of two plus an odd size, which takes the runtime-block-size path; window, soft cap and
attention sinks on/off; float16/bfloat16/float32 caches, int8 caches with per-token-head and with per-block
scales (both targets), and fp8 (e4m3 per-tensor, e5m2 with per-token-head and per-block scales) on sm_90, the only target the dispatcher
sends fp8 to; split on/off), plus the register-heaviest corners (prefill, head dim 256, group 16, float32, every option on). A spill is
what cuobjdump reports as a stack frame or local memory (Triton's `n_spills` is that local size / 4).
Compiles are cached by Triton (~/.triton/cache): a warm rerun takes seconds.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from triton_compile_worker import compile_kernel, init_worker

from pagedkv.ops.dispatch import triton_available
from pagedkv.ops.launch import choose_launch

pytestmark = [
    pytest.mark.triton_compile,
    pytest.mark.skipif(not triton_available(), reason="needs triton (the CPU wheel is enough)"),
]

ARCHS = (80, 90)
GROUPS = tuple(range(1, 17))
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 24)  # 24: not a power of two (runtime block size)
DTYPES = ("float16", "bfloat16", "float32", "fp8")
TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int8": "i8", "fp8": "fp8e4nv",
                "fp8_e5m2": "fp8e5"}
CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALED = ("int8", "fp8_e5m2")  # quantized caches read with their per-token-head scale sidecar


@dataclass(frozen=True)
class Spec:
    arch: int
    decode: bool
    group: int
    head_dim: int
    block_size: int
    window: bool
    soft_cap: bool
    dtype: str
    split: bool
    sinks: bool = False
    block_scales: bool = False  # a scaled dtype's sidecar holds one scale per block and KV head

    def __str__(self) -> str:
        mode = "decode" if self.decode else "prefill"
        opts = "".join(c for c, on in (("w", self.window), ("c", self.soft_cap), ("s", self.split), ("k", self.sinks)) if on)
        blk = "-blk" if self.block_scales else ""
        return f"sm{self.arch}-{mode}-g{self.group}-d{self.head_dim}-bs{self.block_size}-{self.dtype}{blk}-{opts or 'plain'}"


def covering_specs() -> list[Spec]:
    """Per arch: config i takes value (i * step + offset) of each dimension, steps coprime with the
    dimension sizes, so every value of every dimension appears and pairs vary; plus the heavy corners."""
    specs: list[Spec] = []
    for arch in ARCHS:
        dtypes = DTYPES if arch >= 89 else DTYPES[:3]
        n = max(len(GROUPS), len(BLOCK_SIZES))
        for i in range(n):
            specs.append(
                Spec(
                    arch,
                    decode=i % 2 == 0,
                    group=GROUPS[(i * 7 + arch) % len(GROUPS)],
                    head_dim=HEAD_DIMS[(i * 3 + arch) % len(HEAD_DIMS)],
                    block_size=BLOCK_SIZES[(i * 3 + arch // 10) % len(BLOCK_SIZES)],
                    window=(i // 2) % 2 == 0,
                    soft_cap=(i // 4) % 2 == 0,
                    dtype=dtypes[(i + arch // 10) % len(dtypes)],
                    split=(i % 3) != 0,
                    sinks=(i // 8) % 2 == 0,
                )
            )
        for decode in (True, False):
            specs.append(Spec(arch, decode, 16, 256, 16, True, True, "float32", True, True))
        specs.append(Spec(arch, False, 16, 256, 256, False, False, "bfloat16", False))
        specs.append(Spec(arch, True, 16, 128, 16, True, True, "bfloat16", True, True))  # the one-warp decode's heaviest
        # quantized caches read with their scale sidecar: int8 everywhere, fp8 e5m2 where fp8 runs
        for i, dtype in enumerate(SCALED if arch >= 89 else ("int8",)):
            specs.append(Spec(arch, True, 4, 128, 16, i == 0, False, dtype, True))
            specs.append(Spec(arch, False, 8, 64, 32, False, i == 0, dtype, False, True))
            specs.append(Spec(arch, False, 16, 256, 24, True, True, dtype, True, True))  # heaviest, runtime block size
            # one scale per block: each block-size path (vector of blocks, one block, runtime size)
            specs.append(Spec(arch, True, 4, 128, 16, i == 0, False, dtype, True, block_scales=True))
            specs.append(Spec(arch, False, 8, 64, 256, False, i == 0, dtype, False, True, block_scales=True))
            specs.append(Spec(arch, False, 16, 256, 24, True, True, dtype, True, True, block_scales=True))
    return specs


SPECS = covering_specs()


def test_specs_cover_every_value() -> None:
    for arch in ARCHS:
        mine = [s for s in SPECS if s.arch == arch]
        assert {s.group for s in mine} == set(GROUPS)
        assert {s.head_dim for s in mine} == set(HEAD_DIMS)
        assert {s.block_size for s in mine} == set(BLOCK_SIZES)
        assert {s.dtype for s in mine} == set((*DTYPES, *SCALED) if arch >= 89 else (*DTYPES[:3], "int8"))
        assert {s.dtype for s in mine if s.block_scales} == set(SCALED if arch >= 89 else ("int8",))
        for attr in ("decode", "window", "soft_cap", "split", "sinks"):
            assert {getattr(s, attr) for s in mine} == {True, False}, attr


@pytest.fixture(scope="module")
def compiler() -> Iterator[Callable[..., dict[str, int]]]:
    """Submit compiles to two spawned worker processes (without TRITON_INTERPRET); return a checker."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx, initializer=init_worker) as pool:

        def check(kernel_name: str, types: dict[str, str], constexprs: dict[str, object], arch: int,
                  options: dict[str, int]) -> dict[str, int]:
            usage: dict[str, int] = pool.submit(compile_kernel, kernel_name, types, constexprs, arch, options).result()
            assert usage.get("STACK", 0) == 0 and usage.get("LOCAL", 0) == 0, (
                f"register spills on sm_{arch}: {usage} ({kernel_name}, {constexprs}, {options})"
            )
            return usage

        yield check


POINTERS = {"block_table_ptr": "*i32", "tile_seq_ptr": "*i32", "tile_q_start_ptr": "*i32", "tile_q_len_ptr": "*i32",
            "tile_pos_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
            "sinks_ptr": "*fp32", "scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "soft_cap": "fp32"}


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_attention_kernel_compiles(spec: Spec, compiler: Callable[..., dict[str, int]]) -> None:
    from pagedkv.ops import triton_kernels as tk

    cache_dtype = CACHE_DTYPES.get(spec.dtype) or getattr(torch, spec.dtype)
    query_dtype = torch.bfloat16 if spec.dtype in CACHE_DTYPES else cache_dtype
    cfg = choose_launch(decode=spec.decode, group=spec.group, head_dim=spec.head_dim, block_size=spec.block_size,
                        cache_bits=cache_dtype.itemsize * 8)
    constexprs = tk.attention_constexprs(cfg, spec.head_dim, window=spec.window, soft_cap=spec.soft_cap,
                                         query_dtype=query_dtype, cache_dtype=cache_dtype, split=spec.split,
                                         sinks=spec.sinks, kv_scales=spec.dtype in SCALED,
                                         block_scales=spec.block_scales)
    # The runtime JIT turns integer arguments equal to 1 into constants; do the same for those a spec fixes.
    for name, value in (("group", spec.group), ("block_size", spec.block_size)):
        if value == 1:
            constexprs = {**constexprs, name: 1}
    if not spec.split:
        constexprs = {**constexprs, "num_splits": 1}
    qt, ct = TRITON_TYPES["bfloat16" if spec.dtype in CACHE_DTYPES else spec.dtype], TRITON_TYPES[spec.dtype]
    types = dict(POINTERS, q_ptr=f"*{qt}", out_ptr=f"*{qt}", key_cache_ptr=f"*{ct}", value_cache_ptr=f"*{ct}",
                 kv_scales_ptr="*fp32")
    compiler("_paged_attention_kernel", types, constexprs, spec.arch,
             {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


MERGE_CASES = [(arch, head_dim, splits, head_dim in (80, 256)) for arch in ARCHS for head_dim, splits in
               zip((64, 80, 96, 128, 256), (2, 4, 8, 16, 32), strict=True)]


@pytest.mark.parametrize("arch,head_dim,num_splits,sinks", MERGE_CASES)
def test_merge_kernel_compiles(arch: int, head_dim: int, num_splits: int, sinks: bool,
                               compiler: Callable[..., dict[str, int]]) -> None:
    from pagedkv.ops import triton_kernels as tk

    cfg = choose_launch(decode=True, group=4, head_dim=head_dim, block_size=16, cache_bits=16)
    types = {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sinks_ptr": "*bf16", "out_ptr": "*bf16",
             "num_heads": "i32", "num_splits": "i32", "stride_o_token": "i32", "stride_o_head": "i32"}
    compiler("_merge_splits_kernel", types, tk.merge_constexprs(cfg, head_dim, num_splits, sinks=sinks), arch,
                      {"num_warps": 4, "num_stages": 2})


WRITE_CASES = [(arch, kv_heads, head_dim, dtype) for arch in ARCHS for kv_heads, head_dim, dtype in
               ((1, 64, "float16"), (8, 128, "bfloat16"), (4, 80, "float32"), (32, 96, "bfloat16"), (8, 256, "float16"))]


@pytest.mark.parametrize("arch,num_kv_heads,head_dim,dtype", WRITE_CASES)
def test_write_kernel_compiles(arch: int, num_kv_heads: int, head_dim: int, dtype: str,
                               compiler: Callable[..., dict[str, int]]) -> None:
    from pagedkv.ops import triton_kernels as tk

    t = f"*{TRITON_TYPES[dtype]}"
    types = {"key_ptr": t, "value_ptr": t, "key_cache_ptr": t, "value_cache_ptr": t, "slot_ptr": "*i64",
             "stride_k_token": "i32", "stride_k_head": "i32", "stride_v_token": "i32", "stride_v_head": "i32"}
    compiler("_write_kv_kernel", types, tk.write_constexprs(num_kv_heads, head_dim), arch,
                      {"num_warps": 4, "num_stages": 2})


WRITE_CODES_CASES = [(arch, kv_heads, head_dim, dtype) for arch in ARCHS for kv_heads, head_dim, dtype in
                     ((1, 64, "bfloat16"), (8, 128, "float16"), (3, 80, "float32"), (32, 256, "bfloat16"))]


@pytest.mark.parametrize("arch,num_kv_heads,head_dim,dtype", WRITE_CODES_CASES)
def test_quantizing_write_kernel_compiles(arch: int, num_kv_heads: int, head_dim: int, dtype: str,
                                          compiler: Callable[..., dict[str, int]]) -> None:  # fmt: skip
    from pagedkv.ops import triton_kernels as tk

    t = f"*{TRITON_TYPES[dtype]}"
    types = {"key_ptr": t, "value_ptr": t, "key_cache_ptr": "*i8", "value_cache_ptr": "*i8", "scales_ptr": "*fp32",
             "slot_ptr": "*i64", "stride_k_token": "i32", "stride_k_head": "i32", "stride_v_token": "i32",
             "stride_v_head": "i32", "scales_half": "i32"}  # fmt: skip
    compiler("_write_kv_codes_kernel", types, tk.write_codes_constexprs(num_kv_heads, head_dim, torch.int8), arch,
             {"num_warps": 4, "num_stages": 2})
