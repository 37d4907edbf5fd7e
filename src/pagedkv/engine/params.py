"""`SamplingParams`: how one request decodes and when it stops. Torch-free (the CLI and simulator read it).

Decoding: `temperature == 0` is greedy (argmax, ties to the lowest id, like transformers); otherwise
logits / temperature, then top-k, then top-p (nucleus), then a draw from the request's own seeded
generator, so a seeded request samples the same tokens whatever else shares its batch.

Stopping, checked after every sampled token, first match wins:
  1. the token is EOS (unless `ignore_eos`) or one of `stop_token_ids` -> "stop" (the token is kept);
  2. `max_new_tokens` tokens have been generated -> "length";
  3. a stop string appears in the decoded output -> "stop" (the output text is cut before it, the token
     ids are kept). Stop strings need the engine's tokenizer: `Engine.add_request` refuses them without one.
So a stop token that is also the last allowed token ends the request with "stop", not "length".

`n > 1` samples n completions of one prompt that share the prompt's KV blocks (fork + copy-on-write).
Child i draws from seed `seed + i` when a seed is given.

`logprobs=k` records, for every generated token, its log-probability and the k most likely tokens' (from the
model's raw distribution, before temperature and filtering, as vLLM and OpenAI report them);
`prompt_logprobs=k` does the same for every prompt token after the first (scoring, `echo` in the OpenAI
API). A request asking for prompt log-probabilities computes its whole prompt (no prefix-cache hits).
k is at most `MAX_LOGPROBS`.

Every field is checked on construction (types included: a float `n` or a NaN temperature is refused, not
truncated or carried into the sampler), so a `SamplingParams` that exists is one the engine can run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.core.errors import InvalidArgumentError

MAX_LOGPROBS = 20  # OpenAI's largest top_logprobs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_logprobs(*ks: object) -> None:
    for name, k in zip(("logprobs", "prompt_logprobs"), ks):
        if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS):
            raise InvalidArgumentError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding and stop settings; validated on construction (see the module docstring)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities of each generated token (0 = the token's own only)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidArgumentError(f"seed must be None or an int in [0, 2^63), got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise InvalidArgumentError(f"n must be an int >= 1, got {self.n!r}")
        if isinstance(self.stop, str):
            raise InvalidArgumentError("stop must be a tuple of strings, not one string")
        if not isinstance(self.stop, tuple | list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgumentError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple | list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidArgumentError(f"stop_token_ids must be a tuple of ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_logprobs(self.logprobs, self.prompt_logprobs)
        # lists are accepted for convenience; stored as tuples so the params stay hashable and immutable
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child_seed(self, index: int) -> int | None:
        """The seed of completion `index` (0 is the parent)."""
        return None if self.seed is None else self.seed + index
