"""`ModelRunner`: execute one `SchedulerOutput` on a transformers model over pagedkv pages.

The scheduler decides *what* runs (which requests, which token ranges, which blocks move); the runner makes
it happen on tensors, in this order:

1. swap-outs (device -> host), then swap-ins (host -> device): the allocator already reassigned the blocks,
   so the bytes must move before anything writes them;
2. copy-on-write block copies (`SchedulerOutput.copies`);
3. one packed forward over every scheduled chunk (`pagedkv.hf.metadata`), with the allocator's block tables
   and slot mapping; the attention function writes the chunk's K/V and reads the pages;
4. the logits of the chunks that end at their request's last known token (`produces_token`), one row each.

The runner never changes allocator or request state; `Scheduler.update` does that with the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedkv.hf.attention import forward_step
from pagedkv.hf.cache import PagedKVCache
from pagedkv.hf.metadata import StepBatch, build_step_batch


class ModelRunner:
    """Runs scheduled steps of one model over one `PagedKVCache`."""

    def __init__(self, model: Any, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device

    def apply_block_moves(self, output: Any) -> None:
        """Swaps then copy-on-write copies, before the forward (see the module docstring)."""
        for device_ids, host_ids in getattr(output, "swap_out", ()) or ():
            self.cache.swap_out(device_ids, host_ids)
        for host_ids, device_ids in getattr(output, "swap_in", ()) or ():
            self.cache.swap_in(host_ids, device_ids)
        copies = getattr(output, "copies", None)
        if copies is not None and len(copies.src):
            self.cache.copy_blocks(copies.src, copies.dst)

    def build_batch(self, manager: Any, chunks: Sequence[Any]) -> StepBatch:
        """Pack the scheduled chunks: tokens `[start, start + num_new_tokens)` of each request."""
        seq_ids = np.fromiter((c.request.seq_id for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        ends = starts + np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        tokens = [
            np.asarray(_token_ids(c.request)[c.start : c.start + c.num_new_tokens], dtype=np.int64)
            for c in chunks
        ]
        return build_step_batch(
            tokens,
            starts,
            manager.block_table(seq_ids, pad_id=0),
            manager.slot_mapping(seq_ids, starts, ends),
            [bool(c.produces_token) for c in chunks],
            device=self.device,
        )

    def execute(self, manager: Any, output: Any) -> torch.Tensor:
        """Run `output`; return logits `[K, vocab]` for its chunks with `produces_token`, in order."""
        self.apply_block_moves(output)
        chunks = list(output.scheduled)
        if not chunks:
            return torch.empty(0, 0)
        return forward_step(self.model, self.cache, self.build_batch(manager, chunks))


def _token_ids(request: Any) -> Sequence[int]:
    """All known token ids of a request (prompt + output so far)."""
    ids = getattr(request, "all_token_ids", None)
    if ids is None:
        return [*request.prompt_token_ids, *request.output_token_ids]
    return ids  # type: ignore[no-any-return]
