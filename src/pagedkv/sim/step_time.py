"""The step-time model: a roofline of one forward pass, standing in for the GPU.

    step_s = max(bytes / HBM bandwidth, FLOPs / peak FLOP/s) + overhead_s

    bytes = weights                                  (every step reads every weight once)
          + sum over chunks of (start + n) x kv_bytes_per_token   (KV read: the chunk's whole context)
          + sum over chunks of n x kv_bytes_per_token             (KV written: the new tokens)
    FLOPs = 2 x params x sum(n)                                   (matmuls: 2 FLOPs per weight per token)
          + sum over chunks of 4 x layers x q_heads x head_dim x attended(start, n)

A chunk is `n` new tokens of one request whose first `start` tokens are already computed:

    |<------ start (cached KV) ------>|<---- n new tokens ---->|
    token i (0 <= i < n) attends to start + i + 1 keys (causal), so
    attended(start, n) = n * start + n * (n + 1) / 2
    and each (query, key) pair costs 2 x head_dim FLOPs for QK^T plus 2 x head_dim for PV, per head, per layer.

A hybrid model's sliding layers (window W) read only their window: min(start + n, W - 1 + n) tokens per
chunk (`kv_read_bytes`), whatever the allocator keeps; their attention FLOPs are still counted over the whole
context (prefill chunks of long prompts are bounded by the full layers anyway).

The KV read counts each chunk's context once per step, as FlashAttention-style kernels do when a chunk's
queries share the streamed keys (prefill chunks are compute-bound, so re-reads per query tile would not change
the answer). Everything is divided across `tensor_parallel` GPUs: per-GPU bytes and FLOPs are 1/tp of the
total. Communication between GPUs is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.sim.catalog import GPUSpec, ModelShape


@dataclass(frozen=True)
class StepCost:
    """One step's roofline terms, for inspection and tests."""

    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass(frozen=True)
class StepTimeModel:
    """Roofline step time of `model` on `tensor_parallel` x `gpu`, plus a fixed per-step overhead."""

    model: ModelShape
    gpu: GPUSpec
    overhead_s: float = 0.002
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.overhead_s, int | float) or self.overhead_s < 0:
            raise InvalidArgumentError(f"step overhead must be >= 0 seconds, got {self.overhead_s!r}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise InvalidArgumentError(f"tensor_parallel must be an int >= 1, got {self.tensor_parallel!r}")

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs for one (query token, key token) pair over all layers and heads: QK^T and PV."""
        m = self.model
        return 4 * m.num_layers * m.num_attention_heads * m.head_dim

    def cost(self, starts: npt.ArrayLike, num_new_tokens: npt.ArrayLike) -> StepCost:
        """Roofline terms of one step scheduling chunks `(starts[i], num_new_tokens[i])`."""
        start = np.asarray(starts, dtype=np.float64)
        new = np.asarray(num_new_tokens, dtype=np.float64)
        if start.shape != new.shape or start.ndim != 1:
            raise InvalidArgumentError(
                f"starts and num_new_tokens must be 1-D and the same length, got {start.shape} and {new.shape}"
            )
        if start.size and (start.min() < 0 or new.min() < 0):
            raise InvalidArgumentError("starts and num_new_tokens must be >= 0")
        m = self.model
        kv = float(m.kv_bytes_per_token)
        tokens = float(new.sum())
        kv_read = self.kv_read_bytes(start, new)
        kv_written = tokens * kv
        bytes_moved = float(m.weight_bytes) + kv_read + kv_written
        attended = float((new * start + new * (new + 1) / 2).sum())
        flops = 2.0 * m.num_params * tokens + self.attention_flops_per_pair * attended
        tp = self.tensor_parallel
        return StepCost(
            bytes_moved=bytes_moved,
            flops=flops,
            memory_s=bytes_moved / (tp * self.gpu.hbm_bandwidth_bytes_per_s),
            compute_s=flops / (tp * self.gpu.bf16_flops_per_s),
            overhead_s=float(self.overhead_s),
        )

    def kv_read_bytes(self, start: npt.NDArray[np.float64], new: npt.NDArray[np.float64]) -> float:
        """KV bytes a step's chunks read: each layer its context, a sliding layer only its window."""
        m = self.model
        if not m.is_hybrid:
            return float((start + new).sum()) * float(m.kv_bytes_per_token)
        total = 0.0
        for w in set(m.layer_windows):
            n_layers = m.layer_windows.count(w)
            read = start + new if w is None else np.minimum(start + new, w - 1 + new)
            total += float(read.sum()) * n_layers * m.kv_bytes_per_layer_token
        return total

    def step_seconds(self, starts: npt.ArrayLike, num_new_tokens: npt.ArrayLike) -> float:
        return self.cost(starts, num_new_tokens).seconds
