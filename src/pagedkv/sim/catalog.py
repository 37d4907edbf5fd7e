"""Built-in GPUs and models for the simulator, extensible from a user's JSON or YAML file.

Names are lowercase with dashes (`llama-2-7b`, `a100-40gb`). Every number is a published figure:

GPUs (vendor datasheets; dense bf16 tensor-core throughput, i.e. without 2:4 sparsity):
- A100-40GB / A100-80GB SXM: NVIDIA A100 datasheet: 1,555 GB/s and 2,039 GB/s HBM2/HBM2e, 312 TFLOP/s bf16.
- H100-80GB SXM: NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s bf16 (1,979 with sparsity).
- H200 SXM: NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 (same GH100 compute as H100).
- L4: NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s bf16 (242 with sparsity).
Memory is what the device reports as total (nvidia-smi MiB), since that is what a serving engine's
`gpu_memory_utilization` multiplies: 40,960 / 81,920 / 81,559 / 143,771 / 23,034 MiB.

Models (Hugging Face `config.json` of each checkpoint; parameter counts from the model cards and
`sum(p.numel())`, which a test cross-checks against the shapes):
- meta-llama/Llama-2-{7b,13b,70b}-hf, meta-llama/Meta-Llama-3-{8B,70B}, mistralai/Mistral-7B-v0.1,
  Qwen/Qwen2.5-7B, HuggingFaceTB/SmolLM2-135M.

Hybrid models (layers of different attention, `layer_pattern` repeated over the layers: F full, S sliding
window of `sliding_window` tokens), each from its public config:
- mistral-7b-v0.1: every layer slides over 4,096 tokens (https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json).
- gemma-2-9b / gemma-2-27b: sliding (4,096) and full layers alternate, sliding first, 8,192 positions
  (https://huggingface.co/google/gemma-2-9b/blob/main/config.json,
  https://huggingface.co/google/gemma-2-27b/blob/main/config.json).
- gemma-3-12b / gemma-3-27b: five sliding (1,024) layers per full one (`sliding_window_pattern` 6),
  131,072 positions; the vision tower's parameters count in the weights
  (https://huggingface.co/google/gemma-3-12b-pt/blob/main/config.json,
  https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json).
- gpt-oss-20b / gpt-oss-120b: sliding (128) and full layers alternate, sliding first, 131,072 positions;
  mixture-of-experts weights stored in MXFP4, so `weight_bytes_override` is the checkpoint's size, not
  2 bytes per parameter (https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json,
  https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json). The step-time model counts all
  parameters as active, which overstates a mixture of experts' compute.
- ministral-8b: one full (131,072) layer per three sliding (32,768) ones, as vLLM reads the
  checkpoint's `params.json` (https://huggingface.co/mistralai/Ministral-8B-Instruct-2410/blob/main/params.json);
  vLLM's hybrid allocator RFC (https://github.com/vllm-project/vllm/issues/11382) measured its waste.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.storage.kv_spec import (
    KV_CACHE_DTYPES,
    KVCacheSpec,
    check_kv_scale_scheme,
    kv_bytes_per_block,
    kv_bytes_per_token,
)

MIB = 1024**2
GIB = 1024**3


def _check_name(name: object, kind: str) -> None:
    if not isinstance(name, str) or not name or name != name.lower() or " " in name:
        raise InvalidArgumentError(
            f"{kind} name must be lowercase with dashes (e.g. 'a100-40gb'), got {name!r}"
        )


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: total memory, peak HBM bandwidth and peak dense bf16 throughput."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name, "GPU")
        for f in ("memory_bytes", "hbm_bandwidth_bytes_per_s", "bf16_flops_per_s"):
            value = getattr(self, f)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"GPU {self.name!r}: {f} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape, enough for KV bytes, weight bytes and FLOPs: the simulator's and
    planner's model, read from the catalog. Not `pagedkv.hf.model_spec.ModelSpec`, which describes a loaded
    transformers model for the engine."""

    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2  # bf16 weights and KV
    source: str = ""
    sliding_window: int = 0  # tokens a sliding layer attends to (0: none)
    layer_pattern: str = "F"  # repeated over the layers: F full attention, S sliding window
    weight_bytes_override: int = 0  # the checkpoint's bytes where they are not num_params x dtype_bytes
    # how K/V are stored (pagedkv.storage.kv_spec.KV_CACHE_DTYPES): "auto" = dtype_bytes per value, no scales;
    # "int8"/"fp8_e4m3"/"fp8_e5m2" = 1 byte per value + a 4-byte scale per K/V and KV head and, by
    # kv_scale_scheme, per token ("token") or per block ("block")
    kv_cache_dtype: str = "auto"
    kv_scale_scheme: str = "token"

    def __post_init__(self) -> None:
        _check_name(self.name, "model")
        for f in (
            "num_params",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_model_len",
            "dtype_bytes",
        ):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"model {self.name!r}: {f} must be a positive int, got {value!r}")
        self._check_layers()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError(
                f"model {self.name!r}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        check_kv_scale_scheme(self.kv_scale_scheme, self.kv_cache_dtype)
        if self.num_attention_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"model {self.name!r}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    def _check_layers(self) -> None:
        if not self.layer_pattern or set(self.layer_pattern) - {"F", "S"}:
            raise InvalidArgumentError(
                f"model {self.name!r}: layer_pattern must be letters F (full) and S (sliding), got {self.layer_pattern!r}"
            )
        window = self.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0 or (("S" in self.layer_pattern) != (window > 0)):
            raise InvalidArgumentError(
                f"model {self.name!r}: sliding layers (S in layer_pattern) need sliding_window > 0 tokens and "
                f"full-only models 0, got sliding_window={window!r}, layer_pattern={self.layer_pattern!r}"
            )
        if not isinstance(self.weight_bytes_override, int) or self.weight_bytes_override < 0:
            raise InvalidArgumentError(f"model {self.name!r}: weight_bytes_override must be an int >= 0")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention), the pattern repeated over the layers."""
        p = self.layer_pattern
        return tuple(self.sliding_window if p[i % len(p)] == "S" else None for i in range(self.num_layers))

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer slides (its KV can be bounded by the window)."""
        return "S" in self.layer_pattern

    @property
    def kv_element_bytes(self) -> tuple[int, int]:
        """(bytes per K/V value, bytes of one scale) of the KV cache dtype (0: no scales)."""
        if self.kv_cache_dtype == "auto":
            return self.dtype_bytes, 0
        spec = KVCacheSpec(1, 1, 1, self.kv_cache_dtype)
        return spec.bytes_per_element, spec.scale_bytes

    def kv_bytes_per_block(self, block_size: int, num_layers: int | None = None) -> int:
        """K and V of one block of `block_size` tokens in `num_layers` layers (default: all), scales included:
        what a budget counts (`pagedkv.storage.kv_spec.kv_bytes_per_block`)."""
        value_bytes, scale_bytes = self.kv_element_bytes
        layers = self.num_layers if num_layers is None else num_layers
        return kv_bytes_per_block(layers, self.num_kv_heads, self.head_dim, value_bytes, block_size, scale_bytes,
                                  self.kv_scale_scheme)  # fmt: skip

    @property
    def _token_scale_bytes(self) -> int:
        return 0 if self.kv_scale_scheme == "block" else self.kv_element_bytes[1]

    @property
    def kv_bytes_per_layer_token(self) -> int:
        """K and V of one token in one layer, per-token scales included (block scales, 4 bytes per block, K/V
        and KV head, are no per-token cost: `kv_bytes_per_block` counts them; the step-time model's traffic
        leaves them out, under 0.4% of a block's bytes at 16 tokens of head dim 64)."""
        return kv_bytes_per_token(1, self.num_kv_heads, self.head_dim, self.kv_element_bytes[0],
                                  self._token_scale_bytes)  # fmt: skip

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 x layers x kv_heads x (head_dim x value bytes + per-token scale bytes);
        see `kv_bytes_per_layer_token` for block scales."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_element_bytes[0],
                                  self._token_scale_bytes)  # fmt: skip

    @property
    def weight_bytes(self) -> int:
        return self.weight_bytes_override or self.num_params * self.dtype_bytes


