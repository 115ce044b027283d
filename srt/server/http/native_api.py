"""SGLang's native /generate: `text` or `input_ids`, one or a batch, results with meta_info.
Requests go through the same front end as `Engine.generate`.

Streaming, each event carries one sequence's text and ids so far, as SGLang's does by default
(its benchmark client takes an event's `text` for the whole output); with
`--incremental-streaming-output`, only what the event adds (text, ids, logprobs), the counts
in `meta_info` still the sequence's totals, so that an event's size does not grow with the
output."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from srt.server.http.common import EventStream, body_bytes, sse, unless_disconnected
from srt.server.http.openai_protocol import GenerateRequest
from srt.server.seq_outputs import SeqResult
from srt.server.tokenizer_manager import Generation, TokenizerManager


def native_router(manager: TokenizerManager) -> APIRouter:
    router = APIRouter()

    def native(r: SeqResult) -> dict[str, Any]:
        return {"index": r.index, **r.native()}

    async def native_events(generation: Generation) -> AsyncGenerator[dict[str, Any], None]:
        incremental = manager.args.incremental_streaming_output
        results = [SeqResult(i) for i in range(len(generation.rids))]
        async with aclosing(generation.updates()) as updates:
            async for u in updates:
                result = SeqResult(u.index) if incremental else results[u.index]
                result.add(u)
                yield native(result)

    @router.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        single, seqs = await manager.prepare(
            lambda frontend: frontend.native(req.text, req.input_ids, req.sampling_params),
            body_bytes(request),
        )
        if req.stream:
            generation = manager.submit(seqs)  # the scheduler starts while the response is set up
            return EventStream(sse(native_events(generation)), generation)
        results = await unless_disconnected(request, manager.generate_all(seqs))
        if isinstance(results, Response):
            return results
        out = [native(r) for r in results]
        return out[0] if single else out

    return router
