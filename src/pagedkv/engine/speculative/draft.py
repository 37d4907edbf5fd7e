"""`DraftModelProposer`: a smaller causal LM with the target's vocabulary proposes k tokens greedily, with its
own KV in pagedkv pages.

The draft has its own uniform manager (`make_manager("paged")`, prefix caching off: its blocks are private
to one request) and its own `PagedKVCache`, run by its own `ModelRunner` in the same packed forward the engine uses. Its blocks are
counted in the engine's KV budget, which is **split**: with `EngineConfig.kv_budget_bytes` the target and
the draft get the same number of blocks, as many as `budget // (target bytes per block + draft bytes per
block)` (each request's draft KV holds the same tokens as its target KV, so equal counts let both hold the
same requests); with `EngineConfig.num_blocks` the count is the target's and the draft gets as many blocks
of its own on top (`Engine.kv_budget_bytes` then counts both).

Per request it keeps a sequence in its manager and the tokens whose KV that sequence holds. A proposal:

```
request:  [ prompt ............ | out ...... last ]          all_token_ids, L tokens
draft KV: [ kept (common prefix with them) | stale ]        stale: drafts the target rejected, a cut stop
1. roll the stale tail back (the core's `rollback`), keeping at least one token to feed
2. feed the gap [kept, L): one chunk per request, all requests in one forward -> d0 = argmax
3. feed d0, d1, ... one token a step -> d1 .. d(k-1)         draft KV: request tokens + d0 .. d(k-2)
```

After the target verifies, the draft's KV past the accepted drafts no longer matches the request; the next
proposal rolls it back (step 1) before it feeds anything, so the draft is always in step with the verified
tokens and never computes a token twice that it still holds. A request whose draft sequence cannot grow
(the draft's pool is full) gets the drafts made so far, or none: a proposer can miss, never fail a request.
`forget(request_id)` frees a request's draft blocks: the engine calls it when a request ends (finish, abort,
error) and when it is preempted (its target KV is freed too; the next proposal starts it again).
`release()` drops every sequence and gives the pages back, `restore()` allocates them again, zeroed: the
engine's `sleep` and `wake_up` (`pagedkv.engine.lifecycle`), whose report counts the draft's bytes.

Proposals are greedy, hence deterministic given the tokens: rejection sampling treats them as one-hot
(`rejection.verify` with `draft_probs=None`), which keeps the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedkv.core.errors import CapacityError, EngineStateError, InvalidArgumentError
from pagedkv.engine.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedkv.core.protocol import KVManager
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.request import Request
    from pagedkv.engine.runner import ModelRunner
    from pagedkv.hf.cache import PagedKVCache


@dataclass(slots=True)
class _DraftSeq:
    """One request's draft sequence, as the runner reads a request: its tokens are all "prompt"."""

    seq_id: int
    prompt_token_ids: list[int]  # the tokens whose slots the draft manager holds for it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


