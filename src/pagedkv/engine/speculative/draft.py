"""A draft model proposer: a smaller model with the target's tokenizer proposes k tokens greedily."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.core.errors import NotSupportedError
from pagedkv.engine.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedkv.engine.request import Request


class DraftModelProposer:
    """Not built yet: `load` refuses with a message."""

    @classmethod
    def load(cls, spec: SpeculativeConfig, model: Any, engine_config: Any) -> DraftModelProposer:
        raise NotSupportedError(f"draft-model speculation ({spec.draft_model!r}) is not available yet; use ngram:k=4")

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [[] for _ in requests]

    def forget(self, request_id: str) -> None:
        return None
