"""`build_app(client, ...)`: the FastAPI application of `pagedkv serve`.

    POST /v1/completions         OpenAI completions (stream or not)       needs the API key when one is set
    POST /v1/chat/completions    OpenAI chat completions (stream or not)  needs the API key when one is set
    GET  /v1/models              the served model and its max_model_len   needs the API key when one is set
    GET  /health                 200 while the engine loop runs, else 503
    GET  /metrics                Prometheus text format (pagedkv.serve.metrics)

The app is built around an `EngineClient` (`pagedkv.serve.engine_client`: an `AsyncEngine` the CLI or a test
constructs, or the Ray ingress's `RemoteEngine`), so it runs in-process anywhere an ASGI server does. With
`manage_engine=True` the app's lifespan starts the engine loop and shuts it down after the server has drained;
a host that manages the loop itself passes False.

Bodies are read by the app with a size cap (`max_body_bytes`: 413 beyond it, the rest of the body is read and
dropped so the client gets the answer) and parsed by `pagedkv.serve.bodies`; every error is an OpenAI body
(`pagedkv.serve.error_bodies`). Paths are exact: `/v1/models/` is an OpenAI 404 naming `/v1/models`, never
a redirect. `max_model_len` in `/v1/models` is what one completion can really hold: the model's positions
or the KV pool, whichever is smaller.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedkv.serve.engine_client import EngineClient
from pagedkv.serve.error_bodies import APIError, install_handlers, unavailable
from pagedkv.serve.lifecycle_routes import mount as mount_lifecycle
from pagedkv.serve.metrics import ServerMetrics
from pagedkv.serve.openai_api import ServerContext, create_chat_completion, create_completion

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024  # an oversized body is read and dropped up to this, then cut


def build_app(
    async_engine: EngineClient,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    manage_engine: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app over `async_engine` (see the module docstring)."""
    if async_engine.metrics is None:
        async_engine.metrics = ServerMetrics(model_name)
    metrics = async_engine.metrics
    tokenizer = copy.deepcopy(async_engine.tokenizer)  # the HTTP side's own: the engine thread decodes with its
    ctx = ServerContext(async_engine, model_name, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            async_engine.start()
        try:
            yield
        finally:
            ctx.close()
            if manage_engine:
                async_engine.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # fmt: skip
    app.state.context = ctx
    install_handlers(app)
    _openai_routes(app, ctx, _authorizer(api_key), max_body_bytes)
    _operations_routes(app, async_engine, metrics)
    # /pause, /sleep, /update_weights, ...; the Ray ingress's RemoteEngine broadcasts them to its replicas
    mount_lifecycle(app, async_engine, _authorizer(api_key))
    return app


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or incorrect API key (send Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")  # fmt: skip

    return authorize


def _openai_routes(app: FastAPI, ctx: ServerContext, authorize: Callable[[Request], None], max_body_bytes: int) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await create_completion(ctx, request, await read_body(request, max_body_bytes))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        return await create_chat_completion(ctx, request, await read_body(request, max_body_bytes))

    created = int(time.time())

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        card = {"id": ctx.model_name, "object": "model", "created": created, "owned_by": "pagedkv",
                "max_model_len": ctx.max_model_len, "weight_version": ctx.engine.weight_version}  # fmt: skip
        card.update(await ctx.engine.model_card())  # the Ray ingress: every replica's weight version
        return {"object": "list", "data": [card]}


def _operations_routes(app: FastAPI, async_engine: EngineClient, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return unavailable("the engine loop is not running").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 when it passes `limit` bytes (see the module docstring)."""
    declared = request.headers.get("content-length", "")
    chunks: list[bytes] = []
    size = 0
    too_big = declared.isdigit() and int(declared) > limit
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = True
        if too_big:
            if size > DISCARD_LIMIT_BYTES:
                break
            continue
        chunks.append(chunk)
    if too_big:
        raise APIError(413, f"the request body is larger than the server's limit of {limit} bytes (--max-body-bytes)",
                       code="request_too_large")  # fmt: skip
    return b"".join(chunks)