_NVIDIA = "NVIDIA datasheet"
BUILTIN_GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("a100-40gb", 40960 * MIB, 1555e9, 312e12, f"{_NVIDIA}, A100 SXM4 40GB"),
        GPUSpec("a100-80gb", 81920 * MIB, 2039e9, 312e12, f"{_NVIDIA}, A100 SXM4 80GB"),
        GPUSpec("h100-80gb", 81559 * MIB, 3.35e12, 989e12, f"{_NVIDIA}, H100 SXM5 80GB"),
        GPUSpec("h200", 143771 * MIB, 4.8e12, 989e12, f"{_NVIDIA}, H200 SXM 141GB"),
        GPUSpec("l4", 23034 * MIB, 300e9, 121e12, f"{_NVIDIA}, L4 24GB"),
    )
}
# "h100-80gb-sxm" is how the issue spells it; keep both.
GPU_ALIASES = {"h100-80gb-sxm": "h100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}

_HF = "Hugging Face config.json"
BUILTIN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-2-7b", 6_738_415_616, 32, 4096, 32, 32, 128, 11008, 32000, 4096,
                  source=f"{_HF}, meta-llama/Llama-2-7b-hf"),
        ModelShape("llama-2-13b", 13_015_864_320, 40, 5120, 40, 40, 128, 13824, 32000, 4096,
                  source=f"{_HF}, meta-llama/Llama-2-13b-hf"),
        ModelShape("llama-2-70b", 68_976_648_192, 80, 8192, 64, 8, 128, 28672, 32000, 4096,
                  source=f"{_HF}, meta-llama/Llama-2-70b-hf"),
        ModelShape("llama-3-8b", 8_030_261_248, 32, 4096, 32, 8, 128, 14336, 128256, 8192,
                  source=f"{_HF}, meta-llama/Meta-Llama-3-8B"),
        ModelShape("llama-3-70b", 70_553_706_496, 80, 8192, 64, 8, 128, 28672, 128256, 8192,
                  source=f"{_HF}, meta-llama/Meta-Llama-3-70B"),
        ModelShape("mistral-7b", 7_241_732_096, 32, 4096, 32, 8, 128, 14336, 32000, 32768,
                  source=f"{_HF}, mistralai/Mistral-7B-v0.1"),
        ModelShape("qwen2.5-7b", 7_615_616_512, 28, 3584, 28, 4, 128, 18944, 152064, 32768,
                  source=f"{_HF}, Qwen/Qwen2.5-7B (q/k/v biases included in num_params)"),
        ModelShape("smollm2-135m", 134_515_008, 30, 576, 9, 3, 64, 1536, 49152, 8192,
                  tie_word_embeddings=True, source=f"{_HF}, HuggingFaceTB/SmolLM2-135M"),
        # hybrid models: see the module docstring for each config's address
        ModelShape("mistral-7b-v0.1", 7_241_732_096, 32, 4096, 32, 8, 128, 14336, 32000, 32768,
                  sliding_window=4096, layer_pattern="S", source=f"{_HF}, mistralai/Mistral-7B-v0.1"),
        ModelShape("gemma-2-9b", 9_241_705_984, 42, 3584, 16, 8, 256, 14336, 256000, 8192,
                  tie_word_embeddings=True, sliding_window=4096, layer_pattern="SF",
                  source=f"{_HF}, google/gemma-2-9b"),
        ModelShape("gemma-2-27b", 27_227_128_320, 46, 4608, 32, 16, 128, 36864, 256000, 8192,
                  tie_word_embeddings=True, sliding_window=4096, layer_pattern="SF",
                  source=f"{_HF}, google/gemma-2-27b"),
        ModelShape("gemma-3-12b", 12_187_325_040, 48, 3840, 16, 8, 256, 15360, 262208, 131072,
                  tie_word_embeddings=True, sliding_window=1024, layer_pattern="SSSSSF",
                  source=f"{_HF}, google/gemma-3-12b-pt (text_config; vision tower included in num_params)"),
        ModelShape("gemma-3-27b", 27_432_406_640, 62, 5376, 32, 16, 128, 21504, 262208, 131072,
                  tie_word_embeddings=True, sliding_window=1024, layer_pattern="SSSSSF",
                  source=f"{_HF}, google/gemma-3-27b-pt (text_config; vision tower included in num_params)"),
        ModelShape("gpt-oss-20b", 20_914_757_184, 24, 2880, 64, 8, 64, 2880, 201088, 131072,
                  sliding_window=128, layer_pattern="SF", weight_bytes_override=13_761_300_000,
                  source=f"{_HF}, openai/gpt-oss-20b (MXFP4 experts: weights are the checkpoint's size)"),
        ModelShape("gpt-oss-120b", 116_829_156_672, 36, 2880, 64, 8, 64, 2880, 201088, 131072,
                  sliding_window=128, layer_pattern="SF", weight_bytes_override=65_248_000_000,
                  source=f"{_HF}, openai/gpt-oss-120b (MXFP4 experts: weights are the checkpoint's size)"),
        ModelShape("ministral-8b", 8_019_808_256, 36, 4096, 32, 8, 128, 12288, 131072, 131072,
                  sliding_window=32768, layer_pattern="FSSS",
                  source="params.json, mistralai/Ministral-8B-Instruct-2410 (vLLM's reading: 1 full per 3 sliding)"),
    )
}  # fmt: skip


