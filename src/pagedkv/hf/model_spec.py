"""The KV-cache shape of a transformers model, and whether pagedkv can serve it.

`model_spec(model)` reads the config: layers, KV heads, head dim, dtype, per-layer sliding windows and the
attention logit soft-cap. `check_supported(model)` refuses what the paged attention function cannot run
correctly, with an `UnsupportedModelError` naming the missing piece:

- the model class must route attention through transformers' `AttentionInterface`
  (`_supports_attention_backend`), otherwise our function would never be called;
- decoder-only, causal self-attention only (no encoder-decoder, no cross-attention);
- every layer is `full_attention` or `sliding_attention` (no chunked attention, no recurrent/linear layers);
- keys and values share one head dim (no multi-head latent attention).

Runtime features the function sees only per call are handled by the attention function itself: attention
sinks passed as `s_aux` (gpt-oss) are served; position biases and non-causal modules are refused at the first
forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.core.errors import PagedKVError
from pagedkv.storage.kv_spec import KVCacheSpec

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(PagedKVError):
    """The model needs something pagedkv's attention does not provide; the message names it."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the KV cache of one model needs. `sliding_windows[i]` is None for a full-attention layer."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_name: str  # torch dtype without the "torch." prefix, e.g. "float32"
    sliding_windows: tuple[int | None, ...]
    soft_cap: float | None
    max_position_embeddings: int | None

    def kv_cache_spec(self) -> KVCacheSpec:
        """The storage layer's view of this shape (what `KVStorage` allocates from)."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_name)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _layer_types(config: Any, num_layers: int) -> list[str]:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        return [kind] * num_layers
    return list(layer_types)[:num_layers]


def check_supported(model: Any) -> None:
    """Raise `UnsupportedModelError` if `model` cannot be served on pagedkv; return None otherwise."""
    config = _text_config(model.config)
    name = f"{type(model).__name__} (model_type={getattr(config, 'model_type', '?')!r})"
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; pagedkv serves decoder-only models")
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(f"{name} uses cross-attention; pagedkv serves causal self-attention only")
    if not type(model).is_backend_compatible():
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so a registered attention function would never run"
        )
    num_layers = int(config.num_hidden_layers)
    for i, kind in enumerate(_layer_types(config, num_layers)):
        if kind not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedModelError(
                f"{name}: layer {i} is {kind!r}; pagedkv attention supports only {SUPPORTED_LAYER_TYPES}"
            )
    if getattr(config, "kv_lora_rank", None) is not None or getattr(config, "v_head_dim", None) not in (
        None,
        _head_dim(config),
    ):
        raise UnsupportedModelError(
            f"{name} uses multi-head latent attention (keys and values of different head dims); "
            "pagedkv stores one head dim for both"
        )


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(config.hidden_size) // int(config.num_attention_heads)


def model_spec(model: Any) -> ModelSpec:
    """The KV-cache shape of `model` (checked with `check_supported` first)."""
    check_supported(model)
    config = _text_config(model.config)
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    window = getattr(config, "sliding_window", None)
    windows = tuple(
        int(window) if kind == "sliding_attention" and window else None
        for kind in _layer_types(config, num_layers)
    )
    soft_cap = getattr(config, "attn_logit_softcapping", None)
    dtype = str(model.dtype).removeprefix("torch.")
    max_pos = getattr(config, "max_position_embeddings", None)
    return ModelSpec(
        model_type=str(getattr(config, "model_type", "?")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=_head_dim(config),
        dtype_name=dtype,
        sliding_windows=windows,
        soft_cap=float(soft_cap) if soft_cap is not None else None,
        max_position_embeddings=int(max_pos) if max_pos is not None else None,
    )
