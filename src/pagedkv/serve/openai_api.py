"""POST /v1/completions and /v1/chat/completions: OpenAI request in, OpenAI response (or SSE stream) out.

Each handler: parse the body strictly (`bodies`), check the model, encode the prompts (the chat template for
chat), map the fields onto `SamplingParams`, submit every prompt at once (`fanout.submit`: 400 / 429 / 503
before anything runs), then either wait for the ends (aborting if the client leaves) or stream
`data: {chunk}` events and `data: [DONE]` through starlette's `StreamingResponse`.

`echo` with `max_tokens: 0` (the scoring call of evaluation harnesses) runs the prompt for one token, which
is dropped: the answer holds the prompt's text and, with `logprobs`, its tokens' log-probabilities (the first
token's is null, as OpenAI's).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.core.errors import PagedKVError
from pagedkv.engine.outputs import RequestOutput, TokenLogprobs
from pagedkv.serve.async_engine import AsyncEngine
from pagedkv.serve.bodies import ChatCompletionRequest, CompletionRequest, parse_body, sampling_params
from pagedkv.serve.error_bodies import APIError, bad_request, internal_error
from pagedkv.serve.fanout import (
    ClientGone,
    DeltaTracker,
    choice_index,
    collect,
    finish_reason,
    merged,
    submit,
    usage,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass(slots=True)
class ServerContext:
    """What the handlers need: the engine, the served model's name, the server's own tokenizer copy."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any
    max_positions: int | None
    _token_text: dict[int, str] = field(default_factory=dict)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")  # fmt: skip

    def encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: send token ids", param)
        ids = [int(t) for t in self.tokenizer(text)["input_ids"]]
        if not ids:
            raise bad_request(f"{param}: the prompt is empty (no tokens)", param)
        return ids

    def chat_ids(self, messages: Sequence[Any]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in messages], add_generation_prompt=True, tokenize=True
            )
        except Exception as err:  # the template refused these messages (roles, order): the client's input
            raise bad_request(f"messages: the chat template refused them ({err})", "messages") from None
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]

    def text_of(self, token_id: int) -> str:
        """One token's text (bounded by the vocabulary)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id])) if self.tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    def default_max_tokens(self, num_prompt: int) -> int:
        """Chat without max_tokens: what the positions and the KV pool leave (at least 1)."""
        capacity = self.engine.engine.capacity_tokens - self.engine.engine.config.block_size
        limit = capacity if self.max_positions is None else min(capacity, self.max_positions)
        return max(1, limit - num_prompt)

    def completion_logprobs(self, entries: Sequence[TokenLogprobs | None], ids: Sequence[int], offset: int) -> dict[str, Any]:
        tokens = [self.text_of(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {self.text_of(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.text_of(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error(err: BaseException) -> str:
    if isinstance(err, APIError):
        return sse(err.body())
    return sse(APIError(500, str(err), type="server_error", code="engine_unavailable").body())


def check_finals(finals: Sequence[Sequence[RequestOutput]]) -> None:
    """A completion that ended in error (not the client's doing) is a 500 with its message."""
    for group in finals:
        for out in group:
            if out.finish_reason == "error":
                raise internal_error(f"request failed: {out.error}")


# --- /v1/completions ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Completion:
    req: CompletionRequest
    texts: list[str]
    ids: list[list[int]]
    echo_only: bool
    rid: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def _completion_prompts(ctx: ServerContext, prompt: Any) -> tuple[list[str], list[list[int]]]:
    if isinstance(prompt, str):
        return [prompt], [ctx.encode(prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt: give a string, a list of strings, a list of token ids or a list of such lists", "prompt")
    if isinstance(prompt[0], str):
        return list(prompt), [ctx.encode(p, f"prompt.{i}") for i, p in enumerate(prompt)]
    lists = [prompt] if isinstance(prompt[0], int) else list(prompt)
    return [], [list(ids) for ids in lists]  # the texts, for echo only, once the engine accepted the ids


async def create_completion(ctx: ServerContext, request: Request, body: bytes) -> Response:
    req = parse_body(CompletionRequest, body)
    ctx.check_model(req.model)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens: must be >= 1 (0 only with echo)", "max_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of: only best_of == n is supported", "best_of", "unsupported_parameter")
    if req.suffix:
        raise bad_request("suffix is not supported by pagedkv", "suffix", "unsupported_parameter")
    texts, ids = _completion_prompts(ctx, req.prompt)
    job = _Completion(req, texts, ids, echo_only=req.echo and req.max_tokens == 0)
    max_tokens = 1 if job.echo_only else (req.max_tokens or DEFAULT_COMPLETION_TOKENS)
    scoring = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=scoring)
    streams = submit(ctx.engine, ids, [params] * len(ids), req.cache_salt)
    if not texts:
        texts = [str(ctx.tokenizer.decode(p)) if ctx.tokenizer is not None else "" for p in ids]
        job.texts = texts
    if req.stream:
        st = _Streamed(merged(streams), DeltaTracker.for_params(params), [[] for _ in ids])
        usage_of = functools.partial(usage, ids, st.finals, echo_only=job.echo_only)  # read when the stream ends
        events = _sse_events(ctx, job, "text_completion", _completion_deltas(ctx, job, st), usage_of)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        finals = await collect(streams, request)
    except ClientGone:
        return Response(status_code=499)
    check_finals(finals)
    choices = [_completion_choice(ctx, job, i, out) for i, group in enumerate(finals) for out in group]
    choices.sort(key=lambda c: c["index"])
    answer = {**_envelope(ctx, job, "text_completion", choices), "usage": usage(ids, finals, echo_only=job.echo_only)}
    return JSONResponse({**answer, "system_fingerprint": None})


def _completion_choice(ctx: ServerContext, job: _Completion, i: int, out: RequestOutput) -> dict[str, Any]:
    text = "" if job.echo_only else (out.output_text or "")
    token_ids = [] if job.echo_only else list(out.output_token_ids)
    entries: list[TokenLogprobs | None] = [] if job.echo_only else list(out.logprobs or [])
    if job.req.echo:
        text = job.texts[i] + text
        token_ids = job.ids[i] + token_ids
        entries = list(out.prompt_logprobs or [None] * len(job.ids[i])) + entries
    logprobs = ctx.completion_logprobs(entries, token_ids, 0) if job.req.logprobs is not None else None
    return {
        "index": choice_index(i, out, job.req.n),
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(out, echo_only=job.echo_only),
    }


async def _completion_deltas(ctx: ServerContext, job: _Completion, st: _Streamed) -> AsyncIterator[dict[str, Any]]:
    """A streamed completion's choices, one per output with something new (the prompt first with echo)."""
    echoed: set[int] = set()
    async for i, out in st.outputs:
        index = choice_index(i, out, job.req.n)
        delta, a, b = ("", 0, 0) if job.echo_only else st.tracker.step(index, out)
        token_ids = list(out.output_token_ids[a:b])
        entries: list[TokenLogprobs | None] = list((out.logprobs or [])[a:b])
        if job.req.echo and index not in echoed:
            echoed.add(index)
            delta = job.texts[i] + delta
            token_ids = job.ids[i] + token_ids
            entries = list(out.prompt_logprobs or [None] * len(job.ids[i])) + entries
        if out.finished:
            st.finals[i].append(out)
        elif not delta and not token_ids:
            continue
        logprobs = ctx.completion_logprobs(entries, token_ids, 0) if job.req.logprobs is not None else None
        yield {"index": index, "text": delta, "logprobs": logprobs,
               "finish_reason": finish_reason(out, echo_only=job.echo_only)}  # fmt: skip


# --- both endpoints ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Streamed:
    """What a streamed response reads and fills: the engine's outputs as they come (prompt index, output),
    the per-choice text deltas, and each prompt's final outputs (which the usage chunk counts)."""

    outputs: AsyncIterator[tuple[int, RequestOutput]]
    tracker: DeltaTracker
    finals: list[list[RequestOutput]]


def _envelope(ctx: ServerContext, job: _Completion | _Chat, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": job.rid, "object": obj, "created": job.created, "model": ctx.model_name, "choices": choices}


def _chunk(ctx: ServerContext, job: _Completion | _Chat, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    chunk = _envelope(ctx, job, obj, choices)
    if job.req.include_usage:
        chunk["usage"] = None
    return chunk


async def _sse_events(
    ctx: ServerContext,
    job: _Completion | _Chat,
    obj: str,
    choices: AsyncIterator[dict[str, Any]],
    final_usage: Callable[[], dict[str, Any]],
) -> AsyncIterator[str]:
    """The one event loop of both endpoints: a chunk per choice, then (if asked) the usage chunk, an error
    event if the engine fails, and `data: [DONE]`."""
    try:
        async for choice in choices:
            yield sse(_chunk(ctx, job, obj, [choice]))
        if job.req.include_usage:
            yield sse({**_chunk(ctx, job, obj, []), "usage": final_usage()})
    except PagedKVError as err:
        yield stream_error(err)
    yield "data: [DONE]\n\n"


# --- /v1/chat/completions -------------------------------------------------------------------------


@dataclass(slots=True)
class _Chat:
    req: ChatCompletionRequest
    ids: list[int]
    rid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


async def create_chat_completion(ctx: ServerContext, request: Request, body: bytes) -> Response:
    req = parse_body(ChatCompletionRequest, body)
    ctx.check_model(req.model)
    if req.max_tokens == 0:
        raise bad_request("max_tokens: must be >= 1", "max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    job = _Chat(req, ctx.chat_ids(req.messages))
    max_tokens = req.max_completion_tokens or req.max_tokens or ctx.default_max_tokens(len(job.ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    streams = submit(ctx.engine, [job.ids], [params], req.cache_salt)
    if req.stream:
        st = _Streamed(merged(streams), DeltaTracker.for_params(params), [[]])
        usage_of = functools.partial(usage, [job.ids], st.finals)  # read when the stream ends
        events = _sse_events(ctx, job, "chat.completion.chunk", _chat_deltas(ctx, job, st), usage_of)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        finals = await collect(streams, request)
    except ClientGone:
        return Response(status_code=499)
    check_finals(finals)
    choices = []
    for out in finals[0]:
        choices.append({
            "index": choice_index(0, out, req.n),
            "message": {"role": "assistant", "content": out.output_text or ""},
            "logprobs": ctx.chat_logprobs(out.logprobs or []) if req.logprobs else None,
            "finish_reason": out.finish_reason,
        })  # fmt: skip
    answer = {**_envelope(ctx, job, "chat.completion", choices), "usage": usage([job.ids], finals)}
    return JSONResponse({**answer, "system_fingerprint": None})


async def _chat_deltas(ctx: ServerContext, job: _Chat, st: _Streamed) -> AsyncIterator[dict[str, Any]]:
    """A streamed chat completion's choices: per choice the role first (as OpenAI does), then its deltas."""
    started: set[int] = set()
    async for _, out in st.outputs:
        index = choice_index(0, out, job.req.n)
        if index not in started:
            started.add(index)
            yield {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        delta, a, b = st.tracker.step(index, out)
        if out.finished:
            st.finals[0].append(out)
        elif not delta and a == b:
            continue
        logprobs = ctx.chat_logprobs((out.logprobs or [])[a:b]) if job.req.logprobs else None
        yield {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
               "finish_reason": out.finish_reason if out.finished else None}  # fmt: skip
