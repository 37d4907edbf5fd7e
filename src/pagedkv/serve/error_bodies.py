"""OpenAI-shaped errors: every failure the server answers is `{"error": {"message", "type", "param", "code"}}`.

| status | when                                                           | type                  | code                     |
|--------|----------------------------------------------------------------|-----------------------|--------------------------|
| 400    | malformed JSON, a missing / wrongly typed / out-of-range field | invalid_request_error | invalid_value etc.       |
| 400    | a prompt (+ max_tokens) that can never fit the KV pool or the model's positions | invalid_request_error | context_length_exceeded |
| 401    | a missing or wrong API key (`--api-key`)                       | authentication_error  | invalid_api_key          |
| 404    | an unknown model, or path                                      | invalid_request_error | model_not_found          |
| 413    | a body above `--max-body-bytes`                                | invalid_request_error | request_too_large        |
| 429    | more than `--max-waiting` requests wait (with `Retry-After`)   | rate_limit_error      | rate_limit_exceeded      |
| 503    | the engine loop is not running, or the server is draining      | server_error          | engine_unavailable       |
| 500    | a bug: logged with its traceback, answered with a typed body   | server_error          | internal_error           |

A client that disconnects while sending its body (starlette's `ClientDisconnect`) is no error of the server's:
one info line, no traceback, and no answer (nobody is left to read it).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with the OpenAI body; raise it from a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error(message: str = "internal server error") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


def install_handlers(app: FastAPI) -> None:
    """Every error the app can meet leaves it as an OpenAI body (unknown paths and methods included)."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, APIError):  # registered for APIError only
            raise exc
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        status = int(getattr(exc, "status_code", 500))
        detail = str(getattr(exc, "detail", "")) or "error"
        code = "not_found" if status == 404 else None
        path = request.url.path
        if status == 404:
            detail = f"{detail}: no route {path}"
            if path.endswith("/") and path != "/":
                detail += f" (paths have no trailing slash: {path.rstrip('/')})"
        return APIError(status, detail, code=code).response()

    async def on_disconnect(request: Request, _: Exception) -> Response:
        logger.info("client disconnected while sending its body (%s %s)", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it: uvicorn drops answers to a gone client

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        return bad_request(f"invalid request: {exc}").response()

    async def on_anything(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in a request handler", exc_info=exc)
        return internal_error(f"internal server error ({type(exc).__name__}); the server logged it").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_anything)
