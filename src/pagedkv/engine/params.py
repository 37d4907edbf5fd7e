"""`SamplingParams`: how one request decodes and when it stops. Torch-free (the CLI and simulator read it).

Decoding: `temperature == 0` is greedy (argmax, ties to the lowest id, like transformers); otherwise
logits / temperature, then top-k, then top-p (nucleus), then a draw from the request's own seeded
generator, so a seeded request samples the same tokens whatever else shares its batch.

Stopping, first match wins, checked after every sampled token: `max_new_tokens` reached ("length"), an EOS or
`stop_token_ids` token ("stop", unless `ignore_eos`), a stop string appearing in the decoded output ("stop";
the output text is cut before it, the token ids are kept).

`n > 1` samples n completions of one prompt that share the prompt's KV blocks (fork + copy-on-write).
Child i draws from seed `seed + i` when a seed is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding and stop settings; validated on construction."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            raise InvalidArgumentError(f"n must be >= 1, got {self.n}")
        if isinstance(self.stop, str):
            raise InvalidArgumentError("stop must be a tuple of strings, not one string")
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child_seed(self, index: int) -> int | None:
        """The seed of completion `index` (0 is the parent)."""
        return None if self.seed is None else self.seed + index
