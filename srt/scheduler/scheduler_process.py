"""The scheduler process: requests in from the tokenizer, one batch plan at a time to the runner,
token outputs back to the tokenizer.

With overlap (the default), steps are planned and sent ahead of the result awaited (step N+2
before step N's with the default --overlap-depth 2), so the runner always has the next plan
when a step ends; with --disable-overlap-schedule each step is planned, run and processed in
turn. Between steps every message that has arrived is handled,
and with no work the loop sleeps on its inbox. A step's outputs go to the tokenizer as one
message. A request that cannot be admitted, for whatever reason, is finished with an error; the
others carry on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import zmq

from srt.ipc.channels import (
    FROM_RUNNER,
    TO_RUNNER,
    TO_SCHEDULER,
    Endpoints,
    Receiver,
    Sender,
    to_tokenizer,
)
from srt.ipc.messages import (
    AbortReq,
    BatchPlan,
    BatchResult,
    FlushCacheOutput,
    FlushCacheReq,
    GenerateReq,
    GenerateReqs,
    InfoOutput,
    InfoReq,
    ProfileOutput,
    ProfileReply,
    ProfileReq,
    Replies,
    Reply,
    RunnerInfoReply,
    RunnerReady,
    StepOutputs,
    TokenOutput,
    ToScheduler,
    ToTokenizer,
)
from srt.model_config import ModelConfig
from srt.process import ReadyPipe, run_child
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from srt.timeline import StepTimeline

logger = logging.getLogger(__name__)

R = TypeVar("R")

# While requests wait for KV room that no running request is about to free, poll this often (ms).
_BLOCKED_POLL_MS = 10


class OutputRoutes:
    """Where outputs go: each request's to the tokenizer worker that sent it, an answer to the
    worker that asked. With one worker (the default) everything goes to it, unrecorded."""

    def __init__(self, senders: list[Sender[ToTokenizer]]) -> None:
        self.senders = senders
        self.worker_of: dict[str, int] = {}  # the running requests', with several workers

    def admit(self, rid: str, worker: int) -> None:
        if len(self.senders) > 1:
            self.worker_of[rid] = worker

    def forget(self, rid: str) -> None:
        self.worker_of.pop(rid, None)

    def send_outputs(self, outputs: StepOutputs) -> None:
        """A step's outputs, one message to each worker that has any."""
        if not outputs:
            return
        if len(self.senders) == 1:
            self.senders[0].send(outputs)
            return
        worker_of = self.worker_of
        workers = np.fromiter(
            # A finished request sends nothing more: forget where it came from.
            (
                worker_of.pop(rid) if reason else worker_of[rid]
                for rid, reason in zip(outputs.rids, outputs.finished_reasons, strict=True)
            ),
            np.int32,
            len(outputs),
        )
        for worker in np.unique(workers).tolist():
            self.senders[worker].send(outputs.take(workers == worker))

    def send_replies(self, replies: dict[int, list[Reply]]) -> None:
        """Answers to one turn of the inbox, by the worker whose message each answers."""
        for worker, items in replies.items():
            self.senders[worker].send(Replies(items))


