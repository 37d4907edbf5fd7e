"""`EngineClient`: everything the HTTP layer (`app`, `openai_api`, `fanout`, `lifecycle_routes`) may ask of
the engine behind it, and `ModelFacts`, the served model's fixed sizes.

Three implementations: `pagedkv.serve.async_engine.AsyncEngine` (one engine on a thread of the server's
process), `pagedkv.serve.engine_process.ProcessEngine` (one engine in a process of its own, `pagedkv serve
--engine-process`) and the Ray ingress's `pagedkv.serve.ray_ingress.RemoteEngine` (N replicas behind a handle). The routes never reach
past this interface to an `Engine`: what they read of the model is `model_facts`, what they change goes
through `add_request` / a stream's `abort` / `run_verb`.

Contracts:

- `check_requests` raises what `add_request` would raise for bad input (`InvalidArgumentError`,
  `CapacityError`) and queues nothing; a client that checks on another machine (the Ray replicas) does
  nothing here;
- `add_request` raises at once (bad input, overloaded, paused, stopped) or returns a stream that yields each
  completion's snapshots and ends after its finished output; `abort()` on the stream ends the request;
- `run_verb(verb, args)` runs a lifecycle verb (`pagedkv.serve.lifecycle_routes.VERBS`) and answers its JSON
  body, or raises `APIError`;
- `model_card()` is the extra `/v1/models` fields of this client (the Ray ingress: every replica's weight
  version).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.serve.metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The served model's fixed sizes: `block_size` tokens per KV block, `capacity_tokens` the KV pool holds,
    `max_positions` the model's positions (None when unbounded)."""

    block_size: int
    capacity_tokens: int
    max_positions: int | None


class EngineStream(Protocol):
    """One request's outputs as they come (see the module docstring)."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


class EngineClient(Protocol):
    """What the HTTP layer needs of an engine (see the module docstring)."""

    metrics: ServerMetrics | None

    @property
    def tokenizer(self) -> Any: ...

    @property
    def alive(self) -> bool: ...

    @property
    def weight_version(self) -> str: ...

    @property
    def model_facts(self) -> ModelFacts: ...

    def start(self) -> None: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...

    def check_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], cache_salt: str | None
    ) -> None: ...

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        group_id: str | None = None,
    ) -> EngineStream: ...

    async def run_verb(self, verb: str, args: dict[str, Any]) -> dict[str, Any]: ...

    async def model_card(self) -> dict[str, Any]: ...
