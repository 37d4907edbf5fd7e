"""The fused Llama forward (pagedkv.hf.fused_llama): bit-identical to transformers' forward in float32, for
every step shape the engine runs (chunked prefill, decode batches, prefix hits), and the model stays usable."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import Engine
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.hf.fused_llama import FusedLlama, fuse_llama
from pagedkv.hf.tiny import tiny_model

PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 2, 9, 13], [4, 4, 6], [5, 9, 2, 7, 11, 3, 8, 1, 4, 7, 7]]


def _logits(model, forward: str, **config) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's logits and the greedy tokens of PROMPTS under `forward`."""
    engine = Engine(model, None, EngineConfig(num_blocks=64, block_size=4, model_forward=forward, **config))
    seen: list[torch.Tensor] = []
    run = engine.runner.forward

    def record(batches):
        out = run(batches)
        seen.append(out.clone())
        return out

    engine.runner.forward = record
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert (engine.runner.fused is not None) == (forward == "fused")
    return seen, [o.output_token_ids for o in outs]


@pytest.mark.parametrize("chunk", [512, 5])  # whole prompts, and prefill chunks of 5 tokens beside decodes
def test_fused_forward_is_bit_identical_to_transformers_in_float32(chunk: int) -> None:
    model = tiny_model("llama", 0)
    sched = SchedulerConfig(max_num_batched_tokens=chunk)
    # torch's linear: oneDNN's packed GEMMs (the float32 default) sum in another order than nn.Linear
    ref_logits, ref_tokens = _logits(model, "transformers", scheduler=sched, linear_backend="torch")
    got_logits, got_tokens = _logits(model, "fused", scheduler=sched, linear_backend="torch")
    assert got_tokens == ref_tokens
    assert len(got_logits) == len(ref_logits)
    for got, ref in zip(got_logits, ref_logits):
        assert torch.equal(got, ref)


def test_the_model_keeps_working_after_fusing() -> None:
    model = tiny_model("llama", 0)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    fused = fuse_llama(model)
    assert isinstance(fused, FusedLlama)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)  # the same weights, now views into the fused tensors


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gpt2", "qwen3", "phi3"])
def test_other_families_run_transformers_forward(family: str) -> None:
    model = tiny_model(family, 0)
    assert fuse_llama(model) is None
    engine = Engine(model, None, EngineConfig(num_blocks=64, block_size=4))
    assert engine.runner.fused is None
    with pytest.raises(InvalidArgumentError, match="model_forward 'fused'"):
        Engine(model, None, EngineConfig(num_blocks=64, block_size=4, model_forward="fused"))


def test_engine_config_refuses_an_unknown_forward() -> None:
    with pytest.raises(InvalidArgumentError, match="model_forward"):
        EngineConfig(num_blocks=8, model_forward="compiled")  # type: ignore[arg-type]


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="no oneDNN bf16 on this CPU",
)
def test_fused_bf16_on_onednn_tracks_transformers() -> None:
    model = tiny_model("llama", 0).to(torch.bfloat16)
    ref_logits, _ = _logits(model, "transformers", linear_backend="torch")
    got_logits, _ = _logits(model, "fused", linear_backend="onednn")
    for got, ref in zip(got_logits, ref_logits):
        torch.testing.assert_close(got.float(), ref.float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_layer_ops_track_torchs_operations(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a packed backend the element-wise parts run in C (pagedkv.hf.layer_ops); every step's logits stay
    within rounding of the same forward over torch's operations, and the greedy tokens are the same."""
    from pagedkv.hf import layer_ops

    if not layer_ops.available():
        pytest.skip("pagedkv.hf._cpu_layer is not built")
    onednn = torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    backend = "onednn" if onednn else "invariant"  # both packed: the C ops run on either
    model = tiny_model("llama", 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms that differ from each other (the tiny model's start as ones)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
    model = model.to(dtype)
    calls = []
    real = FusedLlama._run_layer_ops
    monkeypatch.setattr(FusedLlama, "_run_layer_ops", lambda self, *a: calls.append(1) or real(self, *a))
    got_logits, got_tokens = _logits(model, "fused", linear_backend=backend)
    assert calls, "the C layer ops did not run"
    monkeypatch.setattr(FusedLlama, "_layer_ops", lambda self, x: None)  # torch's operations
    ref_logits, ref_tokens = _logits(model, "fused", linear_backend=backend)
    assert got_tokens == ref_tokens
    tol = dict(atol=1e-4, rtol=1e-4) if dtype is torch.float32 else dict(atol=0.1, rtol=0.05)
    for got, ref in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(got.float(), ref.float(), **tol)
