"""What the engine hands back: one `RequestOutput` per completion, and engine-wide step statistics.

Timing (seconds, from the engine's clock):
- `ttft_s` = first token time - arrival time (queueing + prefill);
- `tpot_s` = (finish time - first token time) / (output tokens - 1), the mean gap between output tokens
  (0.0 for a one-token output);
- `e2e_s` = finish time - arrival time.
All three are None until known; a request rejected before it ran has no tokens, so its `ttft_s` and `tpot_s`
are None and its `e2e_s` is the time it waited (>= 0), or None when `generate` refused it at the door.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pagedkv.engine.request import Request

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.misses import MissCounter
from pagedkv.engine.speculative.stats import SpecStats
from pagedkv.tiers.store import TierStats


class TokenLogprobs(NamedTuple):
    """One token's log-probability and the `k` most likely tokens' at its position (`SamplingParams.logprobs`),
    from the model's raw distribution; `top` is (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class RequestOutput:
    """The state of one completion; final when `finished` is True. `parent_id` is set for n > 1 children."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str | None = None
    finished: bool = False
    finish_reason: str | None = None  # one of pagedkv.engine.request.FINISH_REASONS
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed: device prefix cache + tiers below it
    num_preemptions: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    parent_id: str | None = None
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # "GPU", "CPU", "DISK", "REMOTE"
    queue_s: float | None = None  # first scheduled - arrival
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first)
    weight_version: str = "0"  # the weights it was generated under (pagedkv.engine.lifecycle)

    @classmethod
    def of(
        cls,
        request: Request,
        *,
        text: str | None = None,
        parent_id: str | None = None,
        by_tier: dict[str, int] | None = None,
    ) -> RequestOutput:
        """A snapshot of `request` now (a copy: later steps do not change it).

        `by_tier` splits the cached prompt tokens by medium when tiers are on; without it they all came
        from the device ("GPU").
        """
        if by_tier is None:
            by_tier = {"GPU": int(request.num_cached_tokens)}
        out_ids = list(request.output_token_ids)
        arrival, first, finish = request.arrival_time, request.first_token_time, request.finish_time
        finished = request.is_finished
        tpot = None
        if finished and first is not None and finish is not None:
            tpot = (finish - first) / (len(out_ids) - 1) if len(out_ids) > 1 else 0.0
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=out_ids,
            output_text=text,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            error=request.error,
            num_cached_tokens=sum(by_tier.values()),
            num_cached_tokens_by_tier=dict(by_tier),
            num_preemptions=int(request.num_preemptions),
            ttft_s=None if first is None else first - arrival,
            tpot_s=tpot,
            e2e_s=(finish - arrival) if finished and finish is not None else None,
            parent_id=parent_id,
            queue_s=None if request.first_scheduled_time is None else request.first_scheduled_time - arrival,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def as_dict(self, prompt: str | None = None) -> dict[str, object]:
        """The `--json` record of `pagedkv generate` (one object a line)."""
        return {
            "id": self.request_id,
            "prompt": prompt,
            "output_text": self.output_text,
            "output_token_ids": list(self.output_token_ids),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_cached_tokens_by_tier": dict(self.num_cached_tokens_by_tier),
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "num_preemptions": self.num_preemptions,
            "parent_id": self.parent_id,
            "error": self.error,
        }


@dataclass(slots=True)
class EngineStats:
    """Per-step samples for serving figures: running requests and live KV tokens after each step."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model, recomputation after preemption included
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    step_times: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    live_tokens: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    tiers: TierStats | None = None  # hit rates by medium and losses by reason, when tiers are on
    # why admitted prompt tokens missed the device cache, by reason (live; pagedkv.core.misses; paged only):
    # cache_misses.lookups / .tokens, or cache_misses.as_dict() for flat miss_{lookups,tokens}_<reason> names
    cache_misses: MissCounter | None = None
    spec: SpecStats | None = None  # speculative decoding's drafts and acceptances, when it is on

    def trim(self, max_samples: int) -> None:
        """Keep only the last `max_samples` per-step samples (a long-lived server's memory stays bounded;
        the counters are kept whole)."""
        if max_samples < 1:
            raise InvalidArgumentError(f"max_samples must be >= 1, got {max_samples}")
        for samples in (self.step_times, self.running, self.live_tokens, self.used_blocks):
            del samples[: max(0, len(samples) - max_samples)]

    @property
    def peak_concurrency(self) -> int:
        return max(self.running, default=0)

    def kv_utilization(self, capacity_tokens: int) -> float:
        """Time-weighted mean fraction of the KV capacity holding live tokens (written KV of running requests)."""
        if len(self.step_times) < 2 or capacity_tokens <= 0:
            return 0.0
        total = weighted = 0.0
        for i in range(1, len(self.step_times)):
            dt = self.step_times[i] - self.step_times[i - 1]
            total += dt
            weighted += dt * self.live_tokens[i - 1]
        return weighted / total / capacity_tokens if total > 0 else 0.0
