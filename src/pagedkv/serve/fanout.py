"""What both endpoints share: submitting a request's prompts, merging their streams, waiting for the ends
while watching the client, turning snapshots into text deltas, and the usage block.

A client request with P prompts and `n` completions each is P engine requests; completion j of prompt i is
choice `i * n + j` (the order OpenAI documents for `choices`).

Streaming deltas: an engine snapshot carries the whole output text so far; a delta is what was not sent.
Two things are held back until they are certain: a trailing U+FFFD (the bytes of a character split across
tokens), and, when the request has stop strings, the last `max(len(stop)) - 1` characters (they may be the
start of a stop string, which is never shown). The final snapshot's text (cut before the stop string) sends
the rest, so the deltas of a choice always add up to its non-streamed text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedkv.core.errors import CapacityError, EngineStateError, InvalidArgumentError, PagedKVError
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.serve.async_engine import EngineDeadError, ServerOverloadedError
from pagedkv.serve.bodies import engine_refusal
from pagedkv.serve.engine_client import EngineClient, EngineStream
from pagedkv.serve.error_bodies import APIError, unavailable


class ClientGone(Exception):
    """The client disconnected before the answer was ready; its requests were aborted."""


def submit(
    engine: EngineClient,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    cache_salt: str | None,
    group_id: str | None = None,
) -> list[EngineStream]:
    """One engine request per prompt, all or none: a refusal aborts the ones already queued and becomes the
    matching OpenAI error (400, 429 with Retry-After, 503). Every prompt passes the engine's door checks
    before the first is queued, so an invalid prompt is a 400 whatever the queue holds (never a 429 met by
    an earlier, valid prompt) and nothing is queued for it. `group_id` goes to every request
    (`pagedkv.engine.groups`: one prefill per prompt of the group)."""
    streams: list[EngineStream] = []
    try:
        if len(prompts) > 1:
            engine.check_requests(prompts, params, cache_salt)
        for ids, p in zip(prompts, params):
            streams.append(engine.add_request(ids, p, cache_salt=cache_salt, group_id=group_id))
    except ServerOverloadedError as err:
        _abort(streams)
        raise APIError(429, str(err), type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
    except (EngineDeadError, EngineStateError) as err:  # stopped, or paused / asleep: 503
        _abort(streams)
        raise unavailable(str(err)) from None
    except (InvalidArgumentError, CapacityError) as err:
        _abort(streams)
        raise engine_refusal(err) from None
    return streams


def _abort(streams: Sequence[EngineStream]) -> None:
    for stream in streams:
        stream.abort()


def choice_index(prompt_index: int, out: RequestOutput, n: int) -> int:
    j = 0 if out.parent_id is None else int(out.request_id.rsplit(".", 1)[1])
    return prompt_index * n + j


async def merged(streams: Sequence[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; aborts every stream when closed early."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: EngineStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except (PagedKVError, asyncio.CancelledError) as e:
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        _abort(streams)


async def collect(streams: Sequence[EngineStream], request: Request) -> list[list[RequestOutput]]:
    """The final outputs per prompt (parent first), or `ClientGone` (requests aborted) if the client leaves
    first; `EngineDeadError` becomes a 503."""

    async def gather() -> list[list[RequestOutput]]:
        finals: list[list[RequestOutput]] = [[] for _ in streams]
        async for i, out in merged(streams):
            if out.finished:
                finals[i].append(out)
        return finals

    task = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        _abort(streams)
        raise ClientGone()
    try:
        finals = task.result()
    except (EngineDeadError, EngineStateError) as err:  # stopped, or paused / asleep: 503
        raise unavailable(str(err)) from None
    for group in finals:
        group.sort(key=lambda o: choice_index(0, o, 1 << 30))
    return finals


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass(slots=True)
class DeltaTracker:
    """Per choice: how much text and how many tokens were sent (see the module docstring)."""

    holdback: int = 0  # max stop-string length - 1
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_params(cls, params: SamplingParams) -> DeltaTracker:
        return cls(holdback=max((len(s) for s in params.stop), default=1) - 1)

    def step(self, index: int, out: RequestOutput) -> tuple[str, int, int]:
        """(text delta, first new token, end of new tokens) of this snapshot."""
        text = out.output_text or ""
        if not out.finished:
            safe = len(text.rstrip("\ufffd")) - self.holdback
            text = text[: max(safe, 0)]
        sent = self.sent_text.get(index, 0)
        delta = text[sent:]
        self.sent_text[index] = max(sent, len(text))
        first = self.sent_tokens.get(index, 0)
        end = len(out.output_token_ids)
        self.sent_tokens[index] = max(first, end)
        return delta, first, end


def usage(prompt_ids: Sequence[list[int]], finals: Sequence[Sequence[RequestOutput]], *, echo_only: bool = False) -> dict[str, Any]:
    """OpenAI's usage block; the prompt counts once per prompt whatever n is."""
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    completion = 0 if echo_only else sum(len(o.output_token_ids) for group in finals for o in group)
    cached = sum(group[0].num_cached_tokens for group in finals if group)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(out: RequestOutput, *, echo_only: bool = False) -> str | None:
    if not out.finished:
        return None
    return "length" if echo_only else out.finish_reason
