"""The HTTP app: OpenAI's API, SGLang's native /generate and the server's own endpoints, each a
router of its own module, on one set of error handlers.

Bad input answers 400 with an OpenAI-style error body before anything reaches the scheduler;
a body over --max-request-bytes answers 413 without being read. Streams are server-sent events
ending in `data: [DONE]`; a client that goes away mid-request (streaming or not) aborts it.
"""

from __future__ import annotations

from fastapi import FastAPI

from srt.server.http.common import ApiKeyMiddleware, OrjsonResponse, install_error_handlers
from srt.server.http.native_api import native_router
from srt.server.http.openai_api import openai_router
from srt.server.http.server_api import HEALTH_PATH, server_router
from srt.server.tokenizer_manager import TokenizerManager


def create_app(manager: TokenizerManager) -> FastAPI:
    args = manager.args
    app = FastAPI(
        title="srt", default_response_class=OrjsonResponse, max_body_size=args.max_request_bytes
    )
    install_error_handlers(app)
    for router in (server_router(manager), native_router(manager), openai_router(manager)):
        app.include_router(router)
    if args.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=args.api_key, open_paths=frozenset({HEALTH_PATH})
        )
    return app
