"""The OpenAI request bodies the server accepts, checked strictly, and their mapping onto `SamplingParams`.

Bodies are parsed by pydantic in strict JSON mode: a wrong type is refused, never coerced (`"n": "2"`,
`"max_tokens": 2.5`), and the 400 names the field (`param`, e.g. `messages.0.content`). Unknown fields are
ignored (clients send extras); fields the engine cannot honour (penalties, logit_bias, suffix, best_of other
than n) are refused by name rather than silently dropped.

Extensions beyond OpenAI, as vLLM spells them: `top_k` (0 or -1 = off), `ignore_eos`, `cache_salt` (isolates
the request's prefix-cache entries: see docs/engine.md, "Tenants"). pagedkv's own: `group_id` (a non-empty
string: requests of one group with the same prompt prefill it once, as RL trainers send a prompt's samples as
separate n=1 requests; `pagedkv.engine.groups`, docs/rl.md).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.engine.params import MAX_LOGPROBS, SamplingParams
from pagedkv.serve.error_bodies import APIError, bad_request

MAX_N = 128
MAX_STOP = 16
MAX_GROUP_ID = 256  # characters

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _Body(BaseModel):
    # cache_strings="keys": prompts are not kept in pydantic-core's JSON string cache (a long-lived server's RSS)
    model_config = ConfigDict(strict=True, extra="ignore", cache_strings="keys")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields common to both endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    group_id: str | None = Field(default=None, min_length=1, max_length=MAX_GROUP_ID)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or not all(stops):
            raise bad_request(f"stop: give at most {MAX_STOP} non-empty strings", "stop")
        return tuple(stops)

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise bad_request(f"{name} is not supported by pagedkv (only 0)", name, "unsupported_parameter")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by pagedkv", "logit_bias", "unsupported_parameter")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(model: type[BodyT], body: bytes) -> BodyT:
    """The body as `model`, or a 400 naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first.get("type") == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {first.get('msg')}", None, "invalid_json") from None
        loc, union = _field_path(first.get("loc", ()))
        msg = f"not one of the accepted forms ({first.get('msg')})" if union else first.get("msg")
        what = f"{loc}: " if loc else ""
        raise bad_request(f"{what}{msg} (got {_short(first.get('input'))})", loc or None) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


def _field_path(loc: Any) -> tuple[str, bool]:
    """(`('prompt', 'list[int]', 0)` -> `prompt`, True): the path up to the first union member name pydantic
    inserts (the member tells which form failed, not which field), and whether there was one."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part.startswith("function")):
            return ".".join(parts), True
        parts.append(str(part))
    return ".".join(parts), False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def sampling_params(
    req: _Sampling, *, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """The engine's parameters for one prompt of `req` (OpenAI's defaults: temperature 1, top_p 1)."""
    req.refuse_unsupported()
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=top_k,
            seed=req.seed,
            n=req.n,
            stop=req.stop_strings(),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidArgumentError as err:
        raise bad_request(str(err), _param_of(str(err))) from None


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    return {"max_new_tokens": "max_tokens"}.get(first, first) if first.isidentifier() else None


def engine_refusal(err: Exception) -> APIError:
    """A 400 for a request the engine's door refused (its message names the limit or the field); the
    engine's internal request id is left out."""
    text = re.sub(r"^request '?[\w.-]+'?:? ", "this request ", str(err))
    if "can never" in text or "positions" in text:
        return bad_request(text, None, "context_length_exceeded")
    param = "prompt" if "prompt" in text else None
    return bad_request(text, param)
