"""Tiny random-weight decoder models (seeded), one per supported family: for tests, demos and smoke runs.

Each is built from a config (nothing is downloaded) with `torch.manual_seed(seed)`, so the same call gives
the same weights. EOS is id 2 in every family.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.errors import InvalidArgumentError

VOCAB = 128
FAMILIES = ("llama", "qwen2", "qwen2-sw", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "gpt-oss")


def tiny_model(family: str, seed: int = 0) -> Any:
    """A seeded tiny model of `family`; EOS id 2 everywhere (so EOS stops are exercised too)."""
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    llama_like = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, **common)  # fmt: skip
    torch.manual_seed(seed)
    model: Any
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**llama_like))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**llama_like))
    elif family == "qwen2-sw":  # sliding window on the upper layer only
        model = tf.Qwen2ForCausalLM(
            tf.Qwen2Config(**llama_like, use_sliding_window=True, sliding_window=6, max_window_layers=1)
        )
    elif family == "qwen3":  # per-head q/k RMS norms, explicit head_dim
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**llama_like, "head_dim": 16}))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**llama_like, sliding_window=7))
    elif family == "gemma2":
        model = tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**{**llama_like, "head_dim": 16}, sliding_window=6, attn_logit_softcapping=5.0)
        )
    elif family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**llama_like))
    elif family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common))
    elif family == "gpt-oss":
        model = tiny_gpt_oss(seed)
    else:
        raise InvalidArgumentError(f"unknown tiny model family {family!r}; choose from {', '.join(FAMILIES)}")
    return model.eval()


def tiny_gpt_oss(seed: int = 0, *, sliding_window: int = 8, num_layers: int = 2) -> Any:
    """gpt-oss in small (`tiny_model("gpt-oss")`): sliding (`sliding_window` tokens; gpt-oss's own is 128) and
    full layers alternating, attention sinks, a mixture of 4 experts. The sinks are drawn wide (N(1, 2))
    instead of gpt-oss's near-zero initialisation, so that they change every output; YaRN's original context
    is set so that its factor (32) matches the 512 positions."""
    import transformers as tf

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}  # fmt: skip
    config = tf.GptOssConfig(
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=96,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, sliding_window=sliding_window, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters=rope,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2.0 + 1.0)
    return model.eval()
