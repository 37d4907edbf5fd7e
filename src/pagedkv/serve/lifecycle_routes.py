"""The RL lifecycle over HTTP: `mount(app, client, authorize)` adds these routes to `pagedkv serve`.

    POST /pause?mode=abort|wait|keep   refuse new requests (503); abort / finish / park those in flight
                                       (wait answers once they have finished)
    POST /resume                       take requests again; parked ones go on
    POST /sleep?level=1|2              release the KV memory (1) and the weights too (2); the report
    POST /wake_up                      take it back; the report
    POST /update_weights               {"path": a folder of safetensors on the server's disk, "version": ...,
                                       "flush_cache": true}; the report
    POST /reset_prefix_cache           forget every cached prefix (device, host and disk tiers)
    GET  /lifecycle                    {"weight_version", "paused", "sleep_level", "num_parked"}

Each verb runs on the engine thread between two steps (`AsyncEngine.call`) and needs the API key when one
is set. A verb the engine's state refuses (sleep with requests in flight, wake_up while awake) is a 409; a
bad argument a 400. Every response of the server carries the weight version in force in the header
`x-pagedkv-weight-version` (and `/v1/models` in its card): a client learns which weights answered it.
The semantics are the engine's (`pagedkv.engine.lifecycle`); docs/rl.md says how trainers drive them.
`apply_verb` is one verb on one engine, answering the JSON body; the Ray ingress (`pagedkv.serve.ray_ingress`)
mounts the same routes over a broadcast that runs `apply_verb` on every replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedkv.core.errors import EngineStateError, InvalidArgumentError, NotSupportedError
from pagedkv.serve.engine_client import EngineClient
from pagedkv.serve.error_bodies import APIError, bad_request

WEIGHT_VERSION_HEADER = "x-pagedkv-weight-version"
WAIT_POLL_S = 0.02

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


Verbs = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class EngineCaller(Protocol):
    """What `apply_verb` runs the verbs with: `call(fn)` runs `fn(engine)` on the engine's thread
    (`pagedkv.serve.async_engine.AsyncEngine.call`)."""

    async def call(self, fn: Callable[[Any], Any]) -> Any: ...
VERBS = ("pause", "resume", "sleep", "wake_up", "update_weights", "reset_prefix_cache", "lifecycle")


def mount(app: FastAPI, client: EngineClient, authorize: Callable[[Request], None]) -> None:
    """Add the lifecycle routes and the weight-version header to `app` (see the module docstring). Each verb
    is `client.run_verb` (an `AsyncEngine` runs `apply_verb`; the Ray ingress broadcasts to every replica)."""
    app.add_middleware(_VersionHeader, async_engine=client)
    run: Verbs = client.run_verb

    @app.post("/pause")
    async def pause(request: Request, mode: str = "abort") -> JSONResponse:
        authorize(request)
        return JSONResponse(await run("pause", {"mode": mode}))

    @app.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(await run("resume", {}))

    @app.get("/lifecycle")
    async def lifecycle(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(await run("lifecycle", {}))

    @app.post("/sleep")
    async def sleep(request: Request, level: int = 1) -> JSONResponse:
        authorize(request)
        return JSONResponse(await run("sleep", {"level": level}))

    @app.post("/wake_up")
    async def wake_up(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(await run("wake_up", {}))

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        authorize(request)
        path, version, flush = _update_body(await request.body())
        return JSONResponse(
            await run("update_weights", {"path": path, "version": version, "flush_cache": flush})
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(await run("reset_prefix_cache", {}))


async def apply_verb(async_engine: EngineCaller, verb: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one lifecycle verb (`VERBS`) with its arguments on `async_engine`'s thread and answer its JSON body:
    the engine's report plus the state. A refusal of the engine's state is an `APIError` 409, a bad argument
    a 400."""

    async def run(fn: Callable[[Any], Any]) -> Any:
        try:
            return await async_engine.call(fn)
        except EngineStateError as err:
            raise APIError(409, str(err), code="engine_state") from None
        except (InvalidArgumentError, NotSupportedError) as err:
            raise bad_request(str(err)) from None

    async def state() -> dict[str, Any]:
        return dict(await async_engine.call(lambda e: e.lifecycle.state()))

    async def answer(result: Any) -> dict[str, Any]:
        body = (
            dataclasses.asdict(result)
            if dataclasses.is_dataclass(result) and not isinstance(result, type)
            else {}
        )
        return {**await state(), **body}  # the report wins: its num_parked is what the verb parked

    async def pause() -> dict[str, Any]:
        mode = args.get("mode", "abort")
        aborted = await run(lambda e: e.pause(mode))
        if mode == "wait":
            while await async_engine.call(lambda e: e.has_unfinished()):
                await asyncio.sleep(WAIT_POLL_S)
        return {"aborted": aborted, **await state()}

    async def update() -> dict[str, Any]:
        path, version, flush = args["path"], args.get("version"), args.get("flush_cache", True)
        return await answer(await run(lambda e: e.update_weights(path, version, flush_cache=flush)))

    async def reset() -> dict[str, Any]:
        return {"num_keys_dropped": await run(lambda e: e.reset_prefix_cache())}

    verbs: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "pause": pause, "update_weights": update, "reset_prefix_cache": reset, "lifecycle": state,
        "resume": lambda: _then(run(lambda e: e.resume()), answer),
        "sleep": lambda: _then(run(lambda e: e.sleep(args.get("level", 1))), answer),
        "wake_up": lambda: _then(run(lambda e: e.wake_up()), answer),
    }  # fmt: skip
    if verb in verbs:
        return await verbs[verb]()
    raise bad_request(f"unknown lifecycle verb {verb!r}; one of {', '.join(VERBS)}")


async def _then(first: Awaitable[Any], then: Callable[[Any], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    return await then(await first)


def _update_body(raw: bytes) -> tuple[str, str | int | None, bool]:
    """(path, version, flush_cache) of an /update_weights body; SGLang's `model_path` is taken for `path`."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise bad_request('the body must be JSON: {"path": "/a/folder", "version": "7"}') from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    path = body.get("path", body.get("model_path"))
    if not isinstance(path, str) or not path:
        raise bad_request(
            "path: a folder of .safetensors files on the server's disk is required", param="path"
        )
    version = body.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, str | int)):
        raise bad_request("version must be a string or an integer", param="version")
    flush = body.get("flush_cache", True)
    if not isinstance(flush, bool):
        raise bad_request("flush_cache must be true or false", param="flush_cache")
    return path, version, flush


class _VersionHeader:
    """ASGI middleware: the weight version in force on every HTTP response (streams included)."""

    def __init__(self, app: ASGIApp, async_engine: EngineClient) -> None:
        self.app = app
        self.async_engine = async_engine

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                version = self.async_engine.weight_version.encode("latin-1", "replace")
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (WEIGHT_VERSION_HEADER.encode(), version)],
                }
            await send(message)

        await self.app(scope, receive, send_with_version)