class SchedulerLoop:
    def __init__(self, args: ServerArgs, endpoints: Endpoints) -> None:
        self.ctx = zmq.Context()
        self.inbox = Receiver(self.ctx, endpoints, TO_SCHEDULER)
        self.results = Receiver(self.ctx, endpoints, FROM_RUNNER)
        self.to_runner = Sender(self.ctx, endpoints, TO_RUNNER)
        self.routes = OutputRoutes(
            [Sender(self.ctx, endpoints, to_tokenizer(w)) for w in range(args.tokenizer_worker_num)]
        )
        assert args.model_path is not None, "the launcher resolves model_path"
        config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
        # The runner's first message, once its KV cache exists.
        ready = self._from_runner(RunnerReady)
        self.scheduler = Scheduler(
            args,
            num_slots=ready.num_slots,
            context_length=ready.context_length,
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_ids,
        )
        self.overlap = not args.disable_overlap_schedule
        self.busy_s = args.busy_poll_s(ready.device_type)
        # Per loop turn: plan built, sent, the oldest step's in flight (overlap) or this
        # plan's result back, outputs sent to the tokenizer.
        self.timeline = StepTimeline(("start", "planned", "sent", "received", "outputs_sent"))

    def runner_info(self) -> None:
        return None

    def run(self) -> None:
        timeout: int | None = 0
        while True:
            if not self.scheduler.has_work:
                timeout = None
            # Idle: polled awhile before sleeping, so that the next request is planned at once.
            if self.inbox.poll(timeout, self.busy_s if timeout is None else 0.0):
                self._handle_inbox()
            self.timeline.begin()
            outputs = self._step()
            if outputs is None:
                self.timeline.discard()
                timeout = None if not self.scheduler.has_work else _BLOCKED_POLL_MS
                continue
            timeout = 0
            self._send_outputs(outputs)
            self.timeline.mark("outputs_sent")

    def _step(self) -> StepOutputs | None:
        """One step's outputs; None if no step could be planned and none was in flight."""
        if self.overlap:
            return self.scheduler.step_overlapped(self._launch)
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return None
        return self.scheduler.process_result(scheduled, self._launch(scheduled.plan)())

    def _launch(self, plan: BatchPlan) -> Callable[[], BatchResult]:
        self.timeline.mark("planned")
        self.timeline.tag_plan(plan)
        self.to_runner.send(plan)
        self.timeline.mark("sent")
        return self._result

    def _result(self) -> BatchResult:
        self.results.poll(None, self.busy_s)  # awake when it comes: a step's time, or less
        result = self._from_runner(BatchResult)  # the runner answers in order
        self.timeline.mark("received")
        return result

    def _from_runner(self, kind: type[R]) -> R:
        msg = self.results.recv()
        if not isinstance(msg, kind):
            raise TypeError(f"expected {kind.__name__} from the runner, got {type(msg).__name__}")
        return msg

    def _send_outputs(self, outputs: StepOutputs) -> None:
        self.routes.send_outputs(outputs)

    def _handle_inbox(self) -> None:
        replies: dict[int, list[Reply]] = {}
        while True:
            try:
                msg = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            for one in msg.reqs if isinstance(msg, GenerateReqs) else [msg]:
                reply = self._handle(one)
                if reply is not None:
                    replies.setdefault(one.tokenizer_worker, []).append(reply)
        self.routes.send_replies(replies)

    def _handle(self, msg: ToScheduler) -> Reply | None:
        if isinstance(msg, GenerateReq):
            try:
                self.scheduler.add_request(msg)
            except Exception as e:  # one bad request must never stop the others
                logger.warning("rejected request %s: %s: %s", msg.rid, type(e).__name__, e)
                return TokenOutput(msg.rid, [], finished_reason="abort", error=str(e))
            self.routes.admit(msg.rid, msg.tokenizer_worker)
            return None
        if isinstance(msg, AbortReq):
            aborted = self.scheduler.abort(msg.rid)
            if aborted is not None:  # the answer ends it: no output of it follows
                self.routes.forget(msg.rid)
            return aborted
        if isinstance(msg, FlushCacheReq):
            return FlushCacheOutput(self.scheduler.flush_cache())
        if isinstance(msg, InfoReq):
            # The runner's reply comes after the result of the step in flight: take it first.
            self._send_outputs(self.scheduler.drain())
            self.to_runner.send(msg)
            timeline = self.timeline.summary(msg.timeline_since)
            runner = self._from_runner(RunnerInfoReply)
            return InfoOutput(
                msg.req_id, self.scheduler.info(), timeline, runner.info, runner.timeline
            )
        if isinstance(msg, ProfileReq):
            # The runner answers after the results of the steps in flight: take them first.
            self._send_outputs(self.scheduler.drain())
            self.to_runner.send(msg)
            return ProfileOutput(msg.req_id, self._from_runner(ProfileReply).outcome)
        raise TypeError(f"scheduler got an unexpected message {type(msg).__name__}")


def run_scheduler_process(args: ServerArgs, endpoints: Endpoints, ready: ReadyPipe) -> None:
    run_child("scheduler", args.log_level, ready, lambda: SchedulerLoop(args, endpoints))
