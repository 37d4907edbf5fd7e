"""Seeded synthetic workloads: lengths, token ids and arrival times, torch-free.

Every generator returns `GeneratedRequest`s in arrival order, with explicit token ids so that prefix caching
sees exactly the sharing the workload intends:

- `variable_length`: prompt and output lengths log-normal, fitted to the Azure conv trace (Patel et al.,
  "Splitwise", ISCA 2024): ln(prompt) ~ N(6.633, 0.985), ln(output) ~ N(5.019, 0.859), i.e. medians of
  about 760 and 150 tokens. This is where paging should buy the most.
- `fixed_length`: every request the same prompt and output length: where paging should buy little.
- `shared_prefix`: one system prompt in front of every request's private user text.
- `multi_turn`: conversations whose turn k+1 prompt is turn k's prompt, turn k's answer and a new user
  message; turn k+1 arrives `think_s` after turn k finishes (`parent` links the turns), so a prefix cache
  can serve the whole history.
- `multi_tenant`: a few long system prompts (tenants, Zipf-popular) shared by many users' short messages,
  and one-off long documents among them; under LRU the documents flush the less popular tenants' prompts
  between their users, which is what frequency- and cost-aware eviction keeps (docs/cache-policy.md).

Arrivals: `poisson_arrivals(n, rate)` (exponential gaps), or everything at t=0 when `rate` is None.
Token ids are drawn from [1, VOCAB); 0 and VOCAB and above are never produced (free for end-of-sequence
markers). The same seed gives the same workload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError

VOCAB = 50_000
# ln-space mean and std of ContextTokens / GeneratedTokens over all 19,366 rows of Azure conv 2023.
AZURE_CONV_PROMPT_LOGNORMAL = (6.633, 0.985)
AZURE_CONV_OUTPUT_LOGNORMAL = (5.019, 0.859)

TokenArray = npt.NDArray[np.int32]


@dataclass(frozen=True)
class GeneratedRequest:
    """One synthetic request. `parent` (multi-turn) names an earlier request this one follows."""

    index: int
    arrival_s: float
    prompt_token_ids: TokenArray
    output_token_ids: TokenArray
    parent: int | None = None
    think_s: float = 0.0

    @property
    def prompt_len(self) -> int:
        return int(len(self.prompt_token_ids))

    @property
    def output_len(self) -> int:
        return int(len(self.output_token_ids))


def _check_count(n: int, what: str = "num_requests") -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"{what} must be an int >= 1, got {n!r}")


def _check_len(value: int, what: str, *, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{what} must be an int >= {minimum}, got {value!r}")


def poisson_arrivals(n: int, rate: float | None, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """Arrival times of `n` requests at `rate` per second (first at 0); all zero when `rate` is None."""
    _check_count(n)
    if rate is None:
        return np.zeros(n)
    if not rate > 0 or not np.isfinite(rate):
        raise InvalidArgumentError(f"arrival rate must be a positive number of requests/s, got {rate!r}")
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _tokens(rng: np.random.Generator, n: int) -> TokenArray:
    return rng.integers(1, VOCAB, size=n, dtype=np.int32)


def lognormal_lengths(
    rng: np.random.Generator, n: int, mu: float, sigma: float, *, low: int = 1, high: int | None = None
) -> npt.NDArray[np.int64]:
    """`n` integer lengths with ln(length) ~ N(mu, sigma), clipped to [low, high]."""
    lengths = np.rint(rng.lognormal(mu, sigma, size=n)).astype(np.int64)
    return np.clip(lengths, low, high if high is not None else np.iinfo(np.int64).max)


def variable_length(
    num_requests: int,
    *,
    seed: int = 0,
    rate: float | None = None,
    prompt_lognormal: tuple[float, float] = AZURE_CONV_PROMPT_LOGNORMAL,
    output_lognormal: tuple[float, float] = AZURE_CONV_OUTPUT_LOGNORMAL,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
) -> list[GeneratedRequest]:
    """Log-normal prompt and output lengths (Azure conv fit by default), private prompts."""
    _check_count(num_requests)
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    prompts = lognormal_lengths(rng, num_requests, *prompt_lognormal, high=max_prompt_len)
    outputs = lognormal_lengths(rng, num_requests, *output_lognormal, high=max_output_len)
    return [
        GeneratedRequest(i, float(arrivals[i]), _tokens(rng, int(prompts[i])), _tokens(rng, int(outputs[i])))
        for i in range(num_requests)
    ]


def fixed_length(
    num_requests: int,
    *,
    prompt_len: int = 512,
    output_len: int = 128,
    seed: int = 0,
    rate: float | None = None,
) -> list[GeneratedRequest]:
    """Every request `prompt_len` private prompt tokens and exactly `output_len` output tokens."""
    _check_count(num_requests)
    _check_len(prompt_len, "prompt_len")
    _check_len(output_len, "output_len")
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return [
        GeneratedRequest(i, float(arrivals[i]), _tokens(rng, prompt_len), _tokens(rng, output_len))
        for i in range(num_requests)
    ]


def shared_prefix(
    num_requests: int,
    *,
    system_prompt_len: int = 1024,
    seed: int = 0,
    rate: float | None = None,
    user_lognormal: tuple[float, float] = (5.0, 0.8),
    output_lognormal: tuple[float, float] = AZURE_CONV_OUTPUT_LOGNORMAL,
    max_output_len: int | None = None,
) -> list[GeneratedRequest]:
    """One `system_prompt_len`-token system prompt, then private log-normal user text, for every request."""
    _check_count(num_requests)
    _check_len(system_prompt_len, "system_prompt_len", minimum=0)
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    system = _tokens(rng, system_prompt_len)
    users = lognormal_lengths(rng, num_requests, *user_lognormal)
    outputs = lognormal_lengths(rng, num_requests, *output_lognormal, high=max_output_len)
    return [
        GeneratedRequest(
            i,
            float(arrivals[i]),
            np.concatenate([system, _tokens(rng, int(users[i]))]),
            _tokens(rng, int(outputs[i])),
        )
        for i in range(num_requests)
    ]


def multi_turn(
    num_conversations: int,
    *,
    turns: int = 4,
    system_prompt_len: int = 256,
    seed: int = 0,
    rate: float | None = None,
    think_s: float = 5.0,
    user_lognormal: tuple[float, float] = (4.5, 0.8),
    output_lognormal: tuple[float, float] = AZURE_CONV_OUTPUT_LOGNORMAL,
    max_prompt_len: int | None = None,
) -> list[GeneratedRequest]:
    """Chats of `turns` turns: each turn's prompt is the whole history so far plus a new user message.

    Conversations start at Poisson times (`rate` conversations/s, or all at 0); turn k+1 has `parent` = turn k
    and `think_s`: it arrives that long after its parent finishes (its `arrival_s` is only a lower bound).
    A conversation stops early when the next prompt would exceed `max_prompt_len`. Each conversation has its
    own system prompt, so sharing is only within a conversation.
    """
    _check_count(num_conversations, "num_conversations")
    _check_len(turns, "turns")
    _check_len(system_prompt_len, "system_prompt_len", minimum=0)
    if think_s < 0:
        raise InvalidArgumentError(f"think_s must be >= 0 seconds, got {think_s!r}")
    rng = np.random.default_rng(seed)
    starts = poisson_arrivals(num_conversations, rate, rng)
    requests: list[GeneratedRequest] = []
    for c in range(num_conversations):
        history = _tokens(rng, system_prompt_len)
        parent: int | None = None
        for _ in range(turns):
            user = _tokens(rng, int(lognormal_lengths(rng, 1, *user_lognormal)[0]))
            prompt = np.concatenate([history, user])
            if max_prompt_len is not None and len(prompt) > max_prompt_len:
                break
            output = _tokens(rng, int(lognormal_lengths(rng, 1, *output_lognormal)[0]))
            index = len(requests)
            requests.append(
                GeneratedRequest(
                    index, float(starts[c]), prompt, output, parent, think_s if parent is not None else 0.0
                )
            )
            history = np.concatenate([prompt, output])
            parent = index
    return requests


def multi_tenant(
    num_requests: int,
    *,
    num_tenants: int = 16,
    system_prompt_len: int = 1024,
    doc_fraction: float = 0.4,
    seed: int = 0,
    rate: float | None = None,
    zipf: float = 1.0,
    user_lognormal: tuple[float, float] = (5.0, 0.8),
    doc_lognormal: tuple[float, float] = (8.0, 0.3),
    output_lognormal: tuple[float, float] = AZURE_CONV_OUTPUT_LOGNORMAL,
    max_prompt_len: int | None = None,
) -> list[GeneratedRequest]:
    """`num_tenants` system prompts of `system_prompt_len` tokens, tenant i chosen with weight 1/(i+1)^zipf,
    each followed by a private log-normal user message; a `doc_fraction` of the requests are instead one-off
    documents (log-normal, ~3,000 tokens by default, read once). Prompts are cut to `max_prompt_len`."""
    _check_count(num_requests)
    _check_len(num_tenants, "num_tenants")
    _check_len(system_prompt_len, "system_prompt_len", minimum=0)
    if not 0.0 <= doc_fraction <= 1.0:
        raise InvalidArgumentError(f"doc_fraction must be in [0, 1], got {doc_fraction!r}")
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    systems = [_tokens(rng, system_prompt_len) for _ in range(num_tenants)]
    weights = 1.0 / np.arange(1, num_tenants + 1) ** zipf
    tenants = rng.choice(num_tenants, size=num_requests, p=weights / weights.sum())
    is_doc = rng.random(num_requests) < doc_fraction
    users = lognormal_lengths(rng, num_requests, *user_lognormal)
    docs = lognormal_lengths(rng, num_requests, *doc_lognormal)
    outputs = lognormal_lengths(rng, num_requests, *output_lognormal)
    requests = []
    for i in range(num_requests):
        prompt = _tokens(rng, int(docs[i])) if is_doc[i] else np.concatenate([systems[tenants[i]], _tokens(rng, int(users[i]))])
        if max_prompt_len is not None:
            prompt = prompt[:max_prompt_len]
        requests.append(GeneratedRequest(i, float(arrivals[i]), prompt, _tokens(rng, int(outputs[i]))))
    return requests
