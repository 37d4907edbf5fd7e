"""Speculative decoding on the engine: proposers, per-request adaptive k, verification.

The scheduler reserves and schedules a decoding request's draft tokens as part of its chunk
(`Request.draft_token_ids`, `ScheduledChunk.draft_token_ids`); the forward scores every position of it;
`verify` decides the accepted tokens; `Scheduler.update` rolls the rejected drafts back through the
allocator's `rollback` before it marks anything computed, so only verified tokens reach the prefix cache.
docs/speculative.md walks through one step.
"""

from pagedkv.engine.speculative.adaptive import AdaptiveK
from pagedkv.engine.speculative.config import SpeculativeConfig, parse_speculative
from pagedkv.engine.speculative.ngram import NgramProposer

__all__ = ["AdaptiveK", "NgramProposer", "SpeculativeConfig", "parse_speculative"]
