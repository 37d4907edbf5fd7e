"""`ModelRunner`: execute one `SchedulerOutput` on a transformers model over pagedkv pages.

The scheduler decides *what* runs (which requests, which token ranges, which blocks move); the runner makes
it happen on tensors, in this order:

1. swap-ins (host -> device), then swap-outs (device -> host), the order in which the scheduler decides
   them (`PagedKVCache.swap`): the allocator already reassigned the blocks, so the bytes must move before
   anything writes them;
2. copy-on-write block copies (`SchedulerOutput.copies`), then the tier hits' bytes (`SchedulerOutput.fills`);
   the scheduler's plan has one writer per device block (`SchedulerOutput.check_writes`);
3. one packed forward over every scheduled chunk (`pagedkv.hf.step_metadata`), with the allocator's block
   tables and slot mapping; the attention function writes the chunk's K/V and reads the pages. The forward
   is transformers' (`pagedkv.hf.attention.forward_step`) or, for a Llama-structured model, the fused one
   (`pagedkv.hf.fused_llama`): the same arithmetic with fewer calls;
4. the logits of the chunks that end at their request's last known token (`produces_token`), one row each.

The runner never changes allocator or request state; `Scheduler.update` does that with the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.hf.attention import forward_step
from pagedkv.hf.cache import PagedKVCache
from pagedkv.hf.step_metadata import StepBatch, build_step_batch
from pagedkv.storage.block_rows import write_rows

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager
    from pagedkv.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedkv.hf.fused_llama import FusedLlama


class ModelRunner:
    """Runs scheduled steps of one model over one `PagedKVCache`."""

    def __init__(self, model: Any, cache: PagedKVCache, fused: FusedLlama | None = None) -> None:
        self.model = model
        self.cache = cache
        self.fused = fused
        self.device = next(model.parameters()).device

    def apply_block_moves(self, output: SchedulerOutput) -> None:
        """Swaps, copy-on-write copies, then tier fills, before the forward (see the module docstring)."""
        if len(output.swap_out.src) or len(output.swap_in.src):
            # swap_in: host src -> device dst, then swap_out: device src -> host dst
            self.cache.swap(output.swap_out.src, output.swap_out.dst, output.swap_in.src, output.swap_in.dst)
        if len(output.copies.src):
            self.cache.copy_blocks(output.copies.src, output.copies.dst)
        for fill in output.fills:
            write_rows(self.cache.storage, fill.dst.tolist(), fill.rows)

    def build_batch(self, manager: KVManager, chunks: Sequence[ScheduledChunk]) -> StepBatch:
        """Pack the scheduled chunks: tokens `[start, start + num_new_tokens)` of each request."""
        return self.build_batches(manager, chunks)[0]

    def build_batches(self, manager: KVManager, chunks: Sequence[ScheduledChunk]) -> tuple[StepBatch, ...]:
        """`build_batch` once per KV cache group of a hybrid model's cache (`PagedKVCache.layer_map`):
        the same tokens with each group's block table and slot mapping; one batch otherwise."""
        seq_ids = np.fromiter((c.request.seq_id for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        ends = starts + np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        tokens = [np.asarray(_chunk_tokens(c), dtype=np.int64) for c in chunks]
        produces = [bool(c.produces_token) for c in chunks]
        if self.cache.layer_map is None:
            tables = [(manager.block_table(seq_ids, pad_id=0), manager.slot_mapping(seq_ids, starts, ends))]
        else:
            groups = range(max(g for g, _ in self.cache.layer_map) + 1)
            tables = [
                (manager.block_table(seq_ids, pad_id=0, group=g), manager.slot_mapping(seq_ids, starts, ends, group=g))  # type: ignore[call-arg]
                for g in groups
            ]
        return tuple(build_step_batch(tokens, starts, t, s, produces, device=self.device) for t, s in tables)

    def execute(self, manager: KVManager, output: SchedulerOutput) -> torch.Tensor:
        """Run `output`; return logits `[K, vocab]` for its chunks with `produces_token`, in order."""
        self.apply_block_moves(output)
        chunks = list(output.scheduled)
        if not chunks:
            return torch.empty(0, 0)
        return self.forward(self.build_batches(manager, chunks))

    def forward(self, batches: tuple[StepBatch, ...]) -> torch.Tensor:
        """The packed forward over `batches` (one per KV cache group); the logits of `logits_indices`' rows."""
        rest = batches if len(batches) > 1 else None
        if self.fused is not None:
            return self.fused(self.cache, batches[0], rest)
        return forward_step(self.model, self.cache, batches[0], rest)


def _chunk_tokens(chunk: ScheduledChunk) -> Sequence[int] | npt.NDArray[np.int64]:
    """Token ids `[start, end)` of the chunk's request, without copying the whole prompt for a decode."""
    request, n = chunk.request, chunk.request.num_prompt_tokens
    if chunk.start >= n:
        return request.output_token_ids[chunk.start - n : chunk.end - n]
    if chunk.end <= n:
        return request.prompt_token_ids[chunk.start : chunk.end]
    return request.all_token_ids[chunk.start : chunk.end]
