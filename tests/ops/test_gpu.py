"""GPU-only checks (marker `gpu`): the compiled Triton kernels against the reference on CUDA tensors, and a
whole engine step through them. Skipped, with the reason, where there is no CUDA device; the CPU suite
covers the same kernels through the interpreter (test_triton.py) and the compiler (test_triton_compile.py).

Run on a GPU with `TRITON_INTERPRET=0 pytest -m gpu tests/ops/test_gpu.py` (benchmarks/gpu_all.sh does).
"""

from __future__ import annotations

import os

import pytest
import torch
from ops_batch import make_batch, random_lengths

from pagedkv.ops import paged_attention, write_kv
from pagedkv.ops.plan import plan_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="set TRITON_INTERPRET=0 to run the compiled kernels"),
]

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _cuda(batch):  # type: ignore[no-untyped-def]
    return [t.cuda() for t in batch.args()]


GPU_CASES = [  # dtype, block_size, max_q, window, soft_cap, forced splits: every value of each, not the product
    (torch.bfloat16, 16, 1, None, None, None),
    (torch.bfloat16, 16, 1, None, None, 8),
    (torch.float16, 256, 1, 100, None, None),
    (torch.float32, 7, 1, None, 30.0, 2),
    (torch.bfloat16, 1, 40, 33, None, None),
    (torch.float16, 16, 40, None, 30.0, 4),
    (torch.float32, 256, 9, None, None, None),
    (torch.bfloat16, 7, 9, 50, 20.0, None),
]


@pytest.mark.parametrize("dtype,block_size,max_q,window,cap,splits", GPU_CASES)
def test_compiled_kernel_matches_reference(dtype, block_size, max_q, window, cap, splits):  # type: ignore[no-untyped-def]
    lens, q_lens = random_lengths(block_size, 5, 700, max_q)
    batch = make_batch(block_size, lens, q_lens, block_size=block_size, group=4, num_kv_heads=2, head_dim=128,
                       dtype=dtype)
    args = _cuda(batch)
    ref = paged_attention(*args, sliding_window=window, soft_cap=cap, backend="reference")
    plan = plan_attention(*args, max_seqlen_q=max(q_lens), backend="triton", num_splits=splits)
    out = paged_attention(*args, sliding_window=window, soft_cap=cap, plan=plan)
    assert not out.isnan().any(), "read a poisoned slot"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA device of compute capability >= 8.9 (Triton has no fp8 e4m3 below)")
def test_compiled_kernel_reads_fp8_caches() -> None:
    from pagedkv.storage.slots import quantize_fp8

    lens, q_lens = random_lengths(5, 4, 600, 3)
    batch = make_batch(5, lens, q_lens, block_size=16, group=4, head_dim=128, dtype=torch.bfloat16)
    q, kc, vc, *rest = _cuda(batch)
    k8, v8 = quantize_fp8(kc.nan_to_num(0.0), 0.05), quantize_fp8(vc.nan_to_num(0.0), 0.02)
    ref = paged_attention(q, k8, v8, *rest, k_scale=0.05, v_scale=0.02, backend="reference")
    out = paged_attention(q, k8, v8, *rest, k_scale=0.05, v_scale=0.02, backend="triton")
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_compiled_write_is_bit_exact() -> None:
    caches = [torch.full((32, 16, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    slots = torch.randperm(32 * 16, device="cuda")[:200]
    key = torch.randn((200, 4, 128), device="cuda").to(torch.bfloat16)
    write_kv(caches[0], caches[1], key, key, slots, backend="reference")
    write_kv(caches[2], caches[3], key, key, slots, backend="triton")
    assert torch.equal(caches[0].view(torch.int16), caches[2].view(torch.int16))


@pytest.mark.parametrize("block_size,max_q", [(16, 1), (256, 9), (7, 40)])
def test_compiled_kernel_reads_int8_codes_with_block_scales(block_size: int, max_q: int) -> None:
    """One scale per block and KV head (`BLOCK_SCALES`), written on CUDA by the reference block rule."""
    from pagedkv.storage.block_scales import block_writes

    lens, q_lens = random_lengths(block_size, 4, 600, max_q)
    batch = make_batch(block_size, lens, q_lens, block_size=block_size, group=4, head_dim=128)
    q, kc, vc, *rest = _cuda(batch)
    live = ~kc.isnan().any(dim=-1)
    k8, v8 = torch.zeros_like(kc, dtype=torch.int8), torch.zeros_like(vc, dtype=torch.int8)
    scales = torch.ones((2, kc.shape[0], 1, kc.shape[2]), device="cuda")
    slots = live.any(dim=-1).view(-1).nonzero().squeeze(1)
    rows = (kc.view(-1, *kc.shape[2:])[slots], vc.view(-1, *vc.shape[2:])[slots])
    write_kv(k8, v8, *rows, slots, kv_scales=scales)  # the reference's block rule, on CUDA
    assert block_writes(slots, block_size).blocks.numel() == int(live.any(dim=(1, 2)).sum())
    ref = paged_attention(q, k8, v8, *rest, kv_scales=scales, backend="reference")
    out = paged_attention(q, k8, v8, *rest, kv_scales=scales, backend="triton")
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2-sw"])
def test_engine_greedy_on_cuda_matches_generate(family: str) -> None:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.params import SamplingParams
    from pagedkv.hf.oracle import reference_generate
    from pagedkv.hf.tiny import tiny_model

    model = tiny_model(family).cuda()
    prompts = [[5, 9, 17, 3, 44, 8], list(range(3, 40)), [7] * 21]
    expected = reference_generate(model, prompts, 12, eos_token_id=2, attn_implementation="eager")
    engine = Engine(model, config=EngineConfig(num_blocks=64, block_size=16, attention_backend="ops"))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [o.output_token_ids for o in outs] == expected