@dataclass
class Catalog:
    """GPUs and models by name: the built-ins plus whatever `load_file` added (user entries win)."""

    gpus: dict[str, GPUSpec]
    models: dict[str, ModelShape]

    @classmethod
    def builtin(cls) -> Catalog:
        return cls(dict(BUILTIN_GPUS), dict(BUILTIN_MODELS))

    def gpu(self, name: str) -> GPUSpec:
        key = name.strip().lower().replace("_", "-")
        key = GPU_ALIASES.get(key, key)
        if key not in self.gpus:
            raise InvalidArgumentError(
                f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(self.gpus))} "
                "(add your own with --catalog FILE)"
            )
        return self.gpus[key]

    def model(self, name: str) -> ModelShape:
        key = name.strip().lower().replace("_", "-")
        if key not in self.models:
            raise InvalidArgumentError(
                f"unknown model {name!r}; known models: {', '.join(sorted(self.models))} "
                "(add your own with --catalog FILE)"
            )
        return self.models[key]

    def load_file(self, path: str | Path) -> None:
        """Add the `gpus:` and `models:` entries of a JSON or YAML file, keyed by name.

        Each entry takes the `GPUSpec` / `ModelShape` field names; GPU entries may give `memory_gib` (GiB;
        `memory_gb` is the older spelling, also GiB), `hbm_bandwidth_gb_per_s` and `bf16_tflops` instead of
        the base units (`EXAMPLE_CATALOG` shows every key). An incomplete or wrong entry is an
        `InvalidArgumentError` naming the keys as the file spells them.
        """
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read catalog file {path}: {exc}") from exc
        data = _parse(text, path)
        if not isinstance(data, dict) or not set(data) <= {"gpus", "models"}:
            raise InvalidArgumentError(f"{path}: expected a mapping with keys 'gpus' and/or 'models'")
        for name, entry in (data.get("gpus") or {}).items():
            _check_entry(entry, "GPU", name, path)
            keys = sorted(entry or {})
            self.gpus[name] = _build(GPUSpec, _gpu_units(dict(entry or {}), path, name), name, path, keys)
        for name, entry in (data.get("models") or {}).items():
            _check_entry(entry, "model", name, path)
            self.models[name] = _build(ModelShape, dict(entry or {}), name, path, sorted(entry or {}))


