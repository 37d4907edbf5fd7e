"""The model's KV shape and the arithmetic that turns a byte budget into blocks. Torch-free on purpose.

The arithmetic is written once, in `kv_bytes_per_block` and `blocks_in_budget`: `KVCacheSpec` (the engine's
storage), the simulator's `ModelShape` and `KVBudget`, and the engine's `kv_budget_bytes` all call them,
without loading torch; `KVStorage` (in `pagedkv.storage.kv`) allocates exactly the blocks they count.

One block holds `block_size` tokens of K and of V for every layer:

    bytes_per_block = 2 (K and V) * num_layers * block_size * num_kv_heads * head_dim * bytes_per_element

Quantized storage (`int8`, `float8_e4m3fn`, `float8_e5m2`: one-byte codes) keeps float32 scales in a sidecar
of the block (`KVStorage.scales`), so a block's bytes and every budget count them. The scale scheme
(`kv_scale_scheme`, one of `KV_SCALE_SCHEMES`) says how many: "token" keeps one per (layer, K/V, token, KV
head), "block" one per (layer, K/V, block, KV head):

    "token": bytes_per_block = 2 * num_layers * num_kv_heads * block_size * (head_dim * 1 + 4)
    "block": bytes_per_block = 2 * num_layers * num_kv_heads * (block_size * head_dim * 1 + 4)

Under "block" a token's share of the scales is 4 / block_size bytes per (layer, K/V, KV head), so bytes per
token is not an integer in general: `kv_bytes_per_block` is the arithmetic, `kv_bytes_per_token` its
one-token case (the token scheme and unquantized storage).

`kv_cache_dtype` (the engine's and the CLI's name for the choice) is one of `KV_CACHE_DTYPES`;
`resolve_kv_cache_dtype` turns it into the storage dtype. docs/quantized-kv.md has the scheme and its accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.errors import InvalidArgumentError

# Storage dtypes by name (torch's spelling without the "torch." prefix) and their size in bytes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
# Bytes of one scale that quantized dtypes keep beside their codes (float32).
SCALE_BYTES: dict[str, int] = {"int8": 4, "float8_e4m3fn": 4, "float8_e5m2": 4}
# The KV cache dtypes an engine, `plan` and `simulate` accept: "auto" keeps the model's dtype.
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
QUANTIZED_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
# How many scales a quantized block keeps: one per (layer, K/V, KV head) and "token" or "block"; each scheme's
# id is part of the tiers' fingerprint, so KV under two schemes never meets.
KV_SCALE_SCHEMES = ("token", "block")
SCALE_SCHEME_IDS: dict[str, str] = {"token": "per-token-head-f32", "block": "per-block-head-f32"}
_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype_name(dtype: object) -> str:
    """Canonical storage dtype name for a string alias or a `torch.dtype` (without importing torch)."""
    name = str(dtype).removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise InvalidArgumentError(
            f"unsupported KV storage dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)} (or fp32/fp16/bf16/fp8/fp8_e5m2)"
        )
    return name


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: object) -> str:
    """The storage dtype for a `kv_cache_dtype` of `KV_CACHE_DTYPES` ("auto": the model's own dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return normalize_dtype_name(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def check_kv_scale_scheme(kv_scale_scheme: str, kv_cache_dtype: str) -> None:
    """`kv_scale_scheme` is one of `KV_SCALE_SCHEMES`, and "block" goes with a quantized `kv_cache_dtype` (a
    `KV_CACHE_DTYPES` name or a storage dtype name): the one check the engine, the planner and the storage
    share."""
    if kv_scale_scheme not in KV_SCALE_SCHEMES:
        raise InvalidArgumentError(
            f"kv_scale_scheme must be one of {', '.join(KV_SCALE_SCHEMES)}, got {kv_scale_scheme!r}"
        )
    quantized = kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES or kv_cache_dtype in SCALE_BYTES
    if kv_scale_scheme == "block" and not quantized:
        raise InvalidArgumentError(
            f"kv_scale_scheme 'block' needs a quantized KV cache dtype ({', '.join(QUANTIZED_KV_CACHE_DTYPES)}), "
            f"got {kv_cache_dtype!r}; drop the scale scheme or choose one of those"
        )


def kv_bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    bytes_per_element: int,
    block_size: int,
    scale_bytes: int = 0,
    kv_scale_scheme: str = "token",
) -> int:
    """Bytes of K and V of one block of `block_size` tokens across all layers: 2 x layers x kv_heads x
    (block_size x head_dim x element bytes + scales x scale bytes), scales being `block_size` ("token") or 1
    ("block") per (layer, K/V, KV head); `scale_bytes` is 0 for unquantized dtypes."""
    scales_per_block = 1 if kv_scale_scheme == "block" else block_size
    return 2 * num_layers * num_kv_heads * (block_size * head_dim * bytes_per_element + scales_per_block * scale_bytes)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int, scale_bytes: int = 0
) -> int:
    """Bytes of K and V of one token across all layers with a scale per token (or none): `kv_bytes_per_block`
    of one token."""
    return kv_bytes_per_block(num_layers, num_kv_heads, head_dim, bytes_per_element, 1, scale_bytes)


