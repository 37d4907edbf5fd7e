"""The engine's door: every request is checked, and built, here before anything is queued. Torch-free.

`RequestIntake.build` either returns a `Request` the scheduler can serve or raises, changing nothing:

- `InvalidArgumentError` for misuse: a `SamplingParams` that is not one, token ids or stop token ids outside
  `[0, vocab)` (floats, bools and ids past int64 are refused by `as_prompt_tokens`), a priority that is not
  an int, stop strings without a tokenizer, a cache salt that is not str/bytes, an id already in use or
  reserved (the id of a request and of its n - 1 children, see `family_ids`);
- `CapacityError` for a well-formed request that can never be served: prompt + max_new_tokens (times the
  completions of n > 1, less their shared full prompt blocks) above the KV capacity, or above the model's
  positions; without chunked prefill, a prompt above `max_num_batched_tokens` (judged on the whole prompt,
  never on what the prefix cache holds now).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pagedkv.core.errors import CapacityError, InvalidArgumentError
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request


def family_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request and of its n - 1 children: "A", "A.1", ..., "A.{n-1}"."""
    return [request_id] + [f"{request_id}.{i}" for i in range(1, n)]


def salt_bytes(cache_salt: object) -> bytes:
    """A cache salt as the allocator's bytes (UTF-8 for text); None and "" mean the shared, unsalted cache."""
    if cache_salt is None:
        return b""
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8")
    if isinstance(cache_salt, bytes):
        return cache_salt
    raise InvalidArgumentError(f"cache_salt must be a str, bytes or None, got {type(cache_salt).__name__}")


@dataclass(frozen=True, slots=True)
class RequestIntake:
    """What the door knows about the engine behind it."""

    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_blocks: int
    max_position_embeddings: int | None
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    has_tokenizer: bool

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def build(
        self,
        request_id: object,
        token_ids: Sequence[int],
        params: object,
        *,
        priority: object,
        arrival_time: float,
        cache_salt: object,
        ids_in_use: Collection[str],
    ) -> Request:
        """A `Request` for these arguments, or a typed error (see the module docstring)."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty string, got {request_id!r}")
        rid = request_id
        if params.stop and not self.has_tokenizer:
            raise InvalidArgumentError(
                f"request {rid!r}: stop strings need a tokenizer (Engine(model, tokenizer)); use stop_token_ids"
            )
        salt = salt_bytes(cache_salt)
        request = Request(
            rid,
            token_ids,
            params.max_new_tokens,
            arrival_time=arrival_time,
            priority=priority,  # type: ignore[arg-type]
            eos_token_id=None if params.ignore_eos else self.eos_token_id,
            stop_token_ids=params.stop_token_ids,
            salt=salt,
        )  # checks the token ids' type and sign, the priority, the arrival time
        for what, tokens in (
            ("prompt token", request.prompt_token_ids),
            ("stop token id", params.stop_token_ids),
        ):
            outside = [t for t in tokens if t >= self.vocab_size]
            if outside:
                raise InvalidArgumentError(
                    f"request {rid!r}: {what} {outside[0]} is outside the model's vocabulary [0, {self.vocab_size})"
                )
        self.check_fits(rid, request.num_prompt_tokens, params)  # bounds n before its ids are listed
        taken = [i for i in family_ids(rid, params.n) if i in ids_in_use]
        if taken:
            raise InvalidArgumentError(
                f"request id {taken[0]!r} is already in use (by a request, or reserved for a child of an n > 1 "
                "request: child i of 'A' is 'A.i'); choose another request_id"
            )
        return request

    def check_fits(self, rid: str, num_prompt: int, params: SamplingParams) -> None:
        """`CapacityError` unless a request of this size can be served by an otherwise empty engine."""
        total = num_prompt + params.max_new_tokens
        if self.max_position_embeddings is not None and total > self.max_position_embeddings:
            raise InvalidArgumentError(
                f"request {rid}: prompt ({num_prompt}) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the model's {self.max_position_embeddings} positions"
            )
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise CapacityError(
                f"request {rid} can never be scheduled: without chunked prefill its prompt ({num_prompt} tokens) "
                f"must run in one step of max_num_batched_tokens={self.max_num_batched_tokens}; enable chunked "
                "prefill or raise the budget"
            )
        bs, n = self.block_size, params.n
        need_tokens = math.ceil(total / bs) * bs * n - (n - 1) * (num_prompt // bs) * bs
        if need_tokens > self.capacity_tokens:
            raise CapacityError(
                f"request {rid} can never fit: prompt ({num_prompt}) + max_new_tokens ({params.max_new_tokens})"
                f"{f' x n={n}' if n > 1 else ''} needs {need_tokens} KV tokens but the cache holds "
                f"{self.capacity_tokens} ({self.num_blocks} blocks of {bs}); raise --kv-budget or shorten it"
            )
