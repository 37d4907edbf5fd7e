"""`pagedkv.hf.layer_ops`: the C element-wise layer parts against torch's operations, checks, thread counts."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf import layer_ops

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="pagedkv.hf._cpu_layer is not built")

SIZES = dict(hidden=72, heads=4, kv_heads=2, head_dim=16, intermediate=40, eps=1e-5)


def _ops(rows: int, dtype: torch.dtype, threads: int = 1) -> layer_ops.LayerOps:
    ops = layer_ops.LayerOps.for_rows(rows, dtype, threads=threads, **SIZES)
    assert ops is not None
    return ops


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between same-signed bfloat16/float32 values."""
    if a.dtype is torch.bfloat16:
        ia, ib = a.view(torch.int16).to(torch.int64), b.view(torch.int16).to(torch.int64)
    else:
        ia, ib = a.view(torch.int32).to(torch.int64), b.view(torch.int32).to(torch.int64)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_each_op_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    ops = _ops(rows, dtype)
    h, nh, nkv, d, inter = SIZES["hidden"], SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"], SIZES["intermediate"]
    x = torch.randn(rows, h, generator=g).to(dtype)
    delta = torch.randn(rows, h, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    want_x = x + delta
    want_h = _torch_norm(want_x, weight, SIZES["eps"])
    got_h = ops.norm(x, delta, weight)
    assert torch.equal(x, want_x)  # the residual add: bit for bit
    assert _ulps(got_h, want_h) <= (1 if dtype is torch.bfloat16 else 4)

    qkv = torch.randn(rows, (nh + 2 * nkv) * d, generator=g).to(dtype)
    angles = torch.rand(rows, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    q, k, v = ops.rope(qkv, cos, sin)
    c3, s3 = cos.unsqueeze(1), sin.unsqueeze(1)
    assert torch.equal(q, _torch_rope(qkv[:, : nh * d].view(rows, nh, d), c3, s3))
    assert torch.equal(k, _torch_rope(qkv[:, nh * d : (nh + nkv) * d].view(rows, nkv, d), c3, s3))
    assert torch.equal(v, qkv[:, (nh + nkv) * d :].reshape(rows, nkv, d))

    gate_up = (3 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype is torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_threads_or_the_other_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    rows = 11
    x = torch.randn(rows, SIZES["hidden"], generator=g).to(dtype)
    weight = torch.randn(SIZES["hidden"], generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * SIZES["intermediate"], generator=g).to(dtype)
    results = []
    for threads in (1, 2, 3, 16):
        ops = _ops(rows, dtype, threads)
        results.append((ops.norm(x.clone(), x, weight).clone(), ops.silu_mul(gate_up).clone()))
    for norm, act in results[1:]:
        assert torch.equal(norm, results[0][0]) and torch.equal(act, results[0][1])
    alone = _ops(1, dtype)
    assert torch.equal(alone.norm(x[4:5].clone(), x[4:5], weight), results[0][0][4:5])
    assert torch.equal(alone.silu_mul(gate_up[4:5].contiguous()), results[0][1][4:5])


def test_bad_tensors_are_refused_before_anything_is_written() -> None:
    ops = _ops(3, torch.float32)
    x = torch.randn(3, SIZES["hidden"])
    before = x.clone()
    weight = torch.ones(SIZES["hidden"])
    for bad in (torch.randn(3, SIZES["hidden"]).to(torch.bfloat16), torch.randn(4, SIZES["hidden"]),
                torch.randn(SIZES["hidden"], 3).t(), [0.0]):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match="delta"):
            ops.norm(x, bad, weight)  # type: ignore[arg-type]
    assert torch.equal(x, before)
    with pytest.raises(InvalidArgumentError, match="qkv"):
        ops.rope(torch.randn(3, 5), torch.ones(3, 16), torch.ones(3, 16))
    with pytest.raises(InvalidArgumentError, match="head_dim even"):
        layer_ops.LayerOps.for_rows(2, torch.float32, **{**SIZES, "head_dim": 15})
    assert layer_ops.LayerOps.for_rows(2, torch.float16, **SIZES) is None