def blocks_in_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks of `bytes_per_block` fit in `budget_bytes` (floor; block 0, the null block,
    is one of them). The caller decides how few is too few."""
    if bytes_per_block < 1:
        raise InvalidArgumentError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    return budget_bytes // bytes_per_block


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV shape of a model: what one token costs in every layer. Validated on construction.

    `dtype` accepts a name ("float16", "bf16", "fp8", "int8", ...) or a `torch.dtype`; it is stored as the canonical
    name (`KVCacheSpec(2, 4, 64, torch.float16).dtype == "float16"`). `kv_scale_scheme` ("token" or "block",
    see the module docstring) applies to quantized dtypes; "block" with any other dtype is an error.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    kv_scale_scheme: str = "token"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"KVCacheSpec.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype))
        check_kv_scale_scheme(self.kv_scale_scheme, self.dtype)

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        """One-byte codes with float32 scales (int8, fp8 e4m3, fp8 e5m2)."""
        return self.dtype in SCALE_BYTES

    @property
    def block_scales(self) -> bool:
        """Quantized with one scale per (layer, K/V, block, KV head): the "block" scheme."""
        return self.is_quantized and self.kv_scale_scheme == "block"

    def scales_per_block(self, block_size: int) -> int:
        """Scale rows per (layer, K/V) of one block, each `num_kv_heads` wide: `block_size` ("token"), 1
        ("block"); 0 unless quantized."""
        if not self.is_quantized:
            return 0
        return 1 if self.block_scales else block_size

    @property
    def scale_scheme_id(self) -> str:
        """The scale scheme's id for quantized storage (`SCALE_SCHEME_IDS`, hashed into the tiers' fingerprint),
        "" otherwise."""
        return SCALE_SCHEME_IDS[self.kv_scale_scheme] if self.is_quantized else ""

    @property
    def scale_bytes(self) -> int:
        """Bytes of one scale (0 unless quantized)."""
        return SCALE_BYTES.get(self.dtype, 0)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers, per-token scales included. Block scales have no per-token
        size: under the "block" scheme this raises; ask `bytes_per_block`."""
        if self.block_scales:
            raise InvalidArgumentError(
                "KVCacheSpec.bytes_per_token: block scales are counted per block; use bytes_per_block(block_size)"
            )
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.bytes_per_element, self.scale_bytes
        )

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of one block (`block_size` tokens) across all layers, scales included."""
        _check_block_size(block_size)
        return kv_bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, self.bytes_per_element,
                                  block_size, self.scale_bytes, self.kv_scale_scheme)  # fmt: skip

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """How many blocks fit in `budget_bytes` (floor). Raises if not even one block fits."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise InvalidArgumentError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        per_block = self.bytes_per_block(block_size)
        num_blocks = blocks_in_budget(budget_bytes, per_block)
        if num_blocks < 1:
            raise InvalidArgumentError(
                f"a budget of {budget_bytes} bytes cannot hold one block of {per_block} bytes "
                f"({block_size} tokens for {self}); "
                "raise the budget or lower block_size"
            )
        return num_blocks


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 256:
        raise InvalidArgumentError(f"block_size must be an int in [1, 256], got {block_size!r}")
