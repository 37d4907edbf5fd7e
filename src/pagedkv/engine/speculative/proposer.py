"""What proposes draft tokens: one interface, two implementations (n-gram lookup, a draft model).

Contract: `propose(requests, num_tokens)` returns, for each request, at most `num_tokens[i]` tokens
proposed to follow its tokens so far (prompt and output), possibly none. Proposals are guesses: the
target model verifies every one, so a proposer can be wrong but never makes output wrong. A proposer
keeps no state the engine has to reset, except what `forget` drops for a request that ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pagedkv.engine.speculative.config import SpeculativeConfig
from pagedkv.engine.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from pagedkv.engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class NgramLookup:
    """The n-gram proposer over requests (`NgramProposer` on each one's tokens)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.ngram = NgramProposer(min_n, max_n)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [self.ngram.propose(r.all_token_ids, k) for r, k in zip(requests, num_tokens)]

    def forget(self, request_id: str) -> None:
        return None


def make_proposer(spec: SpeculativeConfig, model: Any, engine_config: Any) -> Proposer:
    """The proposer `spec.method` names; a draft model is loaded here and sized from the engine's config."""
    if spec.method == "ngram":
        return NgramLookup(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from pagedkv.engine.speculative.draft import DraftModelProposer

    return DraftModelProposer.load(spec, model, engine_config)
