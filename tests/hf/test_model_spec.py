"""Model shape from the config, and clear refusals for models pagedkv cannot serve."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf.attention import ATTENTION_NAME, prepare_model
from pagedkv.hf.model_spec import UnsupportedModelError, check_supported, model_spec
from pagedkv.hf.tiny import tiny_model


def test_spec_reads_config() -> None:
    spec = model_spec(tiny_model("mistral"))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.sliding_windows == (7, 7)
    assert spec.dtype_name == "float32"
    assert spec.kv_cache_spec().bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_spec_per_layer_windows_and_softcap() -> None:
    assert model_spec(tiny_model("qwen2-sw")).sliding_windows == (None, 6)
    gemma = model_spec(tiny_model("gemma2"))
    assert gemma.soft_cap == 5.0
    assert gemma.head_dim == 16


def test_gpt2_without_kv_heads_uses_attention_heads() -> None:
    spec = model_spec(tiny_model("gpt2"))
    assert spec.num_kv_heads == spec.num_heads == 4


def test_refuses_model_without_attention_interface() -> None:
    import transformers as tf

    model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        check_supported(model)


def test_refuses_encoder_decoder() -> None:
    import transformers as tf

    model = tf.T5ForConditionalGeneration(
        tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    )
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        check_supported(model)


def test_refuses_unknown_layer_type() -> None:
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        check_supported(model)


def test_forward_without_step_metadata_is_a_clear_error() -> None:
    model = tiny_model("llama")
    prepare_model(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    with pytest.raises(InvalidArgumentError, match="pagedkv_step"), torch.inference_mode():
        model(torch.tensor([[3, 4, 5]]), use_cache=False)
