"""The main process's side of generation: prepare requests through the front end (off the event
loop), send them to the scheduler, and turn the token outputs that come back into text deltas
per sequence.

One call to `generate` runs one or more sequences (several prompts, `n` choices) and yields their
updates as they arrive; leaving the iteration early (a client that disconnects) aborts whatever
is still running, which frees its KV slots in the scheduler. A stream sends its sequences first
(`submit`) and sets its response up while the scheduler works on them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

import zmq

from srt.errors import InvalidRequest
from srt.ipc.channels import TO_SCHEDULER, Endpoints, Receiver, Sender, to_tokenizer
from srt.ipc.messages import (
    AbortReq,
    FlushCacheOutput,
    FlushCacheReq,
    GenerateReq,
    GenerateReqs,
    InfoOutput,
    InfoReq,
    ProfileOutput,
    ProfileReq,
    Replies,
    Reply,
    StepOutputs,
    TokenOutput,
    ToTokenizer,
)
from srt.ipc.reports import ProfileOutcome, ServerStartup
from srt.model_config import ModelConfig
from srt.request_limits import RequestLimits
from srt.server.hf_tokenizer import load_tokenizer
from srt.server.metrics import ServerMetrics
from srt.server.request_frontend import RequestFrontend, Seq
from srt.server.seq_outputs import SeqDecoder, SeqResult, SeqUpdate, coalesce
from srt.server_args import ServerArgs
from srt.timeline import StepTimeline

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests up to this size are prepared on the event loop (see `prepare`): 16 KiB of text
# tokenizes in well under a millisecond.
INLINE_PREPARE_BYTES = 16 * 1024


class ServerNotReady(RuntimeError):
    pass


class Mailbox:
    """One `generate` call's token outputs in arrival order: the router puts, the call takes
    everything that came since it last looked (an asyncio.Queue costs a future per item)."""

    def __init__(self) -> None:
        self.items: list[TokenOutput] = []
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: TokenOutput) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take_all(self) -> list[TokenOutput]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class Generation:
    """One call's sequences, sent to the scheduler as it is made (`TokenizerManager.submit`):
    their updates as they come (`updates`), and `close`, which aborts whatever has not
    finished. A stream's response closes it however the response ends, whether or not its
    events ever started: a client gone before then must still free the requests' KV."""

    def __init__(self, manager: TokenizerManager, seqs: list[Seq]) -> None:
        self.manager = manager
        self.arrival = time.perf_counter()
        manager.requests.begin()
        self.call = manager.requests.steps
        self.mailbox = Mailbox()
        base = uuid.uuid4().hex
        self.rids = [f"{base}-{i}" for i in range(len(seqs))]
        reqs = [
            GenerateReq(rid, seq.input_ids, seq.params, True, manager.worker)
            for rid, seq in zip(self.rids, seqs, strict=True)
        ]
        self.pending = set(self.rids)
        for rid in self.rids:
            manager.seq_mailboxes[rid] = self.mailbox
        manager.to_scheduler.send(reqs[0] if len(reqs) == 1 else GenerateReqs(reqs, manager.worker))
        manager.requests.mark("sent", self.call)
        # The rest after the send: the scheduler starts on the prompts meanwhile (and should
        # it fail, they are aborted, not left running for nobody).
        try:
            for seq in seqs:
                manager.metrics.prompt_tokens.inc(len(seq.input_ids))
            self.decoders = {
                rid: SeqDecoder(i, manager.tokenizer, seq.params)
                for i, (rid, seq) in enumerate(zip(self.rids, seqs, strict=True))
            }
        except BaseException:
            self.close()
            raise

    async def updates(self) -> AsyncGenerator[SeqUpdate, None]:
        """Each step's update until every sequence has finished; closing it early aborts."""
        manager, metrics, call = self.manager, self.manager.metrics, self.call
        pending = self.pending
        last_seen: dict[str, float] = {}
        try:
            while pending:
                # Everything that has arrived, one update per sequence.
                for out in coalesce(await self.mailbox.take_all()):
                    if out.rid not in pending:
                        continue  # a step that was under way when a stop string ended it
                    if out.error is not None:  # the backend died, or the scheduler refused it
                        if manager.failure:
                            raise ServerNotReady(out.error)
                        raise InvalidRequest(out.error)
                    update, abort = self.decoders[out.rid].update(out)
                    now = time.perf_counter()
                    if update.token_ids:
                        first = not last_seen
                        metrics.observe_tokens(
                            len(update.token_ids),
                            now - last_seen.get(out.rid, self.arrival),
                            first=out.rid not in last_seen,
                        )
                        last_seen[out.rid] = now
                        if first:
                            manager.requests.mark("first_token", call)
                    if update.finish_reason is not None:
                        pending.discard(out.rid)
                        if not pending:
                            manager.requests.mark("finished", call)
                        manager.seq_mailboxes.pop(out.rid, None)
                        metrics.observe_finish(update.finish_reason, now - self.arrival)
                        if abort:  # a stop string: the scheduler, seeing only ids, runs it on
                            manager.to_scheduler.send(AbortReq(out.rid, manager.worker))
                    yield update
        finally:
            self.close()

    def close(self) -> None:
        """Abort the sequences that have not finished; none is left pending, so a second call
        does nothing."""
        manager = self.manager
        for rid in self.rids:
            manager.seq_mailboxes.pop(rid, None)
        for rid in self.pending:
            manager.metrics.observe_finish("abort", time.perf_counter() - self.arrival)
            if manager.failure is None:
                manager.to_scheduler.send(AbortReq(rid, manager.worker))
        self.pending.clear()


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        endpoints: Endpoints,
        model_config: ModelConfig,
        worker: int = 0,
    ) -> None:
        """`worker`: which tokenizer worker this is (0, the main process's, unless
        --tokenizer-worker-num starts more); the scheduler sends it its own requests' outputs."""
        self.args = args
        self.worker = worker
        self.model_config = model_config
        assert args.model_path is not None, "the launcher resolves model_path"
        self.model_name = args.served_model_name or args.model_path
        self.tokenizer: Any = None  # `load_tokenizer`, before the server is marked ready
        self.metrics = ServerMetrics(shared=args.tokenizer_worker_num > 1)
        # Set once every child is ready (the runner decides the KV size and context length).
        self.ready = False
        self.failure: str | None = None
        self.context_length = 0
        self.kv_capacity = 0
        self.startup: ServerStartup | None = None
        self.frontend: RequestFrontend | None = None  # once the limits are known
        # Requests are prepared (tokenized) here, off the event loop; one thread, because a
        # tokenizer is not safe to use from several at once.
        self.prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="srt-tokenize")

        # Sync sockets: sends never wait (no high-water mark), and the inbox is drained on
        # the loop's readiness callback (Receiver.recv_all_async).
        self.ctx = zmq.Context()
        self.inbox = Receiver(self.ctx, endpoints, to_tokenizer(worker))
        self.to_scheduler = Sender(self.ctx, endpoints, TO_SCHEDULER)
        self.seq_mailboxes: dict[str, Mailbox] = {}
        # Who waits for the scheduler's answer to an InfoReq or a ProfileReq, by its req_id.
        self.answer_waiters: dict[int, asyncio.Future[Any]] = {}
        self.flush_waiters: deque[asyncio.Future[bool]] = deque()
        self.answer_ids = itertools.count()
        # Per step's outputs: received, routed to the sequences' queues.
        self.timeline = StepTimeline(("received", "routed"))
        # Per `generate` call, from its start (the request prepared) to its sequences sent to
        # the scheduler, their first token here and their end: what of the time to first
        # token the server spends, apart from the HTTP stack and the client.
        self.requests = StepTimeline(("arrived", "sent", "first_token", "finished"))

    def load_tokenizer(self) -> None:
        """Load the tokenizer (seconds, with transformers' import): the launcher does it while
        the server already answers, 503 until ready."""
        path = self.args.tokenizer_path or self.args.model_path
        assert path is not None, "the launcher resolves model_path"
        self.tokenizer = load_tokenizer(path)

    def mark_ready(self, context_length: int, kv_capacity: int, startup: ServerStartup) -> None:
        """Serve from now on, within the context and KV cache the runner made."""
        assert self.tokenizer is not None, "load_tokenizer comes first"
        self.context_length, self.kv_capacity = context_length, kv_capacity
        self.startup = startup
        limits = RequestLimits(self.model_config.vocab_size, self.context_length, self.kv_capacity)
        self.frontend = RequestFrontend(self.tokenizer, limits)
        self.ready = True

    def fail(self, reason: str) -> int:
        """The backend is gone (or going): end every request in flight with `reason`; returns
        how many sequences that ended."""
        self.ready, self.failure = False, reason
        ended = len(self.seq_mailboxes)
        for rid, mailbox in self.seq_mailboxes.items():
            mailbox.put(TokenOutput(rid, [], finished_reason="abort", error=reason))
        waiters: list[asyncio.Future[Any]] = [*self.answer_waiters.values(), *self.flush_waiters]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(ServerNotReady(reason))
        return ended

    def close(self) -> None:
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.inbox.close()
        self.to_scheduler.close()
        self.ctx.term()

    # ---- the inbox ------------------------------------------------------------------------

    async def handle_outputs(self) -> None:
        """Route everything the scheduler sends back; runs for the life of the server."""
        while True:
            for received in await self.inbox.recv_all_async():
                self._route(received)

    def _route(self, received: ToTokenizer) -> None:
        self.timeline.begin()
        # A step's outputs come packed in one message; replies come together.
        msgs: list[TokenOutput] | list[Reply]
        if isinstance(received, StepOutputs):
            msgs = received.unpack()
        elif isinstance(received, Replies):
            self.timeline.discard()
            msgs = received.items
        else:
            raise TypeError(f"tokenizer got an unexpected message {type(received).__name__}")
        for msg in msgs:
            if isinstance(msg, TokenOutput):
                mailbox = self.seq_mailboxes.get(msg.rid)
                if mailbox is not None:  # else: aborted here, the scheduler's echo
                    mailbox.put(msg)
            elif isinstance(msg, InfoOutput | ProfileOutput):
                answer_waiter = self.answer_waiters.pop(msg.req_id, None)
                if answer_waiter is not None and not answer_waiter.done():
                    answer_waiter.set_result(msg)
            elif isinstance(msg, FlushCacheOutput):
                flush_waiter = self.flush_waiters.popleft()
                if not flush_waiter.done():
                    flush_waiter.set_result(msg.success)
        if isinstance(received, StepOutputs):
            self.timeline.mark("routed")

    def check_ready(self) -> None:
        if not self.ready:
            raise ServerNotReady(self.failure or "the server is starting")

    async def get_info(self, timeline_since: float | None = None) -> InfoOutput:
        """Live scheduler and runner state (asks through the scheduler, between steps); their
        step timelines over the steps begun since `timeline_since`, if given."""
        info: InfoOutput = await self._ask(
            lambda req_id: InfoReq(req_id, timeline_since, self.worker)
        )
        return info

    async def profile(
        self, start: bool, output_dir: str | None = None, num_steps: int | None = None
    ) -> ProfileOutcome:
        """Start profiling the runner's next steps (at most `num_steps`), or stop it; what
        the profile holds (`srt.model_executor.runner_profiler`)."""
        answer: ProfileOutput = await self._ask(
            lambda req_id: ProfileReq(req_id, start, output_dir, num_steps, self.worker)
        )
        return answer.outcome

    async def _ask(self, message: Callable[[int], InfoReq | ProfileReq]) -> Any:
        """Send the scheduler `message(req_id)` and wait for its answer of that req_id."""
        self.check_ready()
        req_id = next(self.answer_ids)
        waiter = asyncio.get_running_loop().create_future()
        self.answer_waiters[req_id] = waiter
        self.to_scheduler.send(message(req_id))
        try:
            return await waiter
        finally:
            self.answer_waiters.pop(req_id, None)

    async def flush_cache(self) -> bool:
        self.check_ready()
        waiter = asyncio.get_running_loop().create_future()
        self.flush_waiters.append(waiter)
        self.to_scheduler.send(FlushCacheReq(self.worker))
        return await waiter

    # ---- requests -------------------------------------------------------------------------

    async def prepare(self, build: Callable[[RequestFrontend], T], body_bytes: int | None) -> T:
        """Run `build` (parse, validate, tokenize a request) on the front end. Work of
        unbounded cost (`body_bytes` None: a chat template, a body of unknown size) and a
        large body go to the tokenizing thread, off the event loop: a long prompt takes a
        while to tokenize, and /health must still answer. A small body whose work is its
        tokenization runs here: handing it to the thread and back costs two GIL handoffs,
        and while the loop is busy streaming, the thread waits up to the switch interval
        (5 ms) for each, which every new request's first token would wait too."""
        self.check_ready()
        frontend = self.frontend
        assert frontend is not None
        if body_bytes is not None and body_bytes <= INLINE_PREPARE_BYTES:
            return build(frontend)
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, build, frontend)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def submit(self, seqs: list[Seq]) -> Generation:
        """Send prepared sequences to the scheduler now, before anything else is set up (a
        stream's response): their updates come from the `Generation`."""
        self.check_ready()
        return Generation(self, seqs)

    async def generate(self, seqs: list[Seq]) -> AsyncGenerator[SeqUpdate, None]:
        """Run prepared sequences; yield each step's update until every one has finished
        (sent when the iteration starts)."""
        async with aclosing(self.submit(seqs).updates()) as updates:
            async for update in updates:
                yield update

    async def generate_all(self, seqs: list[Seq]) -> list[SeqResult]:
        results = [SeqResult(i) for i in range(len(seqs))]
        async for update in self.generate(seqs):
            results[update.index].add(update)
        return results
