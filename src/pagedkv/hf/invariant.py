"""Batch-invariant mode: every row of a step is computed as if it were alone.

A request's logits come out of GEMMs, norms and attention over a packed batch. With the default kernels its
numbers depend on what else is in the batch: oneDNN and MKL pick a different kernel (and summation order)
for every row count, and the attention groups' SDPA/reference tiling depends on the batch's shape and on how
a prompt was chunked. In float32 that moves logprobs in the 6th digit and can flip a greedy token where two
logits nearly tie. RL trainers compare the engine's logprobs with their own forward's, so batch-invariant
mode removes every such dependence:

```
linears    every GEMM runs on ROW_TILE-row tiles (the last one padded with zero rows): a row's result is
           that of one GEMM shape whatever the step's token count and the row's place in its tile
attention  every query token, prefill or decode, is one decode row of the C kernel: the row of token p of
           a request reads the request's block table up to context p + 1, keys in position order, alone
           (pagedkv.ops.cpu_decode); where the kernel does not apply, one `pagedkv.ops` call per row with
           one KV split, so the reference's fixed key tiles start at position 0
per-row    embedding, RMS norm, rotary, SiLU * up, residual adds and log-softmax reduce within a row only
```

So prefill, chunked prefill, decode, a cold prefix and a warm one (its K/V computed by the same per-row
arithmetic, then read from the pages) all give a token the same bits. tests/test_batch_invariant.py checks
each claim on this CPU (a row's GEMM result is independent of its tile position and neighbours, fp32 and
bf16) and the engine-level contract; docs/rl.md measures what the mode costs.

Contract:
- `invariant_linear(weight, bias)` computes `x @ W.T + b` row-invariantly: oneDNN-packed GEMMs
  (`pagedkv.hf.cpu_linear.PackedLinear` with `row_tile=ROW_TILE`) where oneDNN takes the dtype, else
  `torch.nn.functional.linear` on the same tiles.
- `BatchInvariantOptions` are a layer's `AttentionOptions` that ask `pagedkv.hf.attention.attend_layer` for
  the per-row attention above; `FusedLlama` builds them in batch-invariant mode.
- `token_rows(batch)` is the per-token decode metadata: each token's block table row and context length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.hf.step_metadata import StepBatch
from pagedkv.ops.options import AttentionOptions

# Rows per GEMM call. Any fixed count is invariant on this CPU (tests/test_batch_invariant.py checks 16);
# 16 keeps a decode step of one request close to an M=1 GEMM's cost (both read the whole weight once).
ROW_TILE = 16


@dataclass(frozen=True, slots=True)
class BatchInvariantOptions(AttentionOptions):
    """`AttentionOptions` whose layer attends every query token as its own decode row (module docstring)."""

    @classmethod
    def of(cls, options: AttentionOptions) -> BatchInvariantOptions:
        return cls(options.scale, options.sliding_window, options.soft_cap, options.sinks)


def invariant_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x @ weight.T + bias` computed on `ROW_TILE`-row tiles (see the module docstring)."""
    from pagedkv.hf.cpu_linear import PackedLinear, onednn_packs, tiled_rows

    if onednn_packs(weight.dtype):
        return PackedLinear(weight, bias, row_tile=ROW_TILE)
    w, b = weight.detach(), None if bias is None else bias.detach()
    return lambda x: tiled_rows(x, w.shape[1], w.shape[0], lambda t: torch.nn.functional.linear(t, w, b), ROW_TILE)


def token_rows(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 `[T, W]` block table and `[T]` context lengths: packed token t of sequence s at position p reads
    `batch.block_table[s]` up to length p + 1 (its own key included)."""
    q_lens = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(batch.num_seqs, device=q_lens.device), q_lens)
    lens = (batch.position_ids[0] + 1).to(torch.int32)
    return batch.block_table[seq_of_token], lens
