"""The load generator of `pagedkv bench serve`: one workload, one client, any OpenAI-compatible server.

Workload. Rows of the Azure conv trace (Patel et al., "Splitwise", ISCA 2024, CC-BY 4.0) give each request
a prompt length `max(8, ContextTokens // prompt_scale)` and an output length
`max(4, GeneratedTokens // output_scale)` (the scaling of `pagedkv bench e2e`), both capped so that prompt +
output fits the model's context and the KV budget. Prompts are text, because `transformers serve` takes
nothing else: seeded random words, each one token of the model's tokenizer, so the prompt is exactly its
trace length in tokens (checked by encoding it). `variant` reseeds the words and keeps the lengths: every
timed run sends prompts no server has seen, so no prefix cache serves a repeat from the last run.

Arrivals. `poisson_arrivals(n, rate)`: exponential gaps of mean 1/rate seconds, the first request at 0;
`rate=None` is the burst, every request at 0. The schedule is seeded, the same for every system.

Client. Every request is a streaming `POST /v1/completions` (httpx, one connection per request in flight)
with `max_tokens` = its output length, temperature 0, and the system's extra body fields (how each system is
told to ignore EOS). For each request: the time it was sent, the time of each streamed chunk that carries
text, the completion tokens (`usage.completion_tokens` of the last chunk, else the number of text chunks),
the streamed text, and an error (an HTTP status, an error event, a stream cut short, a wrong token count).
Every request asks for `stream_options.include_usage`: a token that decodes to no text (half of a
multi-byte character) sends no chunk, so counting chunks undercounts.
Times are `time.perf_counter()` seconds from the start of the run.

Shared prefix (`shared_prefix_requests`): every request at t=0, each prompt one shared prefix (seeded per
variant) followed by words of its own: what a prefix cache serves from one computed copy.

Figures (`summarize`): output tokens/s and completed requests/s over the run's wall time (first request sent
to last response done), TTFT (first text chunk - sent), TPOT ((last text chunk - first) / (tokens - 1)) and
ITL (the gaps between consecutive text chunks, pooled over requests) at p50 and p99 over the completed
requests, and the number of errors.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.percentiles import percentile
from pagedkv.workloads.traces import default_trace_path, load_trace

_WORD = re.compile(r"[a-z]{3,12}")


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One request of a run: its text prompt (exactly `prompt_tokens` tokens) and its output length."""

    request_id: str
    prompt: str
    prompt_tokens: int
    output_len: int
    arrival_s: float = 0.0


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request (times from the start of the run)."""

    request_id: str
    sent_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    done_s: float | None = None
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Shape:
    """The lengths of one trace row after scaling and capping."""

    index: int
    prompt_tokens: int
    output_len: int


def trace_shapes(
    num_requests: int, prompt_scale: int, output_scale: int, max_total_tokens: int, offset: int = 0
) -> list[Shape]:
    """Rows `[offset, offset + num_requests)` of the Azure conv trace, scaled, each capped so that prompt +
    output <= `max_total_tokens` (the output is cut first, down to 1 token, then the prompt)."""
    if max_total_tokens < 9:
        raise InvalidArgumentError(
            f"a request needs room for 9 tokens (8 prompt + 1 output), got {max_total_tokens}"
        )
    rows = load_trace(default_trace_path(), limit=offset + num_requests)[offset:]
    shapes = []
    for row in rows:
        prompt = max(8, row.prompt_len // prompt_scale)
        output = max(4, row.output_len // output_scale)
        output = max(1, min(output, max_total_tokens - prompt))
        prompt = min(prompt, max_total_tokens - output)
        shapes.append(Shape(row.index, prompt, output))
    return shapes


class PromptWords:
    """Words of the tokenizer (" abc") that encode, with their leading space, to exactly one token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        candidates = sorted({" " + t.strip() for t in texts if _WORD.fullmatch(t.strip())})
        self.words = [w for w in candidates if len(self.encode(w)) == 1]
        if len(self.words) < 16:
            raise InvalidArgumentError(
                f"the tokenizer has {len(self.words)} one-token words (' abc'); the load generator needs >= 16"
            )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, num_tokens: int, rng: np.random.Generator) -> str:
        """A prompt of exactly `num_tokens` tokens (checked)."""
        picks = rng.integers(0, len(self.words), size=num_tokens)
        text = "".join(self.words[i] for i in picks)
        got = len(self.encode(text))
        if got != num_tokens:  # a tokenizer that merges across words: say so rather than mis-measure
            raise InvalidArgumentError(f"a prompt of {num_tokens} one-token words encodes to {got} tokens")
        return text


def build_requests(
    shapes: Sequence[Shape], words: PromptWords, arrivals: Sequence[float], seed: int, variant: int
) -> list[ServeRequest]:
    """The requests of one run: the shapes' lengths, prompts drawn from `(seed, variant)`, the arrivals."""
    rng = np.random.default_rng([seed, variant])
    return [
        ServeRequest(
            f"v{variant}-r{s.index}", words.prompt(s.prompt_tokens, rng), s.prompt_tokens, s.output_len, t
        )
        for s, t in zip(shapes, arrivals, strict=True)
    ]


