"""`Engine`: continuous batching of a transformers model on pagedkv.

One step is an explicit data contract (no hidden forward context):

```
out     = scheduler.schedule()              # which chunks run, which blocks move (torch-free)
logits  = runner.execute(manager, out)      # block moves, one packed forward, logits of sampling chunks
sampled = sample(logits, params, gens)      # one token per sampling chunk (+ n-1 children on first token)
done    = scheduler.update(out, sampled, t) # append tokens, max-tokens / EOS stops, free finished
engine:   stop token ids, stop strings, streaming callbacks, outputs
```

The scheduler owns the queue (priority, then arrival), the token budget, chunked prefill, prefix caching,
preemption (recompute or swap); the allocator is chosen here (`EngineConfig.allocator`). A request that can
never fit the KV capacity (prompt + max_new_tokens above it) is refused at `add_request` with a
`CapacityError`; `generate` turns that into a "rejected" output and completes the rest.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import EngineStats, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import make_generator, sample
from pagedkv.hf.attention import prepare_model
from pagedkv.hf.cache import PagedKVCache

TokenCallback = Callable[[RequestOutput], None]


@dataclass(slots=True)
class _Tracked:
    """Engine-side state of one scheduled request (the scheduler owns the `Request`)."""

    request: Any
    params: SamplingParams
    generator: torch.Generator | None
    on_token: TokenCallback | None
    parent_id: str | None = None
    children_forked: bool = False
    text_checked_upto: int = 0
    stop_text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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
        from pagedkv.core import ContiguousKVManager, PagedKVManager
        from pagedkv.engine.scheduler import Scheduler, SchedulerConfig

        self.config = config or EngineConfig(num_blocks=256)
        self.model = model
        self.tokenizer = tokenizer
        self.clock = clock
        self.spec = prepare_model(model)
        cfg = self.config
        bytes_per_block = self.spec.kv_cache_spec().bytes_per_block(cfg.block_size)
        num_blocks = (
            cfg.num_blocks if cfg.num_blocks is not None else int(cfg.kv_budget_bytes or 0) // bytes_per_block
        )
        if num_blocks < 2:
            raise CapacityError(
                f"a KV budget of {cfg.kv_budget_bytes} bytes holds {num_blocks} blocks of {bytes_per_block} bytes "
                f"({cfg.block_size} tokens of {self.spec.model_type}); need at least 2 (block 0 is the null block)"
            )
        num_host = (
            cfg.num_host_blocks
            if cfg.num_host_blocks is not None
            else (num_blocks if cfg.preemption_mode == "swap" else 0)
        )
        self.manager: Any
        if cfg.allocator == "paged":
            self.manager = PagedKVManager(
                num_blocks,
                cfg.block_size,
                enable_prefix_caching=cfg.enable_prefix_caching,
                num_host_blocks=num_host,
                record_events=cfg.tiers_enabled,  # the tiers follow evictions and publications
            )
        else:
            self.manager = ContiguousKVManager(num_blocks, cfg.block_size)
        device = next(model.parameters()).device
        self.cache = PagedKVCache.for_model(
            self.spec,
            num_blocks,
            cfg.block_size,
            num_host_blocks=num_host,
            device=device,
            attention_backend=cfg.attention_backend,
        )
        self.kv_budget_bytes = num_blocks * bytes_per_block
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                preemption_mode=cfg.preemption_mode,
            ),
        )
        self.runner = ModelRunner(model, self.cache)
        self.stats = EngineStats()
        self.tiering: Any = None
        if cfg.tiers_enabled:  # host RAM / disk / remote store below the device (pagedkv.engine.tiering)
            from pagedkv.engine.tiering import EngineTiering

            model_id = str(getattr(model.config, "_name_or_path", "") or self.spec.model_type)
            self.tiering = EngineTiering.build(cfg, self.cache.storage, self.manager, model_id)
            self.stats.tiers = self.tiering.stats
        self._tracked: dict[str, _Tracked] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos

    # --- requests -------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return int(self.manager.capacity_tokens)

    def encode(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: ids pass through; text needs the tokenizer (chat template if `chat`)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise InvalidArgumentError(
                "text prompts need a tokenizer; pass token ids or Engine(model, tokenizer)"
            )
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer(prompt)["input_ids"]]

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
    ) -> str:
        """Queue one request; returns its id. `CapacityError` if it can never fit the KV capacity."""
        from pagedkv.engine.request import Request

        params = params or SamplingParams()
        ids = self.encode(prompt, chat=chat)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not ids:
            raise InvalidArgumentError(f"request {rid}: empty prompt")
        if rid in self._tracked or rid in self._outputs:
            raise InvalidArgumentError(f"request id {rid!r} is already in use")
        self._check_fits(rid, len(ids), params)
        request = Request(
            rid,
            ids,
            params.max_new_tokens,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            eos_token_id=None if params.ignore_eos else self.eos_token_id,
            stop_token_ids=tuple(params.stop_token_ids),
        )
        self._tracked[rid] = _Tracked(request, params, make_generator(params.child_seed(0)), on_token)
        self.scheduler.add_request(request)
        return rid

    def _check_fits(self, rid: str, num_prompt: int, params: SamplingParams) -> None:
        total = num_prompt + params.max_new_tokens
        max_pos = self.spec.max_position_embeddings
        if max_pos is not None and total > max_pos:
            raise InvalidArgumentError(
                f"request {rid}: prompt ({num_prompt}) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the model's {max_pos} positions"
            )
        bs = self.config.block_size
        need_tokens = math.ceil(total / bs) * bs * params.n - (params.n - 1) * (num_prompt // bs) * bs
        if need_tokens > self.capacity_tokens:
            raise CapacityError(
                f"request {rid} can never fit: prompt ({num_prompt}) + max_new_tokens ({params.max_new_tokens})"
                f"{f' x n={params.n}' if params.n > 1 else ''} needs {need_tokens} KV tokens but the cache holds "
                f"{self.capacity_tokens} ({self.manager.num_blocks} blocks of {bs}); raise --kv-budget or shorten it"
            )

    def finish(self, request_id: str, reason: str = "abort") -> None:
        """Stop a running or waiting request now (client abort, an external stop condition)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        if not _is_finished(tracked.request):
            self.scheduler.finish(tracked.request, reason, now=self.clock())
        self._collect(tracked)

    def get_request(self, request_id: str) -> Any:
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

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def close(self) -> None:
        """Release what outlives a step: the disk tier's file and the remote store's connections."""
        if self.tiering is not None:
            self.tiering.close()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> update round; returns the outputs that finished in it."""
        out = self.scheduler.schedule()
        if self.tiering is not None:
            self.tiering.before_forward(out)
        chunks = [c for c in out.scheduled]
        if not chunks:
            if self.scheduler.has_unfinished() and not out.rejected:
                raise CapacityError(
                    "the scheduler made no progress: nothing runs and no waiting request can be admitted "
                    "(the head of the queue needs more KV than can be freed)"
                )
            return self._drain_finished()
        logits = self.runner.execute(self.manager, out)
        producing = [c for c in chunks if c.produces_token]
        tracked = [self._tracked[c.request.request_id] for c in producing]
        tokens = sample(logits, [t.params for t in tracked], [t.generator for t in tracked])
        sampled = {c.request.request_id: tok for c, tok in zip(producing, tokens)}
        for row, (chunk, parent) in enumerate(zip(producing, tracked)):
            if parent.params.n > 1 and not parent.children_forked and not chunk.request.output_token_ids:
                self._fork_children(parent, chunk, logits[row : row + 1], sampled)
        now = self.clock()
        self.scheduler.update(out, sampled, now)
        if self.tiering is not None:
            self.tiering.after_update()
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(out.preempted)
        self.stats.num_scheduled_tokens += out.num_batched_tokens
        self.stats.num_swapped_out_blocks += len(out.swap_out.src)
        self.stats.num_swapped_in_blocks += len(out.swap_in.src)
        for rid in sampled:
            self._after_token(self._tracked[rid], now)
        self._record_step(now)
        return self._drain_finished()

    def _fork_children(
        self, parent: _Tracked, chunk: Any, logits: torch.Tensor, sampled: dict[str, int]
    ) -> None:
        """Parallel sampling: after the prompt's last chunk, n-1 children share its blocks (fork, copy-on-write
        on their first divergent write) and each samples its first token from the same logits with its own
        generator. A child that cannot be forked now (no room for its copy) is queued as a fresh request; it
        finds the prompt in the prefix cache."""
        from pagedkv.engine.request import Request

        parent.children_forked = True
        request, params = parent.request, parent.params
        for i in range(1, params.n):
            child_id = f"{request.request_id}.{i}"
            generator = make_generator(params.child_seed(i))
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
                child, params, generator, parent.on_token, parent_id=request.request_id
            )
            self._tracked[child_id].children_forked = True

    def _after_token(self, tracked: _Tracked, now: float) -> None:
        """Stop strings (the scheduler handles max tokens, EOS and stop token ids), then streaming."""
        request, params = tracked.request, tracked.params
        if params.stop and self.tokenizer is not None and tracked.stop_text is None:
            text = self._decode(request.output_token_ids)
            cuts = [i for i in (text.find(stop) for stop in params.stop) if i >= 0]
            if cuts:
                tracked.stop_text = text[: min(cuts)]
                if not _is_finished(request):
                    self.scheduler.finish(request, "stop", now=now)
        if tracked.on_token is not None:
            tracked.on_token(self._snapshot(tracked))

    def _record_step(self, now: float) -> None:
        running = [
            t.request for t in self._tracked.values() if getattr(t.request, "seq_id", None) is not None
        ]
        running = [r for r in running if not _is_finished(r)]
        self.stats.step_times.append(now)
        self.stats.running.append(len(running))
        self.stats.live_tokens.append(sum(int(r.num_computed_tokens) for r in running))
        self.stats.used_blocks.append(int(self.manager.num_used_blocks))

    def _drain_finished(self) -> list[RequestOutput]:
        done = [t for t in self._tracked.values() if _is_finished(t.request)]
        return [self._collect(t) for t in done]

    def _collect(self, tracked: _Tracked) -> RequestOutput:
        output = self._snapshot(tracked)
        rid = tracked.request.request_id
        self._tracked.pop(rid, None)
        self._outputs[rid] = output
        if self.tiering is not None:
            self.tiering.forget(rid)
        return output

    def _decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _snapshot(self, tracked: _Tracked) -> RequestOutput:
        r = tracked.request
        out_ids = list(r.output_token_ids)
        text = None
        if self.tokenizer is not None:
            text = tracked.stop_text if tracked.stop_text is not None else self._decode(out_ids)
        arrival = float(r.arrival_time)
        first = getattr(r, "first_token_time", None)
        finish = getattr(r, "finish_time", None)
        finished = _is_finished(r)
        ttft = None if first is None else first - arrival
        device = int(getattr(r, "num_cached_tokens", 0) or 0)
        by_tier = {"GPU": device} if self.tiering is None else self.tiering.cached_by_tier(r.request_id, device)
        tpot = None
        if finished and first is not None and finish is not None:
            tpot = (finish - first) / (len(out_ids) - 1) if len(out_ids) > 1 else 0.0
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=out_ids,
            output_text=text,
            finished=finished,
            finish_reason=getattr(r, "finish_reason", None) if finished else None,
            num_cached_tokens=sum(by_tier.values()),
            num_cached_tokens_by_tier=by_tier,
            num_preemptions=int(getattr(r, "num_preemptions", 0) or 0),
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=(finish - arrival) if finished and finish is not None else None,
            parent_id=tracked.parent_id,
            error=getattr(r, "error", None),
        )

    # --- batch API ------------------------------------------------------------------------------

    def run(self, *, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        """Step until every queued request has finished."""
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
    ) -> list[RequestOutput]:
        """Run a batch to completion; one output per completion, in prompt order (children after parents).
        A prompt that can never fit is returned as finish_reason "rejected" with the error."""
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidArgumentError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        order: list[str] = []
        for prompt, p in zip(prompts, plist):
            rid = f"req-{next(self._ids)}"
            order.append(rid)
            try:
                self.add_request(prompt, p, request_id=rid, on_token=on_token, chat=chat)
            except CapacityError as err:
                ids = self.encode(prompt, chat=chat)
                self._outputs[rid] = RequestOutput(
                    rid, ids, [], "" if self.tokenizer else None, True, "rejected", str(err)
                )
        self.run(on_step=on_step)
        results: list[RequestOutput] = []
        for rid in order:
            results.append(self._outputs.pop(rid))
            children = sorted(k for k, o in self._outputs.items() if o.parent_id == rid)
            results.extend(self._outputs.pop(k) for k in children)
        return results


def _is_finished(request: Any) -> bool:
    finished = getattr(request, "is_finished", None)
    if callable(finished):
        return bool(finished())
    if finished is not None:
        return bool(finished)
    return getattr(request, "finish_reason", None) is not None
