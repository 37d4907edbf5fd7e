"""`Engine`: continuous batching of a transformers model on pagedkv.

One step is an explicit data contract (no hidden forward context):

```
out     = scheduler.schedule(now)           # which chunks run, which blocks move (torch-free)
logits  = runner.execute(manager, out)      # block moves, one packed forward, logits of sampling chunks
sampled = sample(logits, params, gens)      # one token per sampling chunk (+ n-1 children on first token)
done    = scheduler.update(out, sampled, t) # append tokens, max-tokens / EOS / stop-token stops, free finished
engine:   stop strings, step statistics, then streaming callbacks, then the step's outputs
```

The scheduler owns the queue (priority, then arrival), the token budget, chunked prefill, prefix caching,
preemption (recompute or swap); the allocator is chosen here (`EngineConfig.allocator`).

Contracts (docs/engine.md spells them out; tests/engine/test_engine_contracts.py pins each one):

- the door: `add_request` / `generate` check everything (`pagedkv.engine.intake`) before queueing anything;
  misuse is an `InvalidArgumentError`, a request that can never be served a `CapacityError`;
- one request's failure (unsamplable logits, a stop-string check, an allocator refusal, its callback) ends
  that request with finish_reason "error" and the message; the others go on. A failure that belongs to no
  request (the forward raising) propagates with the engine consistent: the next `step()` redoes the step;
- `on_token` runs once per new token, after the step's state is final, with a snapshot taken before any
  callback of the step; it may `finish` any request or `add_request`, not `step`; an exception in it is
  caught, logged and recorded on its request only (which ends with "error" unless it had already ended);
- `step()` returns every output that ended since the previous call, each exactly once;
- child i of an `n > 1` request "A" is "A.i", reserved when "A" is accepted; automatic ids skip ids in use;
- `finish(id, "abort" | "stop")`: unknown ids are an error, ended ones a no-op (False); a parent takes its
  unfinished children with it; forked children count against `max_num_seqs`;
- `cache_salt` per request keys the prefix cache: different salts never share a block;
- speculative decoding (`EngineConfig.speculative`, `pagedkv.engine.speculative`) changes how many tokens a
  step appends, never which: greedy output is token-identical with and without it, sampled output follows
  the same distribution (rejection sampling), and the log-probabilities of accepted tokens are those of the
  forward that verified them. A step may append several tokens to a request: `on_token` then runs once for
  them all, and a stop string cuts the output at the token that completed it. A draft model
  (`speculative.draft`) holds KV pages of its own, inside the KV budget, freed when a request ends or is
  preempted;
- `SamplingParams.logprobs` / `prompt_logprobs` are recorded on the outputs from the raw logits, apart from
  the draw (a request asking for prompt log-probabilities computes its whole prompt: its blocks are keyed
  by a salt of its own, so it takes no prefix-cache hit); `release(id)` hands a finished request's outputs
  back and frees its ids (a long-lived caller of `add_request` + `step` keeps memory bounded with it).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.core.group import group_layers
from pagedkv.core.protocol import KVManager
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.groups import PrefillGroups
from pagedkv.engine.intake import RequestIntake, family_ids, salt_bytes
from pagedkv.engine.outputs import EngineStats, RequestOutput, TokenLogprobs
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import bad_rows, make_generator, sample, token_logprobs
from pagedkv.engine.speculative.budget import DraftBudget
from pagedkv.engine.speculative.draft import DraftModelProposer
from pagedkv.engine.speculative.proposer import make_proposer
from pagedkv.engine.speculative.rejection import verify
from pagedkv.engine.speculative.stats import SpecStats
from pagedkv.engine.speculative.view import with_drafts
from pagedkv.hf.attention import prepare_model
from pagedkv.hf.cache import PagedKVCache, cache_spec
from pagedkv.storage.kv_spec import blocks_in_budget

if TYPE_CHECKING:
    from pagedkv.engine.lifecycle import Lifecycle, SleepReport, UpdateReport, WakeReport, WeightSource
    from pagedkv.engine.request import Request
    from pagedkv.engine.tiering import EngineTiering
    from pagedkv.hf.fused_llama import FusedLlama

logger = logging.getLogger(__name__)

TokenCallback = Callable[[RequestOutput], None]
CALLER_FINISH_REASONS = ("abort", "stop")


@dataclass(slots=True)
class _Tracked:
    """Engine-side state of one accepted request (the scheduler owns the `Request`)."""

    request: Request
    params: SamplingParams
    generator: torch.Generator | None
    on_token: TokenCallback | None
    parent_id: str | None = None
    children_forked: bool = False
    stop_text: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when params.logprobs is set
    prompt_logprobs: dict[int, TokenLogprobs] | None = None  # prompt position -> entry, when asked


class Engine:
    """Serve one model: `add_request` + `step`, or `generate` for a batch. See the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        from pagedkv.engine.managers import is_hybrid
        from pagedkv.engine.scheduler import Scheduler

        self.config = config or EngineConfig(num_blocks=256)
        self.model = model
        self.tokenizer = tokenizer
        self.clock = clock
        self.spec = prepare_model(model)
        cfg = self.config
        self.linear_backend, fused = _prepare_forward(model, cfg.linear_backend, cfg.model_forward)
        # 1. the cache's size, then the allocator, the KV tensors and the scheduler over them
        # (allocator "hybrid": the model's layers in KV cache groups, pagedkv.core.group; pages hold one group)
        self.layer_groups = group_layers(self.spec.sliding_windows) if is_hybrid(cfg.allocator) else None
        spec = cfg.speculative  # a draft model loads first: its KV blocks share the budget (speculative.draft)
        self.proposer = make_proposer(spec, model, cfg) if spec else None
        self.draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        num_blocks, num_host, bytes_per_block = self._cache_size()
        self.manager = self._make_manager(num_blocks, num_host)
        device = next(model.parameters()).device
        self.cache = PagedKVCache.for_model(
            self.spec,
            num_blocks,
            cfg.block_size,
            num_host_blocks=num_host,
            device=device,
            attention_backend=cfg.attention_backend,
            layer_groups=self.layer_groups,
            kv_cache_dtype=cfg.kv_cache_dtype,
            kv_scale_scheme=cfg.kv_scale_scheme,
        )
        self.kv_budget_bytes = num_blocks * bytes_per_block
        if self.draft is not None:  # as many blocks of its own as the target's
            self.draft.allocate(num_blocks, device)
            self.kv_budget_bytes += num_blocks * self.draft.bytes_per_block
        self.stats = EngineStats(cache_misses=self.manager.misses)
        self.tiering: EngineTiering | None = self._make_tiering(model) if cfg.tiers_enabled else None
        self.scheduler = Scheduler(  # tier hits: fetch_blocks; draft slots: k a decoding request
            self.manager, cfg.scheduler, source=self.tiering, num_lookahead_tokens=spec.k if spec else 0
        )
        self.stats.spec = SpecStats(spec.k) if spec else None
        self.draft_budget = DraftBudget(spec.k, spec.budget) if spec else None  # each request's k, for the step
        self._base_tokens = 0  # the last step's scored tokens besides drafts
        self.runner = ModelRunner(model, self.cache, fused)
        self.kv_events: Any = None
        if cfg.kv_events:  # one event log for every medium (pagedkv.engine.kv_events)
            from pagedkv.engine.kv_events import EngineEvents

            self.kv_events = EngineEvents(
                self.manager, cfg.block_size, self.tiering, int_keys=cfg.hash_fn == "fast"
            )
        # 2. the requests' bookkeeping and the intake that checks them
        self._init_requests(model, tokenizer)

    def _make_tiering(self, model: Any) -> EngineTiering:
        """Host RAM / disk / remote store below the device (pagedkv.engine.tiering), keyed by the weights."""
        from pagedkv.engine.tiering import EngineTiering
        from pagedkv.hf.loading import weights_digest

        cfg = self.config
        model_id = str(getattr(model.config, "_name_or_path", "") or self.spec.model_type)
        digest = getattr(model, "pagedkv_weights_digest", None) or weights_digest(model)  # loading caches it
        tiering = EngineTiering.build(
            cfg, self.cache.storage, self.manager, model_id, weights=digest, keep_device_events=cfg.kv_events
        )
        self.stats.tiers = tiering.stats
        return tiering

    def _make_manager(self, num_blocks: int, num_host: int) -> KVManager:
        """The allocator `EngineConfig.allocator` names, over the cache's blocks."""
        from pagedkv.engine.managers import make_manager

        cfg = self.config
        return make_manager(
            cfg.allocator,
            num_blocks,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            num_host_blocks=num_host,
            record_events=cfg.tiers_enabled or cfg.kv_events,  # tiers and event logs follow the cache
            eviction=cfg.eviction,
            hash_fn=cfg.hash_fn,
            partial_reuse=cfg.partial_block_reuse and cfg.enable_prefix_caching,
            groups=[g.spec for g in self.layer_groups] if self.layer_groups else None,
        )

    def _cache_size(self) -> tuple[int, int, int]:
        """(device blocks, host blocks, bytes per device block) from the block count or the byte budget;
        host blocks default to as many as the device's when preemption swaps."""
        cfg = self.config
        spec = cache_spec(self.spec, self.layer_groups, cfg.kv_cache_dtype, cfg.kv_scale_scheme)
        bytes_per_block = spec.bytes_per_block(cfg.block_size)
        draft_bytes = self.draft.bytes_per_block if self.draft is not None else 0  # the budget split with it
        num_blocks = (
            cfg.num_blocks
            if cfg.num_blocks is not None
            else blocks_in_budget(int(cfg.kv_budget_bytes or 0), bytes_per_block + draft_bytes)
        )
        if num_blocks < 2:
            raise CapacityError(
                f"a KV budget of {cfg.kv_budget_bytes} bytes holds {num_blocks} blocks of {bytes_per_block} bytes "
                f"({cfg.block_size} tokens of {self.spec.model_type}); need at least 2 (block 0 is the null block)"
            )
        num_host = (
            cfg.num_host_blocks
            if cfg.num_host_blocks is not None
            else (num_blocks if cfg.scheduler.preemption_mode == "swap" else 0)
        )
        return num_blocks, num_host, bytes_per_block

    def _init_requests(self, model: Any, tokenizer: Any) -> None:
        cfg = self.config
        self._tracked: dict[str, _Tracked] = {}  # accepted and not yet ended
        self._outputs: dict[str, RequestOutput] = {}  # final outputs, until `generate` hands them back
        self._undelivered: list[str] = []  # ended since the last `step()` returned
        self._ids_in_use: set[str] = set()  # accepted ids and the child ids they reserve
        self._auto_ids = itertools.count()
        self._in_callbacks = False
        self._scoring: set[str] = set()  # requests whose prompt log-probabilities are still being computed
        self._groups = PrefillGroups()  # requests held until their group's leader wrote the prompt
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        self.intake = RequestIntake(
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            block_size=cfg.block_size,
            num_blocks=int(self.manager.capacity_tokens) // cfg.block_size,  # per sequence (hybrid: its groups' share)
            max_position_embeddings=self.spec.max_position_embeddings,
            enable_chunked_prefill=cfg.scheduler.enable_chunked_prefill,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            has_tokenizer=tokenizer is not None,
        )

    # --- requests -------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return int(self.manager.capacity_tokens)

    def encode(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: ids pass through (ints >= 0, checked); text needs the tokenizer (chat
        template if `chat`)."""
        from pagedkv.engine.request import as_prompt_tokens

        if not isinstance(prompt, str):
            return as_prompt_tokens(prompt)
        if self.tokenizer is None:
            raise InvalidArgumentError(
                "text prompts need a tokenizer; pass token ids or Engine(model, tokenizer)"
            )
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return as_prompt_tokens(ids)
        return as_prompt_tokens(self.tokenizer(prompt)["input_ids"])

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        on_token: TokenCallback | None = None,
        chat: bool = False,
        cache_salt: str | bytes | None = None,
        group_id: str | None = None,
    ) -> str:
        """Queue one request; returns its id. Everything is checked first (see the module docstring):
        `InvalidArgumentError` for misuse, `CapacityError` if it can never be served; either way nothing
        is queued. `cache_salt` isolates its prefix cache entries from requests with another salt.
        `group_id`: requests of one group with the same prompt compute it once (`pagedkv.engine.groups`)."""
        params = params if params is not None else SamplingParams()
        PrefillGroups.check(group_id)
        rid = request_id if request_id is not None else self._new_id(_n_of(params))
        tracked = self._prepare(prompt, params, rid, priority, arrival_time, on_token, chat, cache_salt)
        if group_id is not None and self._groups.hold(tracked, group_id, self._tracked.__contains__):
            self._ids_in_use.update(family_ids(rid, tracked.params.n))  # queued once its leader's prompt is in
            return rid
        self._accept(tracked)
        return rid

    def _new_id(self, n: int) -> str:
        """The next automatic id whose own and children's ids are all free. A request with more completions
        than blocks is refused at the door and reserves no child id, so checking that many is enough."""
        n = min(n, self.intake.num_blocks + 1)
        while True:
            rid = f"req-{next(self._auto_ids)}"
            if not any(i in self._ids_in_use for i in family_ids(rid, n)):
                return rid

    def _prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        rid: str,
        priority: int,
        arrival_time: float | None,
        on_token: TokenCallback | None,
        chat: bool,
        cache_salt: str | bytes | None,
    ) -> _Tracked:
        """Check one request and build it; changes nothing (`RequestIntake.build` is the door)."""
        if self._life is not None:  # paused or asleep: refused (pagedkv.engine.lifecycle)
            self._life.check_door()
        if on_token is not None and not callable(on_token):
            raise InvalidArgumentError(f"on_token must be callable or None, got {type(on_token).__name__}")
        if not isinstance(chat, bool):
            raise InvalidArgumentError(f"chat must be a bool, got {chat!r}")
        if not isinstance(params, SamplingParams):  # before its fields are read below
            raise InvalidArgumentError(f"params must be a SamplingParams, got {type(params).__name__}")
        request = self.intake.build(
            rid,
            self.encode(prompt, chat=chat),
            params,
            priority=priority,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt if params.prompt_logprobs is None else _scoring_salt(cache_salt, rid),
            ids_in_use=self._ids_in_use,
        )
        return _Tracked(request, params, make_generator(params.child_seed(0)), on_token)

    def _accept(self, tracked: _Tracked) -> None:
        request = tracked.request
        self.scheduler.add_request(request)
        self._tracked[request.request_id] = tracked
        self._ids_in_use.update(family_ids(request.request_id, tracked.params.n))
        if tracked.params.prompt_logprobs is not None and request.num_prompt_tokens > 1:
            tracked.prompt_logprobs = {}
            self._scoring.add(request.request_id)

    def finish(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now (a client abort, a stop the caller detects); True if it ended it, False if it
        had already ended. Allowed from an `on_token` callback, for any request. Finishing an `n > 1`
        parent finishes its unfinished children too. See the module docstring."""
        if reason not in CALLER_FINISH_REASONS:
            raise InvalidArgumentError(
                f"finish reason must be one of {', '.join(CALLER_FINISH_REASONS)}, got {reason!r}"
            )
        held = self._groups.take(request_id)  # a sample group's request still held: queued, then ended below
        if held is not None:
            self._accept(held)
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.request.is_finished:
            self._collect(tracked)
            return False
        if tracked is None:
            if request_id in self._outputs:
                return False
            raise InvalidArgumentError(
                f"no request {request_id!r} in this engine (never added, not forked yet, or already returned by "
                "generate)"
            )
        now = self.clock()
        family = [tracked]
        if tracked.parent_id is None:
            tracked.children_forked = True  # an ended parent forks nothing
            family += [t for t in self._tracked.values() if t.parent_id == request_id]
        for t in family:
            self._end(t, reason, now)
        return True

    def _end(self, tracked: _Tracked, reason: str, now: float, error: str | None = None) -> None:
        """Finish `tracked` in the scheduler (if it has not finished) and record its final output."""
        if not tracked.request.is_finished:
            self.scheduler.finish(tracked.request, reason, now, error=error)
        self._collect(tracked)

    def get_request(self, request_id: str) -> Request:
        """The scheduler's `Request` of an unfinished request (its seq_id, tokens, progress)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            raise InvalidArgumentError(f"no unfinished request {request_id!r}")
        return tracked.request

    def output(self, request_id: str) -> RequestOutput:
        """The final output of a finished request (`generate` hands its own outputs back and forgets them)."""
        if request_id not in self._outputs:
            raise InvalidArgumentError(f"request {request_id!r} has not finished (or generate returned it)")
        return self._outputs[request_id]

    def release(self, request_id: str) -> list[RequestOutput] | None:
        """Hand back the final outputs of request `request_id` and its n > 1 children (parent first) and free
        their ids, once all have ended and `step()` has delivered their ends; None (nothing changes) before.
        `generate` does this for its own batch; a caller of `add_request` + `step` calls it per request."""
        family = [request_id]
        while f"{request_id}.{len(family)}" in self._ids_in_use:
            family.append(f"{request_id}.{len(family)}")
        if request_id not in self._ids_in_use:
            raise InvalidArgumentError(f"no request {request_id!r} in this engine (never added, or released)")
        undelivered = set(self._undelivered)
        if self._groups.is_held(request_id) or any(i in self._tracked or i in undelivered for i in family):
            return None
        outputs = [self._outputs.pop(i) for i in family if i in self._outputs]
        self._ids_in_use.difference_update(family)
        return outputs

    def held_ids(self) -> set[str]:
        """The requests waiting for their sample group's leader to write the prompt (`is_held`)."""
        return self._groups.held_ids()

    def is_held(self, request_id: str) -> bool:
        """True while request `request_id` waits for its sample group's leader to write the prompt (it is not
        queued yet: `get_request` does not know it, `finish` does)."""
        return self._groups.is_held(request_id)

    def has_unfinished(self) -> bool:
        """True while a request has not ended, or its end has not been returned by `step()` yet."""
        return bool(self._tracked or self._undelivered or self._groups.has_held())

    @property
    def group_prefill_shared_tokens(self) -> int:
        """Prompt tokens that requests of a sample group took from their leader's prefill (`add_request`'s
        `group_id`) instead of computing them."""
        return self._groups.count()

    def take_event_batch(self) -> Any:
        """The KV events of every medium since the last call, as one `pagedkv.events.EventBatch` (None if
        there are none). Needs `EngineConfig(kv_events=True)`."""
        if self.kv_events is None:
            raise InvalidArgumentError("this engine records no KV events: build it with EngineConfig(kv_events=True)")
        return self.kv_events.take_batch()

    def close(self) -> None:
        """Release what outlives a step: the disk tier's file and the remote store's connections."""
        if self.tiering is not None:
            self.tiering.close()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> update round; returns every output that ended since the last call."""
        if self._in_callbacks:
            raise InvalidArgumentError("step() cannot be called from an on_token callback")
        self._groups.release(self._accept, self._tracked.__contains__)  # sample groups whose prompt is in
        started = time.perf_counter()  # the step's cost, for the draft budget's fit (speculation only)
        out = self.scheduler.schedule(now=self.clock())
        if self.tiering is not None:
            self.tiering.before_forward(out)
        chunks = out.scheduled
        if not chunks:
            if self.scheduler.has_unfinished() and not out.rejected:
                raise CapacityError(
                    "the scheduler made no progress: nothing runs and no waiting request can be admitted "
                    "(the head of the queue needs more KV than can be freed)"
                )
            self._collect_finished()
            return self._deliver()
        self._forget_drafts(out.preempted)  # their KV is freed: a draft model's too
        # a failure here belongs to no request: it propagates, and the next step redoes this one
        logits = self._execute(out)
        producing = [c for c in chunks if c.produces_token]
        rows = _logit_rows(producing)  # per producing chunk, its rows of `logits` (1 + its drafts)
        tokens, errors = self._sample_or_verify(producing, rows, logits)
        now = self.clock()
        sampled: dict[str, int | list[int]] = {}
        for i, chunk in enumerate(producing):
            tracked = self._tracked[chunk.request.request_id]
            if i in errors:
                self.scheduler.finish(tracked.request, "error", now, error=errors[i])
                continue
            sampled[chunk.request.request_id] = tokens[i]
            if tracked.params.n > 1 and not tracked.children_forked and not chunk.request.output_token_ids:
                row = rows[i][0]
                self._fork_children(tracked, logits[row : row + 1], sampled)  # type: ignore[arg-type]
        num_before = {rid: len(self._tracked[rid].request.output_token_ids) for rid in sampled}
        self.scheduler.update(out, sampled, now)
        rows_of = {c.request.request_id: r for c, r in zip(producing, rows)}
        self._record_logprobs(rows_of, logits, sampled)
        self._record_speculation(producing, tokens, errors, out.num_batched_tokens, started)
        if self.tiering is not None:
            self.tiering.after_update()
        if self.kv_events is not None:
            self.kv_events.poll()
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(out.preempted)
        self.stats.num_scheduled_tokens += out.num_batched_tokens
        self.stats.num_swapped_out_blocks += len(out.swap_out.src)
        self.stats.num_swapped_in_blocks += len(out.swap_in.src)
        got_token = [self._tracked[rid] for rid in sampled]
        for tracked in got_token:
            self._check_stop_strings(tracked, now, num_before[tracked.request.request_id])
        self._record_step(now)
        self._propose()
        # the step's state is final: snapshot it for every callback, then run them
        notes = [(t, self._snapshot(t)) for t in got_token if t.on_token is not None]
        self._collect_finished()
        self._run_callbacks(notes)
        return self._deliver()

    def _sample(self, logits: torch.Tensor, tracked: list[_Tracked]) -> tuple[list[int], dict[int, str]]:
        """One token per row, and an error message per row that cannot be sampled. `sample` checks every row
        before any draws, so dropping the bad rows and sampling the rest costs no seeded stream a draw."""
        params = [t.params for t in tracked]
        generators = [t.generator for t in tracked]
        try:  # the common case: every row can be sampled (one check inside `sample`)
            return sample(logits, params, generators), {}
        except InvalidArgumentError:
            bad = bad_rows(logits)
            if not bad:
                raise
        good = [i for i in range(len(tracked)) if i not in set(bad)]
        drawn = sample(logits[good], [params[i] for i in good], [generators[i] for i in good])
        tokens = [0] * len(tracked)
        for i, token in zip(good, drawn):
            tokens[i] = token
        message = "the model's logits for this request hold NaN or +inf (or nothing finite); cannot sample"
        return tokens, {i: message for i in bad}

    def _execute(self, out: Any) -> torch.Tensor:
        """`runner.execute`, except that a step with prompt chunks of a request asking for prompt
        log-probabilities keeps the logits of those chunks' every position and records them, and a step
        with speculating chunks scores each of their positions (their rows, in order, take the place of
        the chunk's one row: `_logit_rows`)."""
        chunks = list(out.scheduled)
        wanted = [
            (i, c)
            for i, c in enumerate(chunks)
            if self._scoring and c.request.request_id in self._scoring and c.start + 1 < c.request.num_prompt_tokens
        ]
        drafting = any(c.draft_token_ids for c in chunks)
        if not wanted and not drafting:  # the common case: the runner's own path, untouched
            return self.runner.execute(self.manager, out)
        self.runner.apply_block_moves(out)
        batches = self.runner.build_batches(self.manager, [with_drafts(c) for c in chunks])
        offsets = list(itertools.accumulate((c.num_new_tokens for c in chunks), initial=0))
        sampling_rows = [
            r
            for i, c in enumerate(chunks)
            if c.produces_token
            for r in range(offsets[i] + (0 if c.draft_token_ids else c.num_new_tokens - 1), offsets[i + 1])
        ]
        extra = {offsets[i] + j for i, c in wanted for j in range(c.num_new_tokens)}
        rows = sorted(set(sampling_rows) | extra)
        at = {r: k for k, r in enumerate(rows)}
        keep = torch.tensor(rows, dtype=torch.int64, device=batches[0].logits_indices.device)
        kept = tuple(replace(b, logits_indices=keep) for b in batches)
        logits = self.runner.forward(kept)
        for i, chunk in wanted:
            self._record_prompt_logprobs(chunk, logits, [at[offsets[i] + j] for j in range(chunk.num_new_tokens)])
        return logits[[at[r] for r in sampling_rows]]

    def _sample_or_verify(
        self, producing: list[Any], rows: list[list[int]], logits: torch.Tensor
    ) -> tuple[dict[int, int | list[int]], dict[int, str]]:
        """Per producing chunk (by index): its sampled token, or a speculating chunk's verified tokens; and
        an error message per chunk whose logits cannot be sampled."""
        plain = [i for i, c in enumerate(producing) if not c.draft_token_ids]
        drawn, errors = self._sample(
            logits[[rows[i][0] for i in plain]] if len(plain) < len(producing) else logits,
            [self._tracked[producing[i].request.request_id] for i in plain],
        )
        tokens: dict[int, int | list[int]] = {i: drawn[j] for j, i in enumerate(plain)}
        errors = {plain[j]: m for j, m in errors.items()}
        if len(plain) < len(producing):
            self._verify(producing, rows, logits, tokens, errors)
        return tokens, errors

    def _verify(
        self,
        producing: list[Any],
        rows: list[list[int]],
        logits: torch.Tensor,
        tokens: dict[int, int | list[int]],
        errors: dict[int, str],
    ) -> None:
        """The verified tokens of each speculating chunk (`speculative.rejection.verify`) into `tokens`, or
        an error when its logits cannot be sampled."""
        for i, chunk in enumerate(producing):
            if not chunk.draft_token_ids:
                continue
            tracked = self._tracked[chunk.request.request_id]
            scored = logits[rows[i]]
            if bad_rows(scored):
                errors[i] = "the model's logits for this request hold NaN or +inf (or nothing finite); cannot sample"
                continue
            tokens[i] = verify(scored, chunk.draft_token_ids, tracked.params, tracked.generator)

    def _record_speculation(
        self,
        producing: list[Any],
        tokens: dict[int, int | list[int]],
        errors: dict[int, str],
        num_tokens: int,
        started: float,
    ) -> None:
        """Each speculating chunk's proposed and accepted drafts (the counters, the request's k and
        acceptance), and the step's size and seconds since `started` (the draft budget's cost fit)."""
        budget = self.draft_budget
        if self.stats.spec is None or budget is None:
            return
        num_drafts = num_verifying = 0
        for i, chunk in enumerate(producing):
            if not chunk.draft_token_ids or i in errors:
                continue
            got = tokens[i]
            accepted = len(got) - 1 if isinstance(got, list) else 0
            self.stats.spec.record(len(chunk.draft_token_ids), accepted)
            budget.record(chunk.request.request_id, len(chunk.draft_token_ids), accepted)
            num_drafts, num_verifying = num_drafts + len(chunk.draft_token_ids), num_verifying + 1
        budget.observe_step(num_tokens, time.perf_counter() - started, num_verifying)
        self._base_tokens = num_tokens - num_drafts

    def _forget_drafts(self, requests: Sequence[Request]) -> None:
        if self.proposer is not None:
            for request in requests:
                self.proposer.forget(request.request_id)

    def _propose(self) -> None:
        """Draft tokens for the next step of every decoding request (`Request.draft_token_ids`): each asks
        for its adaptive k, and `DraftBudget.plan` cuts the batch's drafts to those that raise the step's
        expected tokens per second (before a draft model proposes them, and again on what was proposed);
        none when more requests run than `disable_by_batch_size`."""
        spec, proposer, budget = self.config.speculative, self.proposer, self.draft_budget
        if spec is None or proposer is None or budget is None:
            return
        decoding = [
            t
            for t in self._tracked.values()
            if t.request.seq_id is not None and not t.request.is_finished and t.request.output_token_ids
            and t.request.num_computed_tokens == t.request.num_tokens - 1
        ]  # fmt: skip
        if spec.disable_by_batch_size is not None and len(decoding) > spec.disable_by_batch_size:
            return
        ids = [t.request.request_id for t in decoding]
        caps = [min(budget.next_k(r), t.request.max_new_tokens - len(t.request.output_token_ids) - 1)
                for r, t in zip(ids, decoding)]  # fmt: skip
        base = max(self._base_tokens, len(decoding))
        if self.draft is not None:  # a draft model's tokens cost its forwards: plan before proposing them
            caps = budget.plan(ids, caps, base, to_propose=True)
        asks = [(t, k) for t, k in zip(decoding, caps) if k > 0]
        if not asks:
            return
        started = time.perf_counter()
        drafts = proposer.propose([t.request for t, _ in asks], [k for _, k in asks])
        budget.observe_drafting(sum(len(d) for d in drafts), time.perf_counter() - started)
        keep = budget.plan([t.request.request_id for t, _ in asks], [len(d) for d in drafts], base)
        for (t, _), d, n in zip(asks, drafts, keep):
            t.request.draft_token_ids = d[:n]

    def _record_prompt_logprobs(self, chunk: Any, logits: torch.Tensor, rows: list[int]) -> None:
        """The logits at prompt position p score prompt token p + 1; record those not recorded yet."""
        request = chunk.request
        tracked = self._tracked[request.request_id]
        got = tracked.prompt_logprobs
        if got is None:
            return
        prompt = request.prompt_token_ids
        todo = [(p, row) for p, row in zip(range(chunk.start, chunk.end), rows) if p + 1 < len(prompt) and p + 1 not in got]
        k = int(tracked.params.prompt_logprobs or 0)
        entries = token_logprobs(logits[[row for _, row in todo]], [int(prompt[p + 1]) for p, _ in todo], k)
        for (p, _), entry in zip(todo, entries):
            got[p + 1] = entry
        if len(got) == len(prompt) - 1:
            self._scoring.discard(request.request_id)

    def _record_logprobs(
        self, rows_of: dict[str, list[int]], logits: torch.Tensor, sampled: dict[str, int | list[int]]
    ) -> None:
        """Append the log-probabilities of each token the step kept, for the requests that asked; a forked
        child's first token came from its parent's row, a verified token from the row that scored it."""
        wants = [rid for rid in sampled if self._tracked[rid].params.logprobs is not None]
        if not wants:
            return
        for rid in wants:
            tracked = self._tracked[rid]
            rows = rows_of.get(rid, rows_of.get(tracked.parent_id or ""))
            if tracked.logprobs is None:
                tracked.logprobs = []
            got = sampled[rid]
            toks = [got] if isinstance(got, int) else got
            kept = len(tracked.request.output_token_ids) - len(tracked.logprobs)  # an EOS may end a run early
            if rows is None or kept <= 0:
                continue
            take = min(kept, len(toks))  # verified token i was scored by the chunk's row i
            k = int(tracked.params.logprobs or 0)
            tracked.logprobs.extend(token_logprobs(logits[rows[:take]], toks[:take], k))

    def _fork_children(self, parent: _Tracked, logits: torch.Tensor, sampled: dict[str, int]) -> None:
        """Parallel sampling: after the prompt's last chunk, n-1 children share its blocks (fork, copy-on-write
        on their first divergent write) and each samples its first token from the same logits with its own
        generator. A child that cannot be forked now (`max_num_seqs` running, or no room for its copy) is
        queued as a fresh request; it finds the prompt in the prefix cache."""
        from pagedkv.engine.request import Request

        parent.children_forked = True
        request, params = parent.request, parent.params
        for child_id in family_ids(request.request_id, params.n)[1:]:
            generator = make_generator(params.child_seed(int(child_id.rsplit(".", 1)[1])))
            try:
                child = self.scheduler.fork(request, child_id)
            except CapacityError:
                child = Request(
                    child_id,
                    request.prompt_token_ids,
                    request.max_new_tokens,
                    arrival_time=request.arrival_time,
                    priority=request.priority,
                    eos_token_id=request.eos_token_id,
                    stop_token_ids=request.stop_token_ids,
                    salt=request.salt,
                )
                self.scheduler.add_request(child)
            else:  # the scheduler counts this step's chunk as computed for the child too
                sampled[child_id] = sample(logits, [params], [generator])[0]
            self._tracked[child_id] = _Tracked(
                child, params, generator, parent.on_token, parent_id=request.request_id, children_forked=True
            )

    def _check_stop_strings(self, tracked: _Tracked, now: float, num_before: int) -> None:
        """Stop strings (the scheduler handles max tokens, EOS and stop token ids); a decode that raises ends
        this request with "error". When the step appended several tokens (speculation), the output is cut
        after the first of them that completes a stop string, as decoding one token a step would have."""
        request, params = tracked.request, tracked.params
        if not params.stop or tracked.stop_text is not None:
            return
        try:
            found, cut = self._find_stop(request.output_token_ids, params.stop), False
            if found is not None and len(request.output_token_ids) - num_before > 1:
                for m in range(num_before + 1, len(request.output_token_ids)):
                    if (early := self._find_stop(request.output_token_ids[:m], params.stop)) is not None:
                        del request.output_token_ids[m:]
                        if tracked.logprobs is not None:
                            del tracked.logprobs[m:]
                        found, cut = early, True
                        break
        except Exception as e:  # the tokenizer failed on this request's tokens: its failure, not the step's
            if not request.is_finished:
                self.scheduler.finish(request, "error", now, error=f"stop-string check: decode raised {e!r}")
            return
        if found is not None:
            tracked.stop_text = found
            if not request.is_finished:
                self.scheduler.finish(request, "stop", now)
            elif cut:
                request.finish_reason = "stop"  # cut before the token (EOS, the last allowed) that ended it

    def _find_stop(self, token_ids: Sequence[int], stops: Sequence[str]) -> str | None:
        """The decoded text cut before its first stop string, or None when it holds none."""
        text = self._decode(token_ids)
        cuts = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        return text[: min(cuts)] if cuts else None

    def _run_callbacks(self, notes: list[tuple[_Tracked, RequestOutput]]) -> None:
        """Call each `on_token` with its snapshot; an exception is caught, logged and ends only its request."""
        self._in_callbacks = True
        try:
            for tracked, snapshot in notes:
                if tracked.on_token is None:
                    continue
                try:
                    tracked.on_token(snapshot)
                except Exception as e:
                    rid = tracked.request.request_id
                    message = f"on_token callback raised {type(e).__name__}: {e}"
                    logger.warning("request %r: %s", rid, message, exc_info=True)
                    if tracked.request.is_finished:  # it had ended already: keep its reason, record the error
                        if rid in self._outputs:
                            self._outputs[rid].error = message
                    else:
                        self._end(tracked, "error", self.clock(), error=message)
        finally:
            self._in_callbacks = False

    def _record_step(self, now: float) -> None:
        running = [t.request for t in self._tracked.values() if t.request.seq_id is not None]
        running = [r for r in running if not r.is_finished]
        self.stats.step_times.append(now)
        self.stats.running.append(len(running))
        self.stats.live_tokens.append(sum(int(r.num_computed_tokens) for r in running))
        self.stats.used_blocks.append(int(self.manager.num_used_blocks))

    def _collect_finished(self) -> None:
        for tracked in [t for t in self._tracked.values() if t.request.is_finished]:
            self._collect(tracked)

    def _collect(self, tracked: _Tracked) -> None:
        rid = tracked.request.request_id
        if self._tracked.pop(rid, None) is None:
            return  # collected already
        self._scoring.discard(rid)
        if self.proposer is not None:
            self.proposer.forget(rid)  # a draft model's blocks for it
        if self.draft_budget is not None:
            self.draft_budget.forget(rid)
        self._outputs[rid] = self._snapshot(tracked)
        if self.tiering is not None:
            self.tiering.forget(rid)
        self._undelivered.append(rid)

    def _deliver(self) -> list[RequestOutput]:
        done = [self._outputs[rid] for rid in self._undelivered if rid in self._outputs]
        self._undelivered = []
        return done

    def _decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _snapshot(self, tracked: _Tracked) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = tracked.stop_text if tracked.stop_text is not None else self._decode(tracked.request.output_token_ids)
        by_tier = None
        if self.tiering is not None:
            by_tier = self.tiering.cached_by_tier(tracked.request.request_id, int(tracked.request.num_cached_tokens))
        out = RequestOutput.of(tracked.request, text=text, parent_id=tracked.parent_id, by_tier=by_tier)
        out.weight_version = self.weight_version
        if tracked.params.logprobs is not None:
            out.logprobs = list(tracked.logprobs or ())
        if tracked.params.prompt_logprobs is not None and tracked.parent_id is None:
            got = tracked.prompt_logprobs or {}
            scored: list[TokenLogprobs | None] = [None]
            out.prompt_logprobs = scored + [got.get(p) for p in range(1, tracked.request.num_prompt_tokens)]
        return out

    # --- batch API ------------------------------------------------------------------------------

    def run(self, *, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        """Step until every queued request has ended and its end has been delivered."""
        while self.has_unfinished():
            finished = self.step()
            if on_step is not None:
                on_step(finished)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: TokenCallback | None = None,
        chat: bool = False,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        cache_salt: str | bytes | None | Sequence[str | bytes | None] = None,
    ) -> list[RequestOutput]:
        """Run a batch to completion; one output per completion, in prompt order (children after parents).
        Every prompt is checked before any is queued: misuse raises `InvalidArgumentError` with nothing
        queued; a prompt that can never be served is returned as finish_reason "rejected" with the error.
        `cache_salt` is one salt for every prompt or one per prompt."""
        if isinstance(prompts, str):
            raise InvalidArgumentError("generate takes a list of prompts; wrap one prompt in a list")
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidArgumentError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        salts = (
            [cache_salt] * len(prompts)
            if cache_salt is None or isinstance(cache_salt, str | bytes)
            else list(cache_salt)
        )
        if len(salts) != len(prompts):
            raise InvalidArgumentError(f"{len(prompts)} prompts but {len(salts)} cache salts")
        order: list[str] = []
        accepted: list[_Tracked] = []
        rejected: dict[str, RequestOutput] = {}
        for prompt, p, salt in zip(prompts, plist, salts):
            rid = self._new_id(_n_of(p))  # automatic ids differ from each other: no reservation needed yet
            order.append(rid)
            try:
                accepted.append(self._prepare(prompt, p, rid, 0, None, on_token, chat, salt))
            except CapacityError as err:
                ids = self.encode(prompt, chat=chat)
                rejected[rid] = RequestOutput(rid, ids, [], "" if self.tokenizer else None, True, "rejected", str(err))
        for tracked in accepted:
            self._accept(tracked)
        self._ids_in_use.update(rejected)
        self._outputs.update(rejected)
        self.run(on_step=on_step)
        results: list[RequestOutput] = []
        for rid, p in zip(order, plist):
            family = [rid] if rid in rejected else family_ids(rid, p.n)  # accepted: n <= num_blocks
            results.extend(self._outputs.pop(i) for i in family if i in self._outputs)
            self._ids_in_use.difference_update(family)
        return results

    # --- model lifecycle: weight versions, pause, sleep (pagedkv.engine.lifecycle) --------------

    _life: Lifecycle | None = None  # made on first use

    @property
    def lifecycle(self) -> Lifecycle:
        if self._life is None:
            from pagedkv.engine.lifecycle import Lifecycle

            self._life = Lifecycle(self)
        return self._life

    @property
    def weight_version(self) -> str:
        return self._life.weight_version if self._life is not None else "0"

    @property
    def is_frozen(self) -> bool:
        """Paused in keep mode with requests parked and nothing to deliver: `step()` would do nothing."""
        return self._life is not None and self._life.frozen and not self._undelivered

    def update_weights(self, source: WeightSource, version: str | int | None = None, *, flush_cache: bool = True) -> UpdateReport:
        """`Lifecycle.update_weights`: new weights from a state dict or a folder of safetensors; no KV of the
        old ones is served after it."""
        return self.lifecycle.update_weights(source, version, flush_cache=flush_cache)

    def pause(self, mode: str = "abort") -> list[str]:
        """`Lifecycle.pause`: refuse new requests; abort, finish (wait) or park (keep) those in flight."""
        return self.lifecycle.pause(mode)

    def resume(self) -> None:
        self.lifecycle.resume()

    def sleep(self, level: int = 1) -> SleepReport:
        """`Lifecycle.sleep`: release the KV memory (level 1) and the weights (level 2)."""
        return self.lifecycle.sleep(level)

    def wake_up(self) -> WakeReport:
        return self.lifecycle.wake_up()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (device, host and disk tiers); returns the device keys dropped."""
        return self.lifecycle.reset_prefix_cache()


def _logit_rows(producing: Sequence[Any]) -> list[list[int]]:
    """The rows of `_execute`'s logits that belong to each producing chunk: one, or one per position of a
    speculating chunk (its last token and each draft)."""
    rows: list[list[int]] = []
    at = 0
    for c in producing:
        n = 1 + len(c.draft_token_ids)
        rows.append(list(range(at, at + n)))
        at += n
    return rows


def _prepare_forward(model: Any, backend: str, model_forward: str) -> tuple[str, FusedLlama | None]:
    """The linear backend in use ("onednn" or "torch", pagedkv.hf.cpu_linear) and the fused forward
    (pagedkv.hf.fused_llama) where `model_forward` and the model allow one; without it, "onednn" packs the
    model's own projections."""
    from pagedkv.hf.cpu_linear import PackedLinear, choose_linear_backend, pack_linears
    from pagedkv.hf.fused_llama import fuse_llama

    param = next(model.parameters())
    chosen = choose_linear_backend(backend, param.dtype, param.device)
    fused = fuse_llama(model, chosen) if model_forward != "transformers" and param.device.type == "cpu" else None
    if chosen == "invariant" and fused is None:
        raise InvalidArgumentError(
            f"batch_invariant needs a Llama-structured model on a CPU (the fused forward); "
            f"{type(model).__name__} is not one"
        )
    if model_forward == "fused" and fused is None:
        raise InvalidArgumentError(
            f"model_forward 'fused' needs a Llama-structured model on a CPU; {type(model).__name__} is not one "
            "(use 'auto' or 'transformers')"
        )
    if fused is None and chosen == "onednn":
        pack_linears(model)  # a second engine over the same model finds them packed already
    elif fused is None and any(isinstance(m, PackedLinear) for m in model.modules()):
        chosen = "onednn"
    return chosen, fused


def _scoring_salt(cache_salt: str | bytes | None, request_id: str) -> bytes:
    """A salt no other request has: a request that scores its prompt must compute every prompt token."""
    return salt_bytes(cache_salt) + b"\x00prompt-logprobs\x00" + request_id.encode("utf-8")


def _n_of(params: object) -> int:
    n = getattr(params, "n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
