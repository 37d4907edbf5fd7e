"""Store keys: `pkv:v1:{model_fingerprint}:{block key hex}`.

The fingerprint hashes everything that makes the same tokens mean different bytes: the model id, a digest
of its weights, the KV dtype and, for quantized KV, its scale scheme, the layer/head/dim shape, the block size and the tensor-parallel rank and
size. Two engines share a block only when all of them agree, so two models (or two TP shards, or two
checkpoints saved under one name: fine-tunes, seeded random models) never read each other's KV.
"""

from __future__ import annotations

import hashlib
import json

from pagedkv.core.errors import InvalidArgumentError

KEY_PREFIX = "pkv:v1:"


def model_fingerprint(
    model_id: str,
    dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    weights: str = "",
    kv_scales: str = "",
) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of the fields above (`weights`: the weights' digest,
    `pagedkv.hf.loading.weights_digest`; `kv_scales`: the quantized KV's scale scheme id,
    `KVCacheSpec.scale_scheme_id`, hashed only when set so unquantized fingerprints stay as they were)."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("tp_size", tp_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"model_fingerprint: {name} must be a positive int, got {value!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"model_fingerprint: tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    fields = {
        "model": str(model_id), "dtype": str(dtype), "layers": num_layers, "kv_heads": num_kv_heads,
        "head_dim": head_dim, "block_size": block_size, "tp_rank": tp_rank, "tp_size": tp_size,
        "weights": str(weights),
    }  # fmt: skip
    if kv_scales:
        fields["kv_scales"] = str(kv_scales)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def key_bytes(key: bytes | int) -> bytes:
    """A block key as bytes (SHA-256 keys already are; 64-bit `fast` keys become 8 big-endian bytes)."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return (key & (2**64 - 1)).to_bytes(8, "big")
    raise InvalidArgumentError(f"a block key is bytes or an int, got {type(key).__name__}")


def store_key(fingerprint: str, key: bytes) -> bytes:
    """`pkv:v1:{fingerprint}:{hex}` as bytes (what Redis stores and what every value's header repeats)."""
    return f"{KEY_PREFIX}{fingerprint}:{key.hex()}".encode()
