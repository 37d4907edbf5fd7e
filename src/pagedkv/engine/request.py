"""A request as the scheduler sees it: token ids, limits, progress and timings. No model, no tensors.

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption by recompute (its KV is
dropped; it keeps its output tokens and is re-admitted with prompt + output) and RUNNING -> SWAPPED ->
RUNNING on preemption by swap. `num_computed_tokens` (tokens whose KV is written) catches up to
`num_tokens` (prompt + output); a step that brings it level samples the next token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import BlockKeys


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: Sequence[int] | np.ndarray
    max_new_tokens: int
    arrival_time: float = 0.0
    priority: int = 0  # higher is more important: preempted last, admitted first
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    salt: bytes = b""

    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # from the prefix cache, at first admission
    seq_id: int | None = field(default=None, init=False)  # the manager's handle while it holds KV
    finish_reason: str | None = field(default=None, init=False)  # "length", "stop", "rejected", "abort"
    error: str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)
    keys: BlockKeys = field(init=False)  # prefix keys, kept across admissions

    def __post_init__(self) -> None:
        prompt = [int(t) for t in self.prompt_token_ids]
        if not prompt:
            raise InvalidArgumentError(f"request {self.request_id!r}: the prompt is empty")
        if min(prompt) < 0:
            raise InvalidArgumentError(f"request {self.request_id!r}: token ids must be >= 0")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgumentError(f"request {self.request_id!r}: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        self.prompt_token_ids = prompt
        self.keys = BlockKeys(self.salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.prompt_token_ids) + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.output_token_ids)
        if self.finish_time is None or self.first_token_time is None or n < 2:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)
