"""POST /v1/completions and /v1/chat/completions: OpenAI request in, OpenAI response (or SSE stream) out.

Each handler: parse the body strictly (`bodies`), check the model, encode the prompts (the chat template for
chat), map the fields onto `SamplingParams`, submit every prompt at once (`fanout.submit`: 400 / 429 / 503
before anything runs), then either wait for the ends (aborting if the client leaves) or stream
`data: {chunk}` events and `data: [DONE]` through starlette's `StreamingResponse`.

Tokenizing (and the chat template) runs on the context's one tokenizer thread, never on the event loop, so a
large prompt never delays another request or `/health`; a text longer than `max_prompt_chars` (the longest
the model could hold: `max_model_len` tokens of the vocabulary's longest token) is refused before it is
tokenized, with the 400 the token check gives. The tokenizer thread owns its tokenizer copy (a fast
tokenizer is not safe to share between threads); the event loop decodes single tokens with another.

A streamed response needs chunked transfer encoding, which HTTP/1.0 does not have: `stream: true` over
HTTP/1.0 is a 400 (`unsupported_http_version`); non-streamed answers carry a content-length and are served.

`echo` with `max_tokens: 0` (the scoring call of evaluation harnesses) runs the prompt for one token, which
is dropped: the answer holds the prompt's text and, with `logprobs`, its tokens' log-probabilities (the first
token's is null, as OpenAI's).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.core.errors import PagedKVError
from pagedkv.engine.outputs import RequestOutput, TokenLogprobs
from pagedkv.serve.bodies import ChatCompletionRequest, CompletionRequest, parse_body, sampling_params
from pagedkv.serve.engine_client import EngineClient
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
    """What the handlers need: the engine, the served model's name, the server's own tokenizer copies (one
    for the tokenizer thread, one for single-token decodes on the event loop) and the thread itself."""

    engine: EngineClient
    model_name: str
    tokenizer: Any
    _token_text: dict[int, str] = field(default_factory=dict)
    _loop_tokenizer: Any = None
    _tokenizer_thread: ThreadPoolExecutor | None = None
    longest_token_chars: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            self._loop_tokenizer = copy.deepcopy(self.tokenizer)
            self.longest_token_chars = _longest_token_chars(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + output tokens) one completion can have: the model's positions or
        the KV pool, whichever is smaller (what `/v1/models` advertises)."""
        facts = self.engine.model_facts
        capacity = facts.capacity_tokens
        return capacity if facts.max_positions is None else min(capacity, facts.max_positions)

    @property
    def max_prompt_chars(self) -> int | None:
        """Texts longer than this cannot fit in `max_model_len` tokens; None without a tokenizer."""
        return None if self.longest_token_chars is None else self.max_model_len * self.longest_token_chars

    async def tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the tokenizer thread (one thread: the tokenizer copy there is never shared)."""
        if self._tokenizer_thread is None:
            self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer thread (the app's lifespan calls this at shutdown)."""
        if self._tokenizer_thread is not None:
            self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_thread = None

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")  # fmt: skip

    def check_text_length(self, num_chars: int, param: str) -> None:
        """The token check's 400, before tokenizing, for a text too long to fit in any case."""
        bound = self.max_prompt_chars
        if bound is None or num_chars <= bound:
            return
        limit = self.max_model_len
        max_positions = self.engine.model_facts.max_positions
        if max_positions is not None and max_positions <= limit:
            what = f"exceeds the model's {max_positions} positions"
        else:
            block_size = self.engine.model_facts.block_size
            what = (f"can never fit: the cache holds {limit} tokens ({limit // block_size} blocks of {block_size}); "
                    "raise --kv-budget or shorten it")  # fmt: skip
        raise bad_request(
            f"this request: {param} has {num_chars} characters, more than {limit} tokens of at most "
            f"{self.longest_token_chars} characters each: it {what}",
            None,
            "context_length_exceeded",
        )

    async def encode(self, texts: Sequence[str], param: str) -> list[list[int]]:
        """Token ids of each text (`param`, or `param.i` for a list), on the tokenizer thread."""
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: send token ids", param)
        names = [param] if len(texts) == 1 else [f"{param}.{i}" for i in range(len(texts))]
        for name, text in zip(names, texts):
            self.check_text_length(len(text), name)
        lists: list[list[int]] = await self.tokenize(self._encode_all, texts)
        for name, ids in zip(names, lists):
            if not ids:
                raise bad_request(f"{name}: the prompt is empty (no tokens)", name)
        return lists

    def _encode_all(self, texts: Sequence[str]) -> list[list[int]]:
        return [[int(t) for t in self.tokenizer(text)["input_ids"]] for text in texts]

    async def chat_ids(self, messages: Sequence[Any]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        inputs = [m.as_template_input() for m in messages]
        self.check_text_length(sum(len(m["content"]) for m in inputs), "messages")  # the template only adds
        ids: list[int] = await self.tokenize(self._apply_template, inputs)
        return ids

    def _apply_template(self, inputs: list[dict[str, Any]]) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(inputs, add_generation_prompt=True, tokenize=True)
        except Exception as err:  # the template refused these messages (roles, order): the client's input
            raise bad_request(f"messages: the chat template refused them ({err})", "messages") from None
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]

    async def decode_all(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """The texts of token-id prompts (echo), on the tokenizer thread."""
        if self.tokenizer is None:
            return ["" for _ in prompts]
        texts: list[str] = await self.tokenize(lambda: [str(self.tokenizer.decode(list(p))) for p in prompts])
        return texts

    def text_of(self, token_id: int) -> str:
        """One token's text (bounded by the vocabulary)."""
        text = self._token_text.get(token_id)
        if text is None:
            tok = self._loop_tokenizer
            text = str(tok.decode([token_id])) if tok is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    def default_max_tokens(self, num_prompt: int) -> int:
        """Chat without max_tokens: what the positions and the KV pool leave (at least 1)."""
        facts = self.engine.model_facts
        capacity = facts.capacity_tokens - facts.block_size
        limit = capacity if facts.max_positions is None else min(capacity, facts.max_positions)
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


def _longest_token_chars(tokenizer: Any) -> int | None:
    """The vocabulary's longest token in characters, as the vocabulary spells it: at least as long as its
    text (byte-level BPE spells each byte with one character, SentencePiece's word marker stands for the
    space; added and special tokens are spelled as they are written). None if the vocabulary is unknown."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a readable vocabulary: no bound, the token check still holds
        return None
    return max((len(str(t)) for t in vocab), default=0) or None


def check_stream_transport(request: Request, stream: bool) -> None:
    """A stream needs chunked transfer encoding: refused over HTTP/1.0, which has none (uvicorn would frame
    it chunked anyway, which an HTTP/1.0 client cannot read)."""
    if stream and request.scope.get("http_version") == "1.0":
        raise bad_request(
            "stream: a streamed answer needs HTTP/1.1 (chunked transfer encoding) and this request came over "
            "HTTP/1.0: send it over HTTP/1.1, or with stream: false",
            "stream",
            "unsupported_http_version",
        )


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


async def _completion_prompts(ctx: ServerContext, prompt: Any) -> tuple[list[str], list[list[int]]]:
    if isinstance(prompt, str):
        return [prompt], await ctx.encode([prompt], "prompt")
    if not prompt:
        raise bad_request("prompt: give a string, a list of strings, a list of token ids or a list of such lists", "prompt")
    if isinstance(prompt[0], str):
        return list(prompt), await ctx.encode(list(prompt), "prompt")
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
    check_stream_transport(request, req.stream)
    texts, ids = await _completion_prompts(ctx, req.prompt)
    job = _Completion(req, texts, ids, echo_only=req.echo and req.max_tokens == 0)
    max_tokens = 1 if job.echo_only else (req.max_tokens or DEFAULT_COMPLETION_TOKENS)
    scoring = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=scoring)
    streams = submit(ctx.engine, ids, [params] * len(ids), req.cache_salt, req.group_id)
    if not texts and req.echo:
        try:
            job.texts = await ctx.decode_all(ids)
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
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
    check_stream_transport(request, req.stream)
    job = _Chat(req, await ctx.chat_ids(req.messages))
    max_tokens = req.max_completion_tokens or req.max_tokens or ctx.default_max_tokens(len(job.ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    streams = submit(ctx.engine, [job.ids], [params], req.cache_salt, req.group_id)
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