class DraftModelProposer:
    """Greedy proposals of a draft model over its own pages; see the module docstring."""

    def __init__(self, draft: Any, config: EngineConfig, *, vocab_size: int | None = None) -> None:
        from pagedkv.hf.attention import prepare_model
        from pagedkv.hf.cache import cache_spec

        self.model = draft
        self.config = config
        self.spec = prepare_model(draft)
        draft_vocab = int(draft.get_input_embeddings().num_embeddings)
        if vocab_size is not None and draft_vocab != vocab_size:
            raise InvalidArgumentError(
                f"the draft model's vocabulary has {draft_vocab} tokens, the target's {vocab_size}; a draft model "
                "must share the target's tokenizer"
            )
        spec = cache_spec(self.spec, None, config.kv_cache_dtype, config.kv_scale_scheme)
        self.bytes_per_block = spec.bytes_per_block(config.block_size)
        self.manager: KVManager | None = None
        self.runner: ModelRunner | None = None
        self._seqs: dict[str, _DraftSeq] = {}
        self._released: tuple[int, torch.device] | None = None  # (blocks, device) of the pages `release` gave back

    @classmethod
    def load(cls, spec: SpeculativeConfig, model: Any, config: EngineConfig) -> DraftModelProposer:
        """The draft `spec.draft_model` names (`pagedkv.hf.loading`, as the engine's model loads), in the
        target's dtype and on its device, checked to share its vocabulary; its pages come with `allocate`."""
        from pagedkv.hf.loading import check_source, load_weights

        assert spec.draft_model is not None, "SpeculativeConfig: method 'draft' without a draft_model"
        param = next(model.parameters())
        draft = load_weights(check_source(spec.draft_model), dtype=str(param.dtype).removeprefix("torch."))
        draft = draft.to(param.device)  # loaded on the CPU; its forwards run where the target's do
        return cls(draft, config, vocab_size=int(model.get_input_embeddings().num_embeddings))

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> None:
        """The draft's own manager and KV pages: `num_blocks` blocks of the engine's block size."""
        from pagedkv.engine.llm_engine import _prepare_forward
        from pagedkv.engine.managers import make_manager
        from pagedkv.engine.runner import ModelRunner

        cfg = self.config
        manager = make_manager("paged", num_blocks, cfg.block_size, enable_prefix_caching=False)
        _, fused = _prepare_forward(self.model, cfg.linear_backend, cfg.model_forward)
        self.manager = manager
        self.runner = ModelRunner(self.model, self._pages(num_blocks, device), fused)

    def _pages(self, num_blocks: int, device: torch.device | str) -> PagedKVCache:
        """Zeroed KV pages of `num_blocks` blocks for the draft model."""
        from pagedkv.hf.cache import PagedKVCache

        cfg = self.config
        return PagedKVCache.for_model(self.spec, num_blocks, cfg.block_size, device=device,
                                      attention_backend=cfg.attention_backend, kv_cache_dtype=cfg.kv_cache_dtype,
                                      kv_scale_scheme=cfg.kv_scale_scheme)  # fmt: skip

    @property
    def released(self) -> bool:
        """True between `release` and `restore`: the draft holds no KV pages and cannot propose."""
        return self._released is not None

    def release(self) -> int:
        """Drop every request's draft sequence and give back the draft's KV pages (device pages and host
        pool: the engine's `sleep`); the bytes released. Its KV is gone, so no sequence may outlive it: a
        request parked across the sleep starts its draft sequence again. Releasing twice releases nothing."""
        if self.manager is None or self.runner is None or self._released is not None:
            return 0
        for request_id in list(self._seqs):
            self.forget(request_id)
        cache = self.runner.cache
        storage = cache.storage
        freed = 0
        for owner, name in ((storage, "data"), (storage, "scales"), (cache, "host"), (cache, "host_scales")):
            tensor = getattr(owner, name, None)
            if isinstance(tensor, torch.Tensor):
                freed += tensor.numel() * tensor.element_size()
                setattr(owner, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        self._released = (int(storage.num_blocks), storage.device)
        return freed

    def restore(self) -> None:
        """Allocate the pages `release` gave back, zeroed (the engine's `wake_up`); nothing when none were."""
        if self._released is None or self.runner is None:
            return
        num_blocks, device = self._released
        self.runner.cache = self._pages(num_blocks, device)
        self._released = None

    @property
    def num_used_blocks(self) -> int:
        """Draft blocks held by requests (0 once every request has ended)."""
        return 0 if self.manager is None else int(self.manager.num_used_blocks)

    def forget(self, request_id: str) -> None:
        """Free the request's draft blocks (it ended or was preempted)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and self.manager is not None:
            self.manager.free(seq.seq_id)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to `num_tokens[i]` greedy draft tokens after each request's tokens (module docstring)."""
        if self.manager is None or self.runner is None:
            raise InvalidArgumentError("DraftModelProposer.allocate must run before propose (the engine does it)")
        if self._released is not None and any(k > 0 for k in num_tokens):
            raise EngineStateError("the draft model's KV pages were released (the engine sleeps); restore() first")
        drafts: list[list[int]] = [[] for _ in requests]
        chunks: list[tuple[int, _DraftSeq, int]] = []  # (request index, its draft sequence, first token to feed)
        for i, (request, k) in enumerate(zip(requests, num_tokens)):
            if k > 0 and (fed := self._catch_up(request)) is not None:
                chunks.append((i, self._seqs[request.request_id], fed))
        with torch.inference_mode():
            for step in range(max((num_tokens[i] for i, _, _ in chunks), default=0)):
                if step > 0:  # feed each the token it just proposed, while it wants more and has room
                    chunks = [(i, s, len(s.prompt_token_ids) - 1) for i, s, _ in chunks
                              if num_tokens[i] > step and self._grow(s, drafts[i][-1])]  # fmt: skip
                if not chunks:
                    break
                picks = self._forward(chunks)
                for (i, _, _), token in zip(chunks, picks):
                    drafts[i].append(token)
        return drafts

    def _catch_up(self, request: Request) -> int | None:
        """Bring the request's draft sequence to its tokens: roll back what no longer matches, allocate slots
        for the rest; the first position to feed, or None when the draft's pool has no room (nothing held)."""
        assert self.manager is not None, "DraftModelProposer: no manager"
        tokens = [int(t) for t in request.all_token_ids]
        seq = self._seqs.get(request.request_id)
        if seq is None:
            try:
                admission = self.manager.admit(np.asarray(tokens, dtype=np.int64))
            except CapacityError:
                return None  # longer than the draft's whole pool
            if admission is None:
                return None
            self._seqs[request.request_id] = _DraftSeq(admission.seq_id, tokens)
            return 0
        held = seq.prompt_token_ids
        keep = 0
        limit = min(len(held), len(tokens) - 1)  # at least one token to feed: its logits propose d0
        while keep < limit and held[keep] == tokens[keep]:
            keep += 1
        if keep < len(held):
            self.manager.rollback(seq.seq_id, len(held) - keep)
        seq.prompt_token_ids = tokens[:keep]
        if not self.manager.append([seq.seq_id], num_tokens=len(tokens) - keep):
            self.forget(request.request_id)  # its stale KV is gone; the next proposal starts it again
            return None
        seq.prompt_token_ids = tokens
        return keep

    def _grow(self, seq: _DraftSeq, token: int) -> bool:
        """One more slot for `token`; False (nothing changed) when the draft's pool is full."""
        assert self.manager is not None, "DraftModelProposer: no manager"
        if not self.manager.append([seq.seq_id], num_tokens=1):
            return False
        seq.prompt_token_ids.append(token)
        return True

    def _forward(self, chunks: list[tuple[int, _DraftSeq, int]]) -> list[int]:
        """One packed forward of the draft over each sequence's tokens from its start position; the argmax
        after each (ties to the lowest id, as greedy sampling)."""
        from pagedkv.engine.scheduler import ScheduledChunk

        assert self.manager is not None and self.runner is not None, "DraftModelProposer: not allocated"
        scheduled = [ScheduledChunk(s, start, len(s.prompt_token_ids) - start, True) for _, s, start in chunks]  # type: ignore[arg-type]  # a draft sequence
        logits = self.runner.forward(self.runner.build_batches(self.manager, scheduled))
        seq_ids = np.array([s.seq_id for _, s, _ in chunks], dtype=np.int64)
        self.manager.mark_computed(seq_ids, np.array([len(s.prompt_token_ids) for _, s, _ in chunks], dtype=np.int64))
        return [int(t) for t in logits.argmax(-1).tolist()]

    def check_invariants(self) -> None:
        """The manager's own, and each draft sequence holds exactly the tokens recorded for it."""
        if self.manager is None:
            return
        self.manager.check_invariants()
        for rid, seq in self._seqs.items():
            held = int(self.manager.num_tokens(seq.seq_id))
            if held != len(seq.prompt_token_ids):
                raise AssertionError(f"DraftModelProposer: request {rid!r} holds {held} slots for {len(seq.prompt_token_ids)} tokens")
