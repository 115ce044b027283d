"""The HTTP API: OpenAI-compatible completions and chat, SGLang's native /generate, and the
server's health, info, metrics and cache endpoints.

Bad input answers 400 with an OpenAI-style error body before anything reaches the scheduler.
Streams are server-sent events ending in `data: [DONE]`; a client that goes away mid-request
(streaming or not) aborts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Send

from srt.entrypoints.openai_protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    new_id,
    now,
    usage,
)
from srt.managers.tokenizer_manager import SeqResult, SeqUpdate, ServerNotReady, TokenizerManager
from srt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
Seqs = list[tuple[list[int], SamplingParams]]

_DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is there


class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class EventStream(StreamingResponse):
    """Server-sent events; the event generator is closed however the response ends, so that
    a disconnected client's sequences are aborted at once."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, err_type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> OrjsonResponse:
    return OrjsonResponse(error_body(message, err_type, param, code), status_code=status)


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Encode events; a failure after the response has started becomes an error event."""
    try:
        async with aclosing(events):
            async for event in events:
                yield _event(event)
    except ServerNotReady as e:
        yield _event(error_body(str(e), "server_error", code="unavailable"))
    except ValueError as e:
        yield _event(error_body(str(e)))
    yield b"data: [DONE]\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
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


def create_app(manager: TokenizerManager) -> FastAPI:
    app = FastAPI(title="srt", default_response_class=OrjsonResponse)

    # ---- errors --------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if p != "body"]
        if err["type"] == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('ctx', {}).get('error')}")
        if loc:
            return error_response(400, f"{'.'.join(loc)}: {err['msg']}", param=loc[0])
        if err["type"] in ("model_attributes_type", "dict_type", "missing"):
            return error_response(400, "the request body must be a JSON object "
                                       "(Content-Type: application/json)")
        return error_response(400, err["msg"].removeprefix("Value error, "))

    @app.exception_handler(ValueError)
    async def on_bad_request(_: Request, exc: ValueError) -> Response:
        return error_response(400, str(exc), param=getattr(exc, "param", None),
                              code=getattr(exc, "code", None))

    @app.exception_handler(ServerNotReady)
    async def on_not_ready(_: Request, exc: ServerNotReady) -> Response:
        return error_response(503, str(exc), "server_error", code="unavailable")

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, exc: HTTPException) -> Response:
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "invalid_api_key" if exc.status_code == 401 else None
        return error_response(exc.status_code, str(exc.detail), err_type, code=code)

    # ---- helpers -------------------------------------------------------------------------

    async def check_api_key(request: Request) -> None:
        key = manager.args.api_key
        given = request.headers.get("authorization", "")
        if key and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HTTPException(401, "invalid or missing API key (Authorization: Bearer KEY)")

    def check_model(name: str | None) -> None:
        if name is not None and name != manager.model_name:
            raise BadRequest(f"the model {name!r} does not exist; this server serves "
                             f"{manager.model_name!r}", param="model", code="model_not_found")

    def tokenize(prompt: str | list[int]) -> list[int]:
        return manager.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def prepared(seqs: Seqs) -> Seqs:
        for ids, params in seqs:
            manager.validate(ids, params)
        return seqs

    api = APIRouter(dependencies=[Depends(check_api_key)])

    # ---- server endpoints ----------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if manager.ready:
            return OrjsonResponse({"status": "ok"})
        return OrjsonResponse({"status": manager.failure or "starting"}, status_code=503)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": manager.model_name, "object": "model", "owned_by": "srt",
            "created": int(manager.startup.get("ready_at", 0)),
            "max_model_len": manager.context_length,
        }]}

    @api.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        info = await manager.get_info()
        args = dataclasses.asdict(manager.args)
        if args["api_key"]:
            args["api_key"] = "<redacted>"
        cfg = manager.model_config
        return {
            "server_args": args,
            "model": {"name": manager.model_name, "path": str(cfg.path),
                      "architecture": cfg.architecture, "num_layers": cfg.num_layers,
                      "vocab_size": cfg.vocab_size, "context_length": manager.context_length},
            **manager.startup,
            "runner": info.runner,
            "graphs": info.runner["graphs"],
            "compile": info.runner["compile"],
            "scheduler": info.scheduler,
        }

    @api.get("/metrics")
    async def metrics() -> Response:
        info = await manager.get_info()
        body = manager.metrics.render(info.scheduler, info.runner,
                                      manager.startup.get("startup_s", 0.0))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @api.post("/flush_cache")
    async def flush_cache() -> Response:
        if await manager.flush_cache():
            return OrjsonResponse({"success": True})
        return error_response(400, "cannot flush the cache while requests are in flight")

    # ---- SGLang's /generate --------------------------------------------------------------

    def native(r: SeqResult) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "finish_reason": r.finish_reason, "matched_stop": r.matched_stop,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "cached_tokens": r.cached_tokens,
        }
        if r.logprobs:
            meta["output_token_logprobs"] = [[lp, t] for lp, t in
                                             zip(r.logprobs, r.token_ids, strict=True)]
        if r.top_logprobs:
            meta["output_top_logprobs"] = [[[v, t] for t, v in row] for row in r.top_logprobs]
        return {"index": r.index, "text": r.text, "output_ids": r.token_ids, "meta_info": meta}

    async def native_events(seqs: Seqs) -> AsyncIterator[dict[str, Any]]:
        # SGLang streams each sequence's text and ids so far, not deltas.
        results = [SeqResult(i) for i in range(len(seqs))]
        async with aclosing(manager.generate(seqs)) as updates:
            async for u in updates:
                results[u.index].add(u)
                yield native(results[u.index])

    @api.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        single, prompts = req.batch()
        seqs = prepared([(tokenize(p), params) for p, params in
                         zip(prompts, req.params_for(len(prompts)), strict=True)])
        if req.stream:
            return EventStream(_sse(native_events(seqs)))
        results = await _unless_disconnected(request, manager.generate_all(seqs))
        if isinstance(results, Response):
            return results
        out = [native(r) for r in results]
        return out[0] if single else out

    # ---- OpenAI /v1/completions ----------------------------------------------------------

    def completion_choice(u: SeqUpdate | SeqResult, top: int | None, offset: int
                          ) -> dict[str, Any]:
        lp = None
        if top is not None:
            lp = completion_logprobs(u.token_ids, u.logprobs, u.top_logprobs,
                                     manager.token_text, offset)
        return {"index": u.index, "text": u.text, "logprobs": lp,
                "finish_reason": finish_reason(u.finish_reason)}

    async def completion_events(seqs: Seqs, prompt_tokens: int, req: CompletionRequest
                                ) -> AsyncIterator[dict[str, Any]]:
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                "model": manager.model_name}
        offsets = [0] * len(seqs)
        completion_tokens = [0] * len(seqs)
        async with aclosing(manager.generate(seqs)) as updates:
            async for u in updates:
                completion_tokens[u.index] = u.completion_tokens
                if not (u.text or u.finish_reason or (req.logprobs is not None and u.token_ids)):
                    continue  # text held back (a partial character or a possible stop string)
                choice = completion_choice(u, req.logprobs, offsets[u.index])
                if choice["logprobs"]:
                    offsets[u.index] += sum(map(len, choice["logprobs"]["tokens"]))
                yield {**head, "choices": [choice], "usage": None}
        if req.include_usage:
            yield {**head, "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens))}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        prompts = [tokenize(p) for p in req.prompts()]
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        seqs = prepared([(ids, req.sampling_params(max_tokens, req.logprobs, i))
                         for ids in prompts for i in range(req.num_choices)])
        prompt_tokens = sum(map(len, prompts))
        if req.stream:
            return EventStream(_sse(completion_events(seqs, prompt_tokens, req)))
        results = await _unless_disconnected(request, manager.generate_all(seqs))
        if isinstance(results, Response):
            return results
        return {
            "id": new_id("cmpl"), "object": "text_completion", "created": now(),
            "model": manager.model_name,
            "choices": [completion_choice(r, req.logprobs, 0) for r in results],
            "usage": usage(prompt_tokens, sum(r.completion_tokens for r in results)),
        }

    # ---- OpenAI /v1/chat/completions -----------------------------------------------------

    def chat_lp(u: SeqUpdate | SeqResult, top: int | None) -> dict[str, Any] | None:
        if top is None:
            return None
        return chat_logprobs(u.token_ids, u.logprobs, u.top_logprobs, manager.token_text)

    async def chat_events(seqs: Seqs, prompt_tokens: int, req: ChatCompletionRequest,
                          top: int | None) -> AsyncIterator[dict[str, Any]]:
        head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": now(),
                "model": manager.model_name}
        for i in range(len(seqs)):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], "usage": None}
        completion_tokens = [0] * len(seqs)
        async with aclosing(manager.generate(seqs)) as updates:
            async for u in updates:
                completion_tokens[u.index] = u.completion_tokens
                if not (u.text or u.finish_reason or (top is not None and u.token_ids)):
                    continue
                yield {**head, "usage": None, "choices": [{
                    "index": u.index, "delta": {"content": u.text} if u.text else {},
                    "logprobs": chat_lp(u, top), "finish_reason": finish_reason(u.finish_reason),
                }]}
        if req.include_usage:
            yield {**head, "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens))}

    @api.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        ids = manager.apply_chat_template([m.for_template() for m in req.messages])
        max_tokens = req.max_new_tokens
        if max_tokens is None:  # as much as the context leaves
            max_tokens = max(manager.context_length - len(ids), 0)
        top = req.top_logprobs_num
        seqs = prepared([(ids, req.sampling_params(max_tokens, top, i))
                         for i in range(req.num_choices)])
        if req.stream:
            return EventStream(_sse(chat_events(seqs, len(ids), req, top)))
        results = await _unless_disconnected(request, manager.generate_all(seqs))
        if isinstance(results, Response):
            return results
        return {
            "id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
            "model": manager.model_name,
            "choices": [{"index": r.index, "message": {"role": "assistant", "content": r.text},
                         "logprobs": chat_lp(r, top),
                         "finish_reason": finish_reason(r.finish_reason)} for r in results],
            "usage": usage(len(ids), sum(r.completion_tokens for r in results)),
        }

    app.include_router(api)
    return app
