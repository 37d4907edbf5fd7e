"""`EngineSnapshot`: the numbers `AsyncEngine`'s engine thread publishes after each turn, which `/metrics`,
`/health` and a Ray replica's routing stats read from other threads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the engine thread publishes after each turn (plain numbers: reading it is thread-safe)."""

    alive: bool
    num_running: int
    num_waiting: int
    num_swapped: int
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    num_steps: int
    num_in_flight: int  # streams not yet ended (requests accepted by the door)
    # prompt tokens not served from cache since start, by reason (pagedkv.core.misses.MISS_REASONS; empty
    # for an allocator that keeps no prefix cache)
    miss_tokens: tuple[tuple[str, int], ...] = ()
    # speculative decoding since start (pagedkv.engine.speculative.stats.SpecStats): drafts, draft tokens,
    # accepted tokens, accepted per draft position; None when the engine does not speculate
    spec: tuple[int, int, int, tuple[int, ...]] | None = None
    # prompt tokens that requests of a sample group took from their leader's prefill since start
    # (`Engine.group_prefill_shared_tokens`)
    group_prefill_shared_tokens: int = 0
    # the KV manager's key epoch (`KVManager.epoch`; a weight update bumps it, and a router drops the keys
    # of earlier epochs)
    kv_epoch: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks held by requests (cached-free prefix blocks count as free)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0