EXAMPLE_CATALOG = """\
# pagedkv catalog: --catalog FILE (YAML or JSON) adds or overrides GPUs and models by name.
gpus:
  l40s:                       # name: lowercase with dashes
    memory_gib: 44.99         # total memory as the device reports it (GiB = 2^30 bytes; or memory_bytes)
    hbm_bandwidth_gb_per_s: 864   # peak memory bandwidth, 10^9 bytes/s (or hbm_bandwidth_bytes_per_s)
    bf16_tflops: 362          # peak dense bf16 throughput, 10^12 FLOP/s (or bf16_flops_per_s)
models:
  opt-13b:                    # the fields of a Hugging Face config.json, plus the parameter count
    num_params: 12853473280
    num_layers: 40
    hidden_size: 5120
    num_attention_heads: 40
    num_kv_heads: 40
    head_dim: 128
    intermediate_size: 20480
    vocab_size: 50272
    max_model_len: 2048
    tie_word_embeddings: true # optional (default false)
    dtype_bytes: 2            # optional: bytes per weight and KV element (default 2, bf16)
    source: facebook/opt-13b config.json   # optional
    # optional, hybrid models: sliding_window: 4096 and layer_pattern: SF (F full, S sliding, repeated)
"""

# the keys a user may write for each base field (first: the one the example and messages use)
_GPU_KEYS = {
    "memory_bytes": ("memory_gib", "memory_gb", "memory_bytes"),
    "hbm_bandwidth_bytes_per_s": ("hbm_bandwidth_gb_per_s", "hbm_bandwidth_bytes_per_s"),
    "bf16_flops_per_s": ("bf16_tflops", "bf16_flops_per_s"),
}


