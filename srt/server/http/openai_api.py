"""OpenAI's API: /v1/models, /v1/completions and /v1/chat/completions (streaming or not, `n`
choices, logprobs), on the shared request front end."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.errors import InvalidRequest
from srt.server.http.common import EventStream, body_bytes, sse, unless_disconnected
from srt.server.http.openai_protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    new_id,
    now,
    usage,
)
from srt.server.seq_outputs import SeqResult, SeqUpdate
from srt.server.tokenizer_manager import Generation, TokenizerManager


class OpenAIRoutes:
    """The handlers of one server's OpenAI endpoints."""

    def __init__(self, manager: TokenizerManager) -> None:
        self.manager = manager

    def check_model(self, name: str | None) -> None:
        served = self.manager.model_name
        if name is not None and name != served:
            raise InvalidRequest(
                f"the model {name!r} does not exist; this server serves {served!r}",
                param="model",
                code="model_not_found",
            )

    def head(self, prefix: str, kind: str) -> dict[str, Any]:
        """What every response object and stream chunk of one request starts with."""
        return {
            "id": new_id(prefix),
            "object": kind,
            "created": now(),
            "model": self.manager.model_name,
        }

    async def models(self) -> dict[str, Any]:
        manager = self.manager
        manager.check_ready()  # its max_model_len is known once the runner is
        return {
            "object": "list",
            "data": [
                {
                    "id": manager.model_name,
                    "object": "model",
                    "owned_by": "srt",
                    "created": int(manager.startup.ready_at if manager.startup else 0),
                    "max_model_len": manager.context_length,
                }
            ],
        }

    # ---- /v1/completions -----------------------------------------------------------------

    def completion_choice(
        self, u: SeqUpdate | SeqResult, top: int | None, offset: int
    ) -> dict[str, Any]:
        lp = None
        if top is not None:
            lp = completion_logprobs(
                u.token_ids, u.logprobs, u.top_logprobs, self.manager.token_text, offset
            )
        return {
            "index": u.index,
            "text": u.text,
            "logprobs": lp,
            "finish_reason": finish_reason(u.finish_reason),
        }

    async def completion_events(
        self, generation: Generation, prompt_tokens: int, req: CompletionRequest
    ) -> AsyncGenerator[dict[str, Any], None]:
        head = self.head("cmpl", "text_completion")
        offsets = [0] * len(generation.rids)
        completion_tokens = [0] * len(generation.rids)
        async with aclosing(generation.updates()) as updates:
            async for u in updates:
                completion_tokens[u.index] = u.completion_tokens
                if not (u.text or u.finish_reason or (req.logprobs is not None and u.token_ids)):
                    continue  # text held back (a partial character or a possible stop string)
                choice = self.completion_choice(u, req.logprobs, offsets[u.index])
                if choice["logprobs"]:
                    offsets[u.index] += sum(map(len, choice["logprobs"]["tokens"]))
                yield {**head, "choices": [choice], "usage": None}
        if req.include_usage:
            yield {**head, "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens))}

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        self.check_model(req.model)
        prompts, params = req.prompts(), req.sampling_params()
        seqs = await self.manager.prepare(
            lambda frontend: frontend.seqs(
                prompts, [params] * len(prompts), req.n, COMPLETION_DEFAULT_MAX_TOKENS, req.names
            ),
            body_bytes(request),
        )
        prompt_tokens = sum(len(s.input_ids) for s in seqs[:: req.n])
        if req.stream:
            generation = self.manager.submit(seqs)  # the scheduler starts meanwhile
            return EventStream(
                sse(self.completion_events(generation, prompt_tokens, req)), generation
            )
        results = await unless_disconnected(request, self.manager.generate_all(seqs))
        if isinstance(results, Response):
            return results
        return {
            **self.head("cmpl", "text_completion"),
            "choices": [self.completion_choice(r, req.logprobs, 0) for r in results],
            "usage": usage(prompt_tokens, sum(r.completion_tokens for r in results)),
        }

    # ---- /v1/chat/completions ------------------------------------------------------------

    def chat_lp(self, u: SeqUpdate | SeqResult, top: int | None) -> dict[str, Any] | None:
        if top is None:
            return None
        return chat_logprobs(u.token_ids, u.logprobs, u.top_logprobs, self.manager.token_text)

    async def chat_events(
        self, generation: Generation, prompt_tokens: int, req: ChatCompletionRequest
    ) -> AsyncGenerator[dict[str, Any], None]:
        head = self.head("chatcmpl", "chat.completion.chunk")
        top = req.top_logprobs_num
        for i in range(len(generation.rids)):
            role = {"role": "assistant", "content": ""}
            choice = {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            yield {**head, "choices": [choice], "usage": None}
        completion_tokens = [0] * len(generation.rids)
        async with aclosing(generation.updates()) as updates:
            async for u in updates:
                completion_tokens[u.index] = u.completion_tokens
                if not (u.text or u.finish_reason or (top is not None and u.token_ids)):
                    continue
                choice = {
                    "index": u.index,
                    "delta": {"content": u.text} if u.text else {},
                    "logprobs": self.chat_lp(u, top),
                    "finish_reason": finish_reason(u.finish_reason),
                }
                yield {**head, "usage": None, "choices": [choice]}
        if req.include_usage:
            yield {**head, "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens))}

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Any:
        self.check_model(req.model)
        messages = [m.for_template() for m in req.messages]
        params = req.sampling_params()
        # Without max_tokens, a chat may fill what the context leaves.
        seqs = await self.manager.prepare(
            lambda frontend: frontend.seqs(
                [frontend.chat_ids(messages)], [params], req.n, None, req.names
            ),
            None,  # a chat template is code, whose cost the body's size does not bound
        )
        if req.stream:
            generation = self.manager.submit(seqs)  # the scheduler starts meanwhile
            return EventStream(
                sse(self.chat_events(generation, len(seqs[0].input_ids), req)), generation
            )
        results = await unless_disconnected(request, self.manager.generate_all(seqs))
        if isinstance(results, Response):
            return results
        top = req.top_logprobs_num
        choices = [
            {
                "index": r.index,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": self.chat_lp(r, top),
                "finish_reason": finish_reason(r.finish_reason),
            }
            for r in results
        ]
        return {
            **self.head("chatcmpl", "chat.completion"),
            "choices": choices,
            "usage": usage(len(seqs[0].input_ids), sum(r.completion_tokens for r in results)),
        }


def openai_router(manager: TokenizerManager) -> APIRouter:
    routes = OpenAIRoutes(manager)
    router = APIRouter()
    router.add_api_route("/v1/models", routes.models, methods=["GET"])
    router.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    router.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    return router
