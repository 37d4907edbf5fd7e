"""oneDNN-packed linear layers (pagedkv.hf.cpu_linear): equal to nn.Linear up to summation order, any shape."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.hf.cpu_linear import (
    TILE_ROWS,
    PackedLinear,
    choose_linear_backend,
    cpu_bf16_support,
    describe_weights,
    pack_linears,
    padded_rows,
    resolve_dtype,
    row_calls,
)
from pagedkv.hf.tiny import tiny_model

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 48),
        (3, 48),
        (17, 48),
        (64, 48),
        (129, 48),
        (200, 48),
        (256, 48),
        (600, 48),
        (1, 5, 48),
        (3, 7, 48),
    ],
)
def test_packed_linear_equals_nn_linear(dtype: torch.dtype, bias: bool, shape: tuple[int, ...]) -> None:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 on this CPU")
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    expected = linear(x)
    got = PackedLinear(linear.weight, linear.bias)(x)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_row_calls_cover_every_row_once_with_a_bounded_set_of_row_counts() -> None:
    seen = set()
    for rows in range(1, 2049):
        calls = row_calls(rows)
        covered = [r for start, count in calls for r in range(start, start + count)]
        assert covered == list(range(rows))
        for _, count in calls:
            padded = padded_rows(count)
            assert count <= padded < count + 16 and padded <= TILE_ROWS
            seen.add(padded)
    assert len(seen) <= 38  # the primitives oneDNN caches per weight, whatever the batch mix


@needs_onednn
def test_pack_linears_replaces_every_projection_and_keeps_the_logits() -> None:
    model = tiny_model("llama", 0)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model) == n_linear > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert pack_linears(model) == 0  # idempotent


def test_choose_linear_backend() -> None:
    assert choose_linear_backend("torch", torch.bfloat16, CPU) == "torch"
    assert choose_linear_backend("torch", torch.float32, CPU) == "torch"  # bitwise nn.Linear when asked
    assert choose_linear_backend("auto", torch.float32, CPU) == "onednn"  # fp32: oneDNN's packed GEMMs by default
    assert choose_linear_backend("auto", torch.float16, CPU) == "torch"
    expected = "onednn" if cpu_bf16_support() else "torch"
    assert choose_linear_backend("auto", torch.bfloat16, CPU) == expected
    assert choose_linear_backend("auto", torch.bfloat16, torch.device("cuda")) == "torch"
    with pytest.raises(InvalidArgumentError, match="linear_backend"):
        choose_linear_backend("fast", torch.float32, CPU)
    with pytest.raises(InvalidArgumentError, match="CPU models"):
        choose_linear_backend("onednn", torch.float32, torch.device("cuda"))


def test_resolve_and_describe_dtype() -> None:
    assert resolve_dtype("float32") == "float32" and resolve_dtype(None) is None
    assert resolve_dtype("auto") == ("bfloat16" if cpu_bf16_support() else None)
    line = describe_weights("auto", torch.bfloat16, "onednn")
    assert line.startswith("bfloat16 weights (auto: ") and line.endswith("oneDNN-packed linear")
    assert describe_weights("float32", torch.float32, "torch") == "float32 weights, torch linear"


def test_engine_config_refuses_an_unknown_linear_backend() -> None:
    with pytest.raises(InvalidArgumentError, match="linear_backend"):
        EngineConfig(num_blocks=8, linear_backend="fast")  # type: ignore[arg-type]


@needs_onednn
def test_engine_on_packed_linears_generates_what_nn_linear_does() -> None:
    prompts = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 6]]
    params = SamplingParams(max_new_tokens=8)
    outputs = {}
    for backend in ("torch", "onednn"):
        engine = Engine(
            tiny_model("llama", 0), None, EngineConfig(num_blocks=32, block_size=4, linear_backend=backend)
        )
        assert engine.linear_backend == backend
        outputs[backend] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert outputs["onednn"] == outputs["torch"]


@needs_onednn
def test_engine_auto_packs_bf16_weights_where_the_cpu_has_bf16() -> None:
    model = tiny_model("llama", 0).to(torch.bfloat16)
    engine = Engine(model, None, EngineConfig(num_blocks=32, block_size=4))
    assert engine.linear_backend == ("onednn" if cpu_bf16_support() else "torch")
    out = engine.generate([[5, 9, 2, 7]], SamplingParams(max_new_tokens=4))
    assert len(out[0].output_token_ids) == 4