def _parse(text: str, path: Path) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - pyyaml is a dev dependency
            raise InvalidArgumentError(f"{path}: reading YAML needs pyyaml (pip install pyyaml)") from exc
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidArgumentError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{path}: not valid JSON at line {exc.lineno}: {exc.msg}") from exc


def _gpu_units(entry: dict[str, Any], path: Path, name: str) -> dict[str, Any]:
    conversions = {
        "memory_gib": ("memory_bytes", GIB),
        "memory_gb": ("memory_bytes", GIB),  # older spelling of memory_gib: also GiB
        "hbm_bandwidth_gb_per_s": ("hbm_bandwidth_bytes_per_s", 1e9),
        "bf16_tflops": ("bf16_flops_per_s", 1e12),
    }
    for key, (base, scale) in conversions.items():
        if key in entry:
            value = entry.pop(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidArgumentError(f"{path}: GPU {name!r}: {key} must be a number, got {value!r}")
            entry[base] = int(value * scale) if base == "memory_bytes" else float(value * scale)
    return entry


def _check_entry(entry: Any, kind: str, name: str, path: Path) -> None:
    if entry is not None and not isinstance(entry, dict):
        raise InvalidArgumentError(
            f"{path}: {kind} {name!r} must be a mapping of keys to values, got {entry!r}"
        )


def _user_keys(cls: type[Any], base: str) -> str:
    """How a user may spell field `base` of `cls` in a catalog file."""
    spellings = _GPU_KEYS.get(base, (base,)) if cls is GPUSpec else (base,)
    return " or ".join(spellings)


def _build(cls: type[Any], entry: dict[str, Any], name: str, path: Path, user_keys: list[str]) -> Any:
    """`cls(name=name, **entry)`; errors name the keys as the user wrote them (`user_keys`)."""
    kind = "GPU" if cls is GPUSpec else "model"
    allowed = {f.name for f in fields(cls)} - {"name"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        accepted = sorted({k for f in allowed for k in _user_keys(cls, f).split(" or ")})
        raise InvalidArgumentError(
            f"{path}: {kind} {name!r}: unknown field(s) {unknown}; accepted keys: {', '.join(accepted)} "
            "(see --example-catalog)"
        )
    required = [
        f.name
        for f in fields(cls)
        if f.name != "name" and f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [f for f in required if f not in entry]
    if missing:
        raise InvalidArgumentError(
            f"{path}: {kind} {name!r} is missing {', '.join(_user_keys(cls, f) for f in missing)} "
            f"(it has: {', '.join(user_keys) or 'nothing'}; see --example-catalog)"
        )
    try:
        return cls(name=name, **entry)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{path}: {exc}") from None
