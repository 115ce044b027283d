"""The main process's side of generation: tokenize, validate, send to the scheduler, and turn the
token outputs that come back into text deltas per sequence.

One call to `generate` runs one or more sequences (several prompts, `n` choices) and yields their
updates as they arrive; leaving the iteration early (a client that disconnects) aborts whatever
is still running, which frees its KV slots in the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from srt.entrypoints.metrics import ServerMetrics
from srt.managers.io_struct import (
    AbortReq,
    FlushCacheOutput,
    FlushCacheReq,
    GenerateReq,
    InfoOutput,
    InfoReq,
    TokenOutput,
)
from srt.managers.ipc import Endpoints, bind_pull, connect_push, send
from srt.managers.scheduler import validate_request
from srt.managers.tokenizer import IncrementalDetokenizer, load_tokenizer
from srt.model_config import ModelConfig
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ServerNotReady(RuntimeError):
    pass


@dataclass
class SeqUpdate:
    """What one step added to one sequence (`index` is its place in the request)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class SeqResult:
    """A whole sequence: the updates of one index folded together."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, u: SeqUpdate) -> None:
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs
        self.top_logprobs += u.top_logprobs
        self.finish_reason, self.matched_stop = u.finish_reason, u.matched_stop
        self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens
        self.cached_tokens = u.cached_tokens


class TokenizerManager:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, model_config: ModelConfig) -> None:
        self.args = args
        self.model_config = model_config
        self.model_name = args.served_model_name or args.model_path
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.metrics = ServerMetrics()
        # Set once every child is ready (the runner decides the KV size and context length).
        self.ready = False
        self.failure: str | None = None
        self.context_length = 0
        self.kv_capacity = 0
        self.startup: dict[str, Any] = {}

        self.ctx = zmq.asyncio.Context()
        self.inbox = bind_pull(self.ctx, endpoints.tokenizer_inbox)
        self.sync_ctx = zmq.Context()  # sends never wait (no high-water mark), so stay sync
        self.to_scheduler = connect_push(self.sync_ctx, endpoints.scheduler_inbox)
        self.seq_queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self.info_waiters: dict[int, asyncio.Future[InfoOutput]] = {}
        self.flush_waiters: deque[asyncio.Future[bool]] = deque()
        self.info_ids = itertools.count()

    def mark_ready(self, context_length: int, kv_capacity: int, startup: dict[str, Any]) -> None:
        self.context_length, self.kv_capacity, self.startup = context_length, kv_capacity, startup
        self.ready = True

    def fail(self, reason: str) -> None:
        """The backend is gone: end every request in flight with `reason`."""
        self.ready, self.failure = False, reason
        for rid, queue in self.seq_queues.items():
            queue.put_nowait(TokenOutput(rid, [], finished_reason="abort", error=reason))
        for waiter in [*self.info_waiters.values(), *self.flush_waiters]:
            if not waiter.done():
                waiter.set_exception(ServerNotReady(reason))

    def close(self) -> None:
        self.inbox.close()
        self.to_scheduler.close()
        self.ctx.term()
        self.sync_ctx.term()

    # ---- the inbox ------------------------------------------------------------------------

    async def handle_outputs(self) -> None:
        """Route everything the scheduler sends back; runs for the life of the server."""
        while True:
            for msg in pickle.loads(await self.inbox.recv()):
                if isinstance(msg, TokenOutput):
                    queue = self.seq_queues.get(msg.rid)
                    if queue is not None:  # else: aborted here, the scheduler's echo
                        queue.put_nowait(msg)
                elif isinstance(msg, InfoOutput):
                    waiter = self.info_waiters.pop(msg.req_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(msg)
                elif isinstance(msg, FlushCacheOutput):
                    waiter = self.flush_waiters.popleft()
                    if not waiter.done():
                        waiter.set_result(msg.success)

    def _check_ready(self) -> None:
        if not self.ready:
            raise ServerNotReady(self.failure or "the server is starting")

    async def get_info(self) -> InfoOutput:
        """Live scheduler and runner state (asks through the scheduler, between steps)."""
        self._check_ready()
        req_id = next(self.info_ids)
        waiter = asyncio.get_running_loop().create_future()
        self.info_waiters[req_id] = waiter
        send(self.to_scheduler, InfoReq(req_id))
        try:
            return await waiter
        finally:
            self.info_waiters.pop(req_id, None)

    async def flush_cache(self) -> bool:
        self._check_ready()
        waiter = asyncio.get_running_loop().create_future()
        self.flush_waiters.append(waiter)
        send(self.to_scheduler, FlushCacheReq())
        return await waiter

    # ---- requests -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja raises its own types for templates that reject input
            raise ValueError(f"cannot apply the chat template: {e}") from e
        return self.tokenizer.encode(prompt, add_special_tokens=False)  # the template has them

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """ValueError for a request that cannot be served (checked before it is sent)."""
        self._check_ready()
        validate_request(input_ids, params, self.model_config.vocab_size, self.context_length,
                         self.kv_capacity)
        if len(input_ids) + params.max_new_tokens > self.context_length:
            raise ValueError(
                f"the context length is {self.context_length} tokens, but the request asks for "
                f"{len(input_ids) + params.max_new_tokens} ({len(input_ids)} in the prompt, "
                f"{params.max_new_tokens} to generate)"
            )

    async def generate(
        self, seqs: list[tuple[list[int], SamplingParams]]
    ) -> AsyncIterator[SeqUpdate]:
        """Run validated sequences; yield each step's update until every one has finished."""
        self._check_ready()
        arrival = time.perf_counter()
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(seqs))]
        index = {rid: i for i, rid in enumerate(rids)}
        detoks = {
            rid: IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop)
            for rid, (_, p) in zip(rids, seqs, strict=True)
        }
        last_seen: dict[str, float] = {}
        pending = set(rids)
        for rid, (ids, params) in zip(rids, seqs, strict=True):
            self.seq_queues[rid] = queue
            send(self.to_scheduler, GenerateReq(rid, ids, params, stream=True))
            self.metrics.prompt_tokens.inc(len(ids))
        try:
            while pending:
                out = await queue.get()
                if out.error is not None:  # the backend died, or the scheduler refused it
                    raise ServerNotReady(out.error) if self.failure else ValueError(out.error)
                now = time.perf_counter()
                if out.new_token_ids:
                    self.metrics.observe_tokens(len(out.new_token_ids),
                                                now - last_seen.get(out.rid, arrival),
                                                first=out.rid not in last_seen)
                    last_seen[out.rid] = now
                detok = detoks[out.rid]
                text = detok.push(out.new_token_ids)
                if out.finished_reason is not None:
                    text += detok.finish()
                    pending.discard(out.rid)
                    self.metrics.observe_finish(out.finished_reason, now - arrival)
                yield SeqUpdate(
                    index=index[out.rid], text=text, token_ids=out.new_token_ids,
                    logprobs=out.logprobs, top_logprobs=out.top_logprobs,
                    finish_reason=out.finished_reason, matched_stop=out.matched_stop,
                    prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                    cached_tokens=out.cached_tokens,
                )
        finally:
            for rid in rids:
                self.seq_queues.pop(rid, None)
                if rid in pending:
                    self.metrics.observe_finish("abort", time.perf_counter() - arrival)
                    if self.failure is None:
                        send(self.to_scheduler, AbortReq(rid))

    async def generate_all(self, seqs: list[tuple[list[int], SamplingParams]]) -> list[SeqResult]:
        results = [SeqResult(i) for i in range(len(seqs))]
        async for update in self.generate(seqs):
            results[update.index].add(update)
        return results
