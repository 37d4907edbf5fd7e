"""`SpeculativeConfig`: how the engine speculates, and its one textual form for the CLI. Torch-free.

Two proposers (`method`):

- `"ngram"`: prompt lookup. The last n tokens of the request (prompt + output so far), for n from
  `prompt_lookup_max` down to `prompt_lookup_min` (vLLM's names and meaning), are matched against the
  tokens before them; the tokens that followed the latest match are proposed, up to k.
- `"draft"`: a smaller model with the same tokenizer (`draft_model`, a path or id that
  `pagedkv.hf.loading` loads) proposes k tokens greedily; its KV lives in pagedkv pages of its own.

`num_speculative_tokens` is k, the most draft tokens one request verifies per step. Each request adapts
its own k between 0 and k (`AdaptiveK`), so a proposer that keeps missing switches itself off for that
request and is tried again later. With `budget` (on by default) the step's draft budget
(`DraftBudget`) then cuts the batch's drafts to those that raise the whole step's expected tokens per
second, from each request's measured acceptance and a step cost fitted to the measured steps: none where
the step is compute-bound and acceptance low. `disable_by_batch_size` (vLLM's `disable_by_batch_size`)
turns speculation off for a step when more requests than that are running.

Text form (`parse_speculative`): `ngram:k=4` (options `min=`, `max=`, `off_above=`, `budget=0|1`) or
`draft:MODEL,k=3` (options `off_above=`, `budget=0|1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedkv.core.errors import InvalidArgumentError

SpeculativeMethod = Literal["ngram", "draft"]
METHODS: tuple[str, ...] = ("ngram", "draft")


def _positive_int(value: object, name: str, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidArgumentError(f"speculative {name} must be an int >= {least}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """The proposer, k, and when speculation is off; validated on construction (module docstring)."""

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    disable_by_batch_size: int | None = None
    budget: bool = True  # the step's DraftBudget on top of each request's AdaptiveK

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgumentError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _positive_int(self.num_speculative_tokens, "num_speculative_tokens (k)")
        _positive_int(self.prompt_lookup_min, "prompt_lookup_min")
        _positive_int(self.prompt_lookup_max, "prompt_lookup_max")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidArgumentError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if (self.method == "draft") != (self.draft_model is not None):
            raise InvalidArgumentError("a draft_model is given exactly when method is 'draft' (draft:MODEL,k=3)")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise InvalidArgumentError(f"speculative draft_model must be a non-empty string, got {self.draft_model!r}")
        if self.disable_by_batch_size is not None:
            _positive_int(self.disable_by_batch_size, "disable_by_batch_size")
        if not isinstance(self.budget, bool):
            raise InvalidArgumentError(f"speculative budget must be a bool, got {self.budget!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def describe(self) -> str:
        """The text form `parse_speculative` reads back."""
        head = "ngram" if self.method == "ngram" else f"draft:{self.draft_model}"
        parts = [f"k={self.k}"]
        if self.method == "ngram":
            parts += [f"min={self.prompt_lookup_min}", f"max={self.prompt_lookup_max}"]
        if self.disable_by_batch_size is not None:
            parts.append(f"off_above={self.disable_by_batch_size}")
        if not self.budget:
            parts.append("budget=0")
        return f"{head}{':' if self.method == 'ngram' else ','}{','.join(parts)}"


_OPTIONS = {"k": "num_speculative_tokens", "min": "prompt_lookup_min", "max": "prompt_lookup_max",
            "off_above": "disable_by_batch_size", "budget": "budget"}  # fmt: skip


def parse_speculative(text: str) -> SpeculativeConfig:
    """`ngram:k=4`, `ngram:k=4,min=1,max=3`, `draft:MODEL,k=3` -> a `SpeculativeConfig`."""
    usage = "write ngram:k=4 (options min=, max=, off_above=, budget=0|1) or draft:MODEL,k=3"
    method, sep, rest = text.strip().partition(":")
    if method not in METHODS or not sep:
        raise InvalidArgumentError(f"cannot read speculative setting {text!r}; {usage}")
    parts = [p.strip() for p in rest.split(",")] if rest.strip() else []
    kw: dict[str, object] = {"method": method}
    if method == "draft":
        if not parts or "=" in parts[0] or not parts[0]:
            raise InvalidArgumentError(f"speculative setting {text!r} names no draft model; {usage}")
        kw["draft_model"], parts = parts[0], parts[1:]
    for part in parts:
        name, eq, value = part.partition("=")
        field = _OPTIONS.get(name.strip())
        if not eq or field is None or (method == "draft" and name in ("min", "max")):
            raise InvalidArgumentError(f"unknown speculative option {part!r} in {text!r}; {usage}")
        if field == "budget":
            if value not in ("0", "1"):
                raise InvalidArgumentError(f"speculative option {part!r}: budget is 0 or 1; {usage}")
            kw[field] = value == "1"
            continue
        try:
            kw[field] = int(value)
        except ValueError:
            raise InvalidArgumentError(f"speculative option {part!r}: {value!r} is not an int; {usage}") from None
    return SpeculativeConfig(**kw)  # type: ignore[arg-type]
