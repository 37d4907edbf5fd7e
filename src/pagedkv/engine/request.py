"""A request as the scheduler sees it: token ids, limits, progress and timings. No model, no tensors.

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption by recompute (its KV is
dropped; it keeps its output tokens and is re-admitted with prompt + output) and RUNNING -> SWAPPED ->
RUNNING on preemption by swap. `num_computed_tokens` (tokens whose KV is written) catches up to
`num_tokens` (prompt + output); a step that brings it level samples the next token.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.core.prefix import BlockKeys

FINISH_REASONS = ("length", "stop", "abort", "rejected", "error")
"""Why a request ended: "length" (max_new_tokens), "stop" (EOS, a stop token or stop string, or a caller's
stop), "abort" (the caller, or its n > 1 parent, was aborted), "rejected" (could never be served), "error"
(something about this request failed: its logits, its stop check, its streaming callback)."""


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
    finish_reason: str | None = field(default=None, init=False)  # one of FINISH_REASONS
    error: str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)
    keys: BlockKeys = field(init=False)  # prefix keys, kept across admissions
    # speculative decoding: tokens proposed to follow the last one, verified in the next decode step (the
    # scheduler takes them, trimmed to its budget and to max_new_tokens, and clears them)
    draft_token_ids: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidArgumentError(f"request ids must be non-empty strings, got {rid!r}")
        self.prompt_token_ids = as_prompt_tokens(self.prompt_token_ids, f"request {rid!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgumentError(f"request {rid!r}: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int | np.integer):
            raise InvalidArgumentError(f"request {rid!r}: priority must be an int, got {self.priority!r}")
        self.priority = int(self.priority)
        if isinstance(self.arrival_time, bool) or not isinstance(self.arrival_time, int | float | np.number) or not math.isfinite(self.arrival_time):
            raise InvalidArgumentError(f"request {rid!r}: arrival_time must be a finite number, got {self.arrival_time!r}")
        self.arrival_time = float(self.arrival_time)
        if not isinstance(self.salt, bytes):
            raise InvalidArgumentError(f"request {rid!r}: salt must be bytes, got {type(self.salt).__name__}")
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


def as_prompt_tokens(token_ids: Sequence[int] | np.ndarray, what: str = "prompt") -> list[int]:
    """A prompt as a non-empty list of ints >= 0; floats, bools, strings and nested lists are refused with
    `InvalidArgumentError`, never truncated."""
    try:
        arr = np.asarray(token_ids) if not isinstance(token_ids, str) else np.asarray([token_ids])
    except (TypeError, ValueError) as e:  # ragged or otherwise not an array of numbers
        raise InvalidArgumentError(f"{what}: give a flat list of token ids ({e})") from None
    if arr.ndim != 1 or arr.size == 0:
        shape = "empty" if arr.size == 0 else f"of shape {arr.shape}"
        raise InvalidArgumentError(f"{what}: the prompt is {shape}; give a flat list of token ids")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what}: token ids must be ints (got dtype {arr.dtype}; values beyond int64 or "
            "floats are not token ids)"
        )
    if int(arr.min()) < 0:
        raise InvalidArgumentError(f"{what}: token ids must be >= 0, got {int(arr.min())}")
    return [int(t) for t in arr.tolist()]
