"""What every API of the HTTP server shares: JSON and event-stream responses, the OpenAI error
body and the handlers that produce it, the API key check, and aborting work whose client left."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from srt.server.tokenizer_manager import Generation, ServerNotReady

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is there


class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class EventStream(StreamingResponse):
    """Server-sent events of a `Generation` sent before the response was made; the event
    generator and the generation are closed however the response ends, so that a
    disconnected client's sequences are aborted at once (those of a response whose events
    never started too)."""

    media_type = "text/event-stream"
    body_iterator: AsyncGenerator[bytes, None]

    def __init__(self, events: AsyncGenerator[bytes, None], generation: Generation) -> None:
        super().__init__(events)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.generation.close()


def error_body(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> OrjsonResponse:
    return OrjsonResponse(error_body(message, err_type, param, code), status_code=status)


# Line breaks that JSON leaves raw in strings, at which line readers that follow Python's
# str.splitlines (httpx's `aiter_lines`) cut an event in two: escaped, so that an event stays
# one line whatever text a model emits. Each byte sequence is that character's UTF-8 and
# nothing else's (a lead byte starts it).
_RAW_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying `payload` as JSON, on one line."""
    data = orjson.dumps(payload)
    for raw, escaped in _RAW_LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def sse(events: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[bytes, None]:
    """Encode events; a failure after the response has started becomes an error event, and
    the stream always ends with `[DONE]`."""
    try:
        async with aclosing(events):
            async for event in events:
                yield sse_event(event)
    except ServerNotReady as e:
        yield sse_event(error_body(str(e), "server_error", code="unavailable"))
    except ValueError as e:
        yield sse_event(
            error_body(str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
        )
    yield b"data: [DONE]\n\n"


def body_bytes(request: Request) -> int | None:
    """The request body's declared size (None: not declared, a chunked upload)."""
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work`, cancelling it (which aborts its sequences) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                logger.info("client went away; aborting %s", request.url.path)
                return Response(status_code=499)
        return task.result()
    finally:
        task.cancel()


def install_error_handlers(app: FastAPI) -> None:
    """Every error the API returns has OpenAI's body: {"error": {message, type, param, code}}."""

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if p != "body"]
        if err["type"] == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('ctx', {}).get('error')}")
        if loc:
            return error_response(400, f"{'.'.join(loc)}: {err['msg']}", param=loc[0])
        if err["type"] in ("model_attributes_type", "dict_type", "missing"):
            return error_response(
                400, "the request body must be a JSON object (Content-Type: application/json)"
            )
        return error_response(400, err["msg"].removeprefix("Value error, "))

    @app.exception_handler(ValueError)
    async def on_bad_request(_: Request, exc: ValueError) -> Response:
        return error_response(
            400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None)
        )

    @app.exception_handler(ServerNotReady)
    async def on_not_ready(_: Request, exc: ServerNotReady) -> Response:
        return error_response(503, str(exc), "server_error", code="unavailable")

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, exc: HTTPException) -> Response:
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), err_type)


class ApiKeyMiddleware:
    """With --api-key, every path but the open ones (/health) needs `Authorization: Bearer KEY`
    (the scheme in any case). Checked before anything reads the body, so that a client without
    the key learns nothing from a 400, and in front of /docs and /openapi.json too."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            scheme, token = get_authorization_scheme_param(
                Headers(scope=scope).get("authorization")
            )
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.key):
                response = error_response(
                    401,
                    "invalid or missing API key (Authorization: Bearer KEY)",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