def shared_prefix_requests(
    shapes: Sequence[Shape], words: PromptWords, prefix_tokens: int, seed: int, variant: int
) -> list[ServeRequest]:
    """One request per shape, all at t=0, each prompt a `prefix_tokens`-token prefix drawn once from
    `(seed, variant)` and shared by all, then the shape's own words (its prompt length) after it."""
    rng = np.random.default_rng([seed, variant, prefix_tokens])
    prefix = words.prompt(prefix_tokens, rng)
    out = []
    for s in shapes:
        prompt = prefix + words.prompt(s.prompt_tokens, rng)
        n = prefix_tokens + s.prompt_tokens
        if len(words.encode(prompt)) != n:
            raise InvalidArgumentError(f"a shared-prefix prompt of {n} one-token words does not encode to {n}")
        out.append(ServeRequest(f"v{variant}-p{s.index}", prompt, n, s.output_len, 0.0))
    return out


def poisson_arrivals(num_requests: int, rate: float | None, seed: int) -> list[float]:
    """Arrival offsets in seconds: Poisson at `rate` requests/s (first at 0), or all 0 for `rate=None`."""
    if rate is None:
        return [0.0] * num_requests
    if rate <= 0:
        raise InvalidArgumentError(f"an arrival rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


# --- the client -------------------------------------------------------------------------------------------


async def _stream_one(client: Any, url: str, body: dict[str, Any], result: RequestResult, t0: float) -> None:
    """Send one streaming completion and record what came back into `result`."""
    usage_tokens: int | None = None
    finished = False
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            result.error = f"HTTP {response.status_code}: {raw[:200].decode(errors='replace')}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.error = f"error event: {str(event['error'])[:200]}"
                return
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    result.chunk_times.append(time.perf_counter() - t0)
                    result.text += choice["text"]
                finished = finished or choice.get("finish_reason") is not None
            if event.get("usage"):
                usage_tokens = int(event["usage"]["completion_tokens"])
    result.completion_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)
    if not finished:
        result.error = "the stream ended without a finish_reason"


async def _one(
    client: Any, request: ServeRequest, body: dict[str, Any], t0: float, result: RequestResult
) -> None:
    await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
    result.sent_s = time.perf_counter() - t0
    try:
        await _stream_one(client, "/v1/completions", body, result, t0)
    except Exception as err:  # a client must survive any server failure: it is counted, not raised
        result.error = f"{type(err).__name__}: {str(err)[:200]}"
    result.done_s = time.perf_counter() - t0
    if result.error is None and result.completion_tokens != request.output_len:
        result.error = f"{result.completion_tokens} tokens where {request.output_len} were asked"


async def drive(
    base_url: str,
    requests: Sequence[ServeRequest],
    extra_body: dict[str, Any],
    *,
    model: str | None = None,
    timeout_s: float = 600.0,
    transport: Any = None,
) -> list[RequestResult]:
    """Send every request at its arrival time, streaming; one result per request, in request order.
    `transport` replaces the network (an `httpx.MockTransport` in tests)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results = [RequestResult(r.request_id) for r in requests]
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, limits=limits, transport=transport
    ) as client:
        t0 = time.perf_counter()
        tasks = []
        for r, res in zip(requests, results):
            body: dict[str, Any] = {"prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0,
                                    "stream": True, "stream_options": {"include_usage": True},
                                    **extra_body}  # fmt: skip
            if model is not None:
                body["model"] = model
            tasks.append(asyncio.create_task(_one(client, r, body, t0, res)))
        await asyncio.gather(*tasks)
    return results


def run_load(
    base_url: str, requests: Sequence[ServeRequest], extra_body: dict[str, Any], **kwargs: Any
) -> list[RequestResult]:
    """`drive` on a fresh event loop (the bench itself is synchronous)."""
    return asyncio.run(drive(base_url, requests, extra_body, **kwargs))


# --- figures ----------------------------------------------------------------------------------------------


def summarize(requests: Sequence[ServeRequest], results: Sequence[RequestResult]) -> dict[str, Any]:
    """The run's figures (see the module docstring)."""
    ok = [res for res in results if res.error is None]
    ttft = [res.chunk_times[0] - res.sent_s for res in ok if res.chunk_times]
    tpot = [
        (res.chunk_times[-1] - res.chunk_times[0]) / (res.completion_tokens - 1)
        for res in ok
        if res.chunk_times and res.completion_tokens > 1
    ]
    itl = [b - a for res in ok for a, b in zip(res.chunk_times, res.chunk_times[1:])]
    start = min((res.sent_s for res in results), default=0.0)
    end = max((res.done_s or 0.0 for res in results), default=0.0)
    wall = max(end - start, 1e-9)
    tokens = sum(res.completion_tokens for res in ok)
    errors = [res for res in results if res.error is not None]
    return {
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens": tokens,
        "requests": len(requests),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "wall_s": wall,
    }
