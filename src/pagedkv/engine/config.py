"""`EngineConfig`: the engine's knobs, validated on construction. Torch-free.

KV capacity is either `num_blocks` or `kv_budget_bytes` (turned into blocks from the model's KV shape, one
block being `block_size` tokens of K and V in every layer); one of them must be given. Block 0 is the null
block, so `num_blocks - 1` blocks hold tokens.

The scheduler's settings (batch limits, chunked prefill, preemption mode) are one `SchedulerConfig` in
`scheduler`, with its defaults: `EngineConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=8))`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.eviction import EVICTION_POLICIES
from pagedkv.core.prefix import KEY_FUNCTIONS
from pagedkv.engine.managers import MANAGER_KINDS, ManagerKind
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.engine.speculative.config import SpeculativeConfig
from pagedkv.storage.kv_spec import KV_CACHE_DTYPES, check_kv_scale_scheme

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """`"64MiB"` -> 67108864; accepts B, KiB/MiB/GiB/TiB and KB/MB/GB/TB (case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(f"cannot read {text!r} as a byte size; write e.g. 64MiB, 512KiB or 1GB")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine sizes its KV cache and schedules. See the module docstring for capacity."""

    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    block_size: int = 16
    allocator: ManagerKind = "paged"  # a kind of `pagedkv.engine.managers.make_manager`
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = SchedulerConfig()
    num_host_blocks: int | None = None  # swap pool; default: as many as device blocks when swapping
    attention_backend: Literal["auto", "sdpa", "ops"] = "auto"  # see pagedkv.hf.cache.PagedKVCache
    # The model's projections on a CPU (pagedkv.hf.cpu_linear): "onednn" packs each weight once for oneDNN,
    # "torch" leaves nn.Linear alone, "auto" packs bf16 weights on a CPU with bf16 instructions.
    # "invariant" (pagedkv.hf.invariant) is batch-invariant mode's: the same as `batch_invariant=True`.
    linear_backend: Literal["auto", "onednn", "torch", "invariant"] = "auto"
    # The forward (pagedkv.hf.fused_llama): "fused" runs Llama-structured models as one loop of fused
    # operations, "transformers" runs the model's own modules, "auto" fuses where the model allows it.
    model_forward: Literal["auto", "fused", "transformers"] = "auto"
    # How K/V are stored (pagedkv.storage.kv_spec.KV_CACHE_DTYPES; docs/quantized-kv.md): "auto" (the model's dtype),
    # "bf16", or one-byte codes with float32 scales: "int8", "fp8_e4m3", "fp8_e5m2"; their scales are one per
    # token and KV head (kv_scale_scheme "token") or one per block and KV head ("block", quantized dtypes only).
    kv_cache_dtype: str = "auto"
    kv_scale_scheme: str = "token"
    # Tiers below the device (docs/tiers.md): evicted prefix blocks go to host RAM, then disk; published
    # blocks are written through to a Redis store shared by replicas ("redis://..." or "unix://...").
    host_blocks: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0
    remote_url: str | None = None
    remote_timeout_s: float = 2.0  # per remote call (connect and reply)
    remote_backoff_s: float = 30.0  # after 3 failed remote calls in a row, skip the store this long
    remote_required: bool = False  # a remote store that does not answer at start-up: fatal, not off
    # KV events for every medium (GPU, CPU, DISK, REMOTE), vLLM-compatible: Engine.take_event_batch()
    # (pagedkv.engine.kv_events, docs/scale-out.md).
    kv_events: bool = False
    # Which cached-free block an allocation evicts (pagedkv.core.eviction; docs/cache-policy.md):
    # "lru" (default), "slru", "lfu", "priority" (a request's priority, decaying), "cost".
    eviction: str = "lru"
    # Partial-block reuse: a prompt diverging inside a cached block copies it and computes only the rest
    # (one block copy costs less than computing one token; docs/cache-policy.md). Prefix caching only.
    partial_block_reuse: bool = True
    # How a block's content key is computed (pagedkv.core.prefix.KEY_FUNCTIONS): "sha256" (pagedkv's salted
    # chain, the default), "fast", or "vllm" (vLLM's sha256_cbor chain, so routers built for vLLM index this
    # engine's KV events unchanged; docs/scale-out.md).
    hash_fn: str = "sha256"
    # Speculative decoding (pagedkv.engine.speculative, docs/speculative.md): n-gram prompt lookup or a draft
    # model proposes k tokens a step, the model verifies them in one forward, rejected ones are rolled back.
    speculative: SpeculativeConfig | None = None
    # Batch-invariant mode (pagedkv.hf.invariant, docs/rl.md): a request's tokens and logprobs are bit-identical
    # whatever else is in its batch, however its prompt is chunked and whether its prefix came from the cache.
    # It runs the fused Llama forward (model_forward "auto" becomes "fused") over the "invariant" linear
    # backend ("auto" becomes "invariant"); either spelling, `batch_invariant=True` or
    # `linear_backend="invariant"`, sets the other.
    batch_invariant: bool = False

    @property
    def tiers_enabled(self) -> bool:
        return bool(self.host_blocks or self.disk_path is not None or self.remote_url)

    def __post_init__(self) -> None:
        if (self.num_blocks is None) == (self.kv_budget_bytes is None):
            raise InvalidArgumentError("EngineConfig: give exactly one of num_blocks and kv_budget_bytes")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}"
            )
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise InvalidArgumentError(f"kv_budget_bytes must be > 0, got {self.kv_budget_bytes}")
        if not 1 <= self.block_size <= 256:
            raise InvalidArgumentError(f"block_size must be in [1, 256], got {self.block_size}")
        if self.allocator not in MANAGER_KINDS:
            raise InvalidArgumentError(f"allocator must be one of {', '.join(MANAGER_KINDS)}, got {self.allocator!r}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise InvalidArgumentError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        if self.scheduler.preemption_mode == "swap" and self.allocator not in ("paged", "hybrid"):
            raise InvalidArgumentError("preemption by swap needs the paged or hybrid allocator (they own a host pool)")
        self._check_backends()
        self._resolve_batch_invariant()
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise InvalidArgumentError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        self._check_tiers()
        self._check_cache_policy()
        self._check_speculative()
        if not isinstance(self.kv_events, bool):
            raise InvalidArgumentError(f"kv_events must be a bool, got {self.kv_events!r}")
        if self.kv_events and (self.allocator not in ("paged", "hybrid") or not self.enable_prefix_caching):
            raise InvalidArgumentError("kv_events need the paged or hybrid allocator with prefix caching on")

    def _check_speculative(self) -> None:
        if self.speculative is None:
            return
        if not isinstance(self.speculative, SpeculativeConfig):
            raise InvalidArgumentError(f"speculative must be a SpeculativeConfig or None, got {type(self.speculative).__name__}")
        if self.allocator != "paged":
            raise InvalidArgumentError("speculative decoding needs the paged allocator (it rolls rejected drafts back)")

    def _check_backends(self) -> None:
        if self.attention_backend not in ("auto", "sdpa", "ops"):
            raise InvalidArgumentError(
                f"attention_backend must be 'auto', 'sdpa' or 'ops', got {self.attention_backend!r}"
            )
        if self.model_forward not in ("auto", "fused", "transformers"):
            raise InvalidArgumentError(
                f"model_forward must be 'auto', 'fused' or 'transformers', got {self.model_forward!r}"
            )
        if self.linear_backend not in ("auto", "onednn", "torch", "invariant"):
            raise InvalidArgumentError(
                f"linear_backend must be 'auto', 'onednn', 'torch' or 'invariant', got {self.linear_backend!r}"
            )

    def _resolve_batch_invariant(self) -> None:
        """Batch-invariant mode's two spellings made one: the flag, the "invariant" linear backend and the fused
        forward go together (see the field's comment); a conflicting explicit choice is an error."""
        if not isinstance(self.batch_invariant, bool):
            raise InvalidArgumentError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if not (self.batch_invariant or self.linear_backend == "invariant"):
            return
        if self.linear_backend not in ("auto", "invariant"):
            raise InvalidArgumentError(
                f"batch_invariant runs the 'invariant' linear backend; linear_backend {self.linear_backend!r} "
                "contradicts it (leave linear_backend 'auto')"
            )
        if self.model_forward == "transformers":
            raise InvalidArgumentError(
                "batch_invariant runs the fused Llama forward; model_forward 'transformers' contradicts it "
                "(leave model_forward 'auto')"
            )
        # a frozen dataclass resolves its "auto" values once, here (the object is not yet shared)
        object.__setattr__(self, "batch_invariant", True)
        object.__setattr__(self, "linear_backend", "invariant")
        object.__setattr__(self, "model_forward", "fused")

    def _check_cache_policy(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        check_kv_scale_scheme(self.kv_scale_scheme, self.kv_cache_dtype)
        if self.eviction not in EVICTION_POLICIES:
            raise InvalidArgumentError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.hash_fn not in KEY_FUNCTIONS:
            raise InvalidArgumentError(f"hash_fn must be one of {', '.join(sorted(KEY_FUNCTIONS))}, got {self.hash_fn!r}")
        if not isinstance(self.partial_block_reuse, bool):
            raise InvalidArgumentError(f"partial_block_reuse must be a bool, got {self.partial_block_reuse!r}")

    def _check_tiers(self) -> None:
        if isinstance(self.host_blocks, bool) or not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise InvalidArgumentError(f"host_blocks must be an int >= 0, got {self.host_blocks!r}")
        if isinstance(self.disk_bytes, bool) or not isinstance(self.disk_bytes, int) or self.disk_bytes < 0:
            raise InvalidArgumentError(f"disk_bytes must be an int >= 0, got {self.disk_bytes!r}")
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise InvalidArgumentError("the disk tier needs both disk_path and disk_bytes > 0 (or neither)")
        if self.remote_url is not None:
            from pagedkv.tiers.remote import check_remote_url

            check_remote_url(self.remote_url)
        for name in ("remote_timeout_s", "remote_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise InvalidArgumentError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.remote_required, bool):
            raise InvalidArgumentError(f"remote_required must be a bool, got {self.remote_required!r}")
        if self.tiers_enabled and (self.allocator not in ("paged", "hybrid") or not self.enable_prefix_caching):
            raise InvalidArgumentError("tiers need the paged or hybrid allocator with prefix caching on")
        if self.tiers_enabled and self.kv_events and str(self.allocator) == "hybrid" and self.hash_fn == "fast":
            raise InvalidArgumentError("kv_events with tiers and the hybrid allocator need byte keys: hash_fn 'sha256' or 'vllm'")
