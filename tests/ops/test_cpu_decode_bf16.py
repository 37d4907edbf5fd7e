"""The C decode kernel over bfloat16 pages (`pagedkv.ops.cpu_decode`): the float32 kernel's answer over the
pages upcast, close to the reference op, and its refusals."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from native_policy import require_native
from test_cpu_decode import ISAS, make_case

from pagedkv import ops
from pagedkv.core.errors import InvalidArgumentError
from pagedkv.ops import cpu_decode
from pagedkv.ops.options import AttentionOptions

require_native("pagedkv.ops._cpu_decode", cpu_decode.isa() is not None)


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each compiled copy this machine can run, switched in for the test and back after."""
    before = cpu_decode.isa()
    assert before is not None
    cpu_decode.set_isa(request.param)
    yield request.param
    cpu_decode.set_isa(before)


def bf16_case(
    lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_case's tensors with a bfloat16 query and bfloat16 pages."""
    q, kv, table, seq_lens = make_case(lens, heads, kv_heads, dim, block_size, seed)
    return q.bfloat16(), kv.bfloat16(), table, seq_lens


@pytest.mark.parametrize("seed", range(10))
def test_is_the_float32_kernel_over_the_upcast_pages(seed: int, isa: str) -> None:
    """Bitwise, in float32 (the kernel's own output) and after rounding to bfloat16, for GQA, windows, head
    sizes with and without a tail of the 8 partial sums."""
    rng = np.random.default_rng(seed)
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 3, 4]))
    dim = int(rng.choice([5, 8, 64, 72]))
    block_size = int(rng.choice([1, 4, 16]))
    lens = rng.integers(1, 90, size=int(rng.integers(1, 9))).tolist()
    options = AttentionOptions(0.2, [None, 1, 7, 50][seed % 4])
    q, kv, table, seq_lens = bf16_case(lens, heads, kv_heads, dim, block_size, seed)
    got = cpu_decode.decode_attention(q, kv, table, seq_lens, options)
    want = cpu_decode.decode_attention(q.float(), kv.float(), table, seq_lens, options)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())
    native = cpu_decode._NATIVE
    assert native is not None
    raw = torch.empty(q.shape)
    native.decode_bf16(q.float().numpy(), kv.view(torch.int16).numpy(), table.numpy(), seq_lens.numpy(),
                       raw.numpy(), 0.2, int(options.sliding_window or 0))  # fmt: skip
    assert torch.equal(raw, want)


@pytest.mark.parametrize("window", [None, 9])
def test_is_close_to_the_reference_in_bf16(window: int | None, isa: str) -> None:
    """Against `pagedkv.ops.paged_attention` in bfloat16: within 2 bf16 ulps (2 * 2^-8 relative) plus 1e-2
    absolute, the reference rounding its own softmax weights to bfloat16."""
    q, kv, table, seq_lens = bf16_case([1, 9, 64, 100, 17, 8], 12, 4, 64, 16, 6)
    got = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.125, window))
    cu = torch.arange(7, dtype=torch.int32)
    ref = ops.paged_attention(q, kv[0], kv[1], table, seq_lens, cu, scale=0.125, sliding_window=window,
                              backend="reference")  # fmt: skip
    assert ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=2 * 2**-8)


def test_the_copies_agree_bitwise() -> None:
    """The vector copy and the portable copy give the same bits over bfloat16 pages as over float32 ones
    (each against its own float32 answer), and agree with each other to float32 rounding."""
    q, kv, table, seq_lens = bf16_case([1, 9, 64, 100, 17, 8], 12, 4, 128, 16, 6)
    options = AttentionOptions(0.09, 70)
    before = cpu_decode.isa()
    assert before is not None
    outs = []
    try:
        for name in ISAS:
            cpu_decode.set_isa(name)
            got = cpu_decode.decode_attention(q, kv, table, seq_lens, options)
            assert torch.equal(
                got, cpu_decode.decode_attention(q.float(), kv.float(), table, seq_lens, options).bfloat16()
            )
            outs.append(got)
    finally:
        cpu_decode.set_isa(before)
    for out in outs[1:]:
        torch.testing.assert_close(out.float(), outs[0].float(), atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_group_cut_across_threads_is_bit_identical_to_one_thread(threads: int) -> None:
    lens = [5, 30, 17, 1, 64, 33, 9, 12, 40, 7, 3, 21, 50]
    q, kv, table, seq_lens = bf16_case(lens, 6, 3, 16, 4, 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.25, 20))
        torch.set_num_threads(threads)
        cut = cpu_decode.decode_attention(q, kv, table, seq_lens, AttentionOptions(0.25, 20))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, cut)


def test_available_for_bf16_query_with_bf16_pages_only() -> None:
    q, kv, _, _ = bf16_case([5, 30], 6, 3, 16, 4, 2)
    assert cpu_decode.available(q, kv)
    assert not cpu_decode.available(q.float(), kv)  # mixed dtypes: SDPA or pagedkv.ops upcasts
    assert not cpu_decode.available(q, kv.float())
    assert not cpu_decode.available(q.clone().requires_grad_(), kv)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, kv, t, s: (q.float(), kv, t, s), "bfloat16 query goes with bfloat16 pages"),
        (lambda q, kv, t, s: (q, kv.float(), t, s), "bfloat16 query goes with bfloat16 pages"),
        (lambda q, kv, t, s: (q, kv, t, s.clone().fill_(0)), "seq_lens"),
        (lambda q, kv, t, s: (q, kv, t.clone().fill_(10_000), s), "block_table"),
        (lambda q, kv, t, s: (q[:, :3], kv, t, s), "shapes"),  # 3 heads over 2 KV heads
    ],
)
def test_bad_arguments_raise_one_typed_error(change: object, match: str) -> None:
    q, kv, table, seq_lens = bf16_case([9, 14], 4, 2, 8, 4, 1)
    args = change(q, kv, table, seq_lens)  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=match):
        cpu_decode.decode_attention(*args, AttentionOptions(0.5))


def test_the_native_entry_refuses_float32_pages() -> None:
    q, kv, table, seq_lens = make_case([9, 14], 4, 2, 8, 4, 1)
    native = cpu_decode._NATIVE
    assert native is not None
    out = torch.empty(q.shape)
    with pytest.raises(TypeError, match="int16"):
        native.decode_bf16(q.numpy(), kv.numpy(), table.numpy(), seq_lens.numpy(), out.numpy(), 0.5, 0)
