"""The KV budget: how much GPU memory is left for the KV cache, and how many blocks that makes.

    kv_budget = tp x memory x gpu_memory_utilization - weights - activation reserve
    num_blocks = kv_budget // bytes_per_block   (block_size x bytes per token, scales included:
                                                 `ModelShape.kv_bytes_per_block`)

The activation reserve stands in for the profiling pass a serving engine runs at start-up (vLLM's
`determine_num_available_blocks`): the peak transient memory of one forward pass over
`max_num_batched_tokens` tokens plus the sampler's logits for `max_num_seqs` sequences:

    activation = max_num_batched_tokens x (4 x hidden + 2 x intermediate) x dtype bytes   (residual, q/k/v/o
                 and the gated-MLP intermediate live at once)
               + max_num_seqs x vocab x 4                                                 (fp32 logits)

It can be overridden with an explicit byte count. Everything is printed, in GiB (2^30 bytes) throughout, so
the arithmetic can be checked. `tensor_parallel` must shard the attention heads evenly (each GPU takes
heads / tp query heads; KV heads split or replicated), else `InvalidArgumentError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.sim.catalog import GPUSpec, ModelShape
from pagedkv.storage.kv_spec import blocks_in_budget

GIB = 1024**3


def activation_reserve_bytes(model: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak transient memory of one forward pass (see the module docstring)."""
    per_token = (4 * model.hidden_size + 2 * model.intermediate_size) * model.dtype_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * model.vocab_size * 4


@dataclass(frozen=True)
class KVBudget:
    """The budget arithmetic for one model on `tensor_parallel` x GPU, and the block count it yields."""

    model: ModelShape
    gpu: GPUSpec
    gpu_memory_utilization: float
    block_size: int
    activation_bytes: int
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.activation_bytes < 0:
            raise InvalidArgumentError(
                f"activation reserve must be >= 0 bytes, got {self.activation_bytes!r}"
            )
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise InvalidArgumentError(f"tensor_parallel must be an int >= 1, got {self.tensor_parallel!r}")
        tp, heads, kv_heads = self.tensor_parallel, self.model.num_attention_heads, self.model.num_kv_heads
        # each GPU takes heads / tp query heads; KV heads are split (kv_heads % tp == 0) or replicated
        # (tp % kv_heads == 0), as vLLM and Megatron shard them
        if heads % tp or (kv_heads % tp and tp % kv_heads):
            choices = [
                d for d in range(1, heads + 1) if heads % d == 0 and not (kv_heads % d and d % kv_heads)
            ]
            raise InvalidArgumentError(
                f"--tensor-parallel {tp} cannot shard {self.model.name} ({heads} attention heads, {kv_heads} KV "
                f"heads) evenly across GPUs; choose one of {', '.join(map(str, choices))}"
            )
        if self.kv_budget_bytes < 2 * self.bytes_per_block:
            raise CapacityError(
                f"no room for the KV cache: {self.tensor_parallel} x {self.gpu.name} "
                f"({self.total_memory_bytes / GIB:.1f} GiB) x utilisation {self.gpu_memory_utilization} = "
                f"{self.usable_bytes / GIB:.2f} GiB, minus weights of {self.model.name} "
                f"({self.model.weight_bytes / GIB:.2f} GiB) and activation reserve "
                f"({self.activation_bytes / GIB:.2f} GiB) leaves {self.kv_budget_bytes / GIB:.3f} GiB, less than "
                f"two blocks of {self.bytes_per_block:,} bytes (one is the null block); use a bigger GPU, more GPUs (--tensor-parallel), "
                "a higher --gpu-memory-utilization or a smaller model"
            )

    @property
    def total_memory_bytes(self) -> int:
        return self.tensor_parallel * self.gpu.memory_bytes

    @property
    def usable_bytes(self) -> int:
        return int(self.total_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_budget_bytes(self) -> int:
        return self.usable_bytes - self.model.weight_bytes - self.activation_bytes

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token over every layer, its share of block scales included: an int unless block
        scales do not divide evenly among a block's tokens."""
        per_block = self.model.kv_bytes_per_block(self.block_size)
        tokens, rest = divmod(per_block, self.block_size)
        return tokens if rest == 0 else per_block / self.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size)

    @property
    def num_blocks(self) -> int:
        return blocks_in_budget(self.kv_budget_bytes, self.bytes_per_block)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: one block of the pool is the null/guard block padding points at."""
        return self.num_blocks - 1

    @property
    def num_tokens(self) -> int:
        """Tokens the usable blocks hold."""
        return self.num_usable_blocks * self.block_size

    def _kv_dtype(self) -> str:
        m = self.model
        if m.kv_cache_dtype == "auto":
            return f"{m.dtype_bytes}-byte values"
        return f"{m.kv_cache_dtype}: 1-byte values + a float32 scale per {m.kv_scale_scheme} and KV head"

    def lines(self) -> list[str]:
        """The arithmetic, one line each, for printing (GiB = 2^30 bytes)."""
        tp = f"{self.tensor_parallel} x " if self.tensor_parallel > 1 else ""
        rows = [
            (f"GPU memory ({tp}{self.gpu.name})", self.total_memory_bytes),
            (f"x utilisation {self.gpu_memory_utilization:g}", self.usable_bytes),
            (
                f"- weights ({self.model.name}, {self.model.num_params / 1e9:.2f}B params, bf16)",
                self.model.weight_bytes,
            ),
            ("- activation reserve (profile estimate)", self.activation_bytes),
            ("= KV budget", self.kv_budget_bytes),
        ]
        width = max(len(label) for label, _ in rows)
        out = [f"{label.ljust(width)}  {value / GIB:8.2f} GiB" for label, value in rows]
        out.append(
            f"KV per token ({self._kv_dtype()}) {self.bytes_per_token:,} bytes; per block of {self.block_size} tokens "
            f"{self.bytes_per_block:,} bytes; {self.num_blocks:,} blocks, 1 of them the null block "
            f"({self.num_tokens:,} tokens for requests)"
        )
        return out
