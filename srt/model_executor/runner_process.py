"""The model-runner process: receives batch plans, runs them, sends results, in order.

A step's result is sent as soon as its ids are on the host, and a plan is launched as soon as
it arrives, however many steps are still on their way (overlap scheduling: the device does not
wait for the host's round trip, and the scheduler gets each result without waiting for the
next launch); while neither comes, the loop polls both. Results go out in step order, and an
info request is answered after every result before it.

With tensor parallelism this is rank 0; every other rank runs a `FollowerLoop`, which takes each
plan from rank 0 (over the process group, not ZeroMQ) and runs it in step.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import zmq

from srt.compilation.triton_workers import CompileWorkers
from srt.ipc.channels import FROM_RUNNER, TO_RUNNER, Endpoints, Receiver, Sender
from srt.ipc.messages import (
    BatchPlan,
    InfoReq,
    ProfileReply,
    ProfileReq,
    RunnerInfoReply,
    RunnerReady,
)
from srt.ipc.reports import ProfileOutcome, RunnerInfo
from srt.model_config import ModelConfig
from srt.model_executor.device_clock import DeviceClock
from srt.model_executor.model_runner import ModelRunner, PendingResult
from srt.model_executor.runner_profiler import RunnerProfiler
from srt.process import ReadyPipe, run_child
from srt.server_args import ServerArgs
from srt.timeline import StepTimeline
from srt.tp_rank import TPRank

logger = logging.getLogger(__name__)

# A step launched: its result on the way, and the event before its first op.
Launched = tuple[PendingResult, torch.cuda.Event | None]


def _build_runner(
    args: ServerArgs, tp: TPRank, compile_workers: CompileWorkers | None = None
) -> ModelRunner:
    assert args.model_path is not None, "the launcher resolves model_path"
    config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
    return ModelRunner(args, config, tp, compile_workers)


class RunnerLoop:
    def __init__(
        self,
        args: ServerArgs,
        endpoints: Endpoints,
        tp: TPRank,
        compile_workers: CompileWorkers | None = None,
    ) -> None:
        self.runner = _build_runner(args, tp, compile_workers)
        self.ctx = zmq.Context()
        self.inbox = Receiver(self.ctx, endpoints, TO_RUNNER)
        self.results = Sender(self.ctx, endpoints, FROM_RUNNER)
        device_type = self.runner.device.type
        self.results.send(
            RunnerReady(self.runner.num_slots, self.runner.context_length, device_type)
        )
        self.busy_s = args.busy_poll_s(device_type)
        # Per step: plan received, launched (on CUDA, queued on the device), result sent; and
        # the device's busy and idle milliseconds and their sum, its period (CUDA).
        self.timeline = StepTimeline(
            ("received", "launched", "result_sent"),
            durations=("device_busy", "device_idle", "device_period"),
        )
        self.clock = DeviceClock(self.runner.device)
        self.profiler = RunnerProfiler(self.runner.device)  # on request only

    def _send_ready(self, pending: deque[Launched], wait: bool = False) -> None:
        """Send the results that are on the host, oldest first (with `wait`, all of them)."""
        while pending and (wait or pending[0][0].ready()):
            result, started = pending.popleft()
            self.results.send(result.wait())
            self.timeline.mark("result_sent", result.step)
            for name, ms in self.clock.step_ms(started, result.event).items():
                self.timeline.record(name, result.step, ms)

    def runner_info(self) -> RunnerInfo:
        return self.runner.info()

    def run(self) -> None:
        pending: deque[Launched] = deque()  # launched, results not sent yet
        while True:
            self._send_ready(pending)
            if pending and not self.inbox.poll():
                continue
            if not pending:
                self.inbox.poll(None, self.busy_s)  # awake when the next plan comes
            msg = self.inbox.recv()
            if isinstance(msg, BatchPlan):
                self.timeline.begin(msg.step)
                self.timeline.tag_plan(msg)
                started = self.clock.start()
                with self.profiler.step():
                    pending.append((self.runner.launch(msg), started))
                self.timeline.mark("launched")
                if self.profiler.due:
                    self._send_ready(pending, wait=True)  # its steps' kernels in the trace
                    self.profiler.finish()
            elif isinstance(msg, InfoReq):
                self._send_ready(pending, wait=True)
                timeline = self.timeline.summary(msg.timeline_since)
                self.results.send(RunnerInfoReply(self.runner.info(), timeline))
            elif isinstance(msg, ProfileReq):
                self._send_ready(pending, wait=True)  # a profile holds whole steps
                self.results.send(ProfileReply(self._profile(msg)))
            else:
                raise TypeError(f"model runner got an unexpected message {type(msg).__name__}")

    def _profile(self, msg: ProfileReq) -> ProfileOutcome:
        if not msg.start:
            return self.profiler.stop()
        try:
            return self.profiler.start(msg.output_dir, msg.num_steps)
        except ValueError as e:  # a bad request, answered; the runner serves on
            return self.profiler.outcome("not started", error=str(e))


class FollowerLoop:
    """A rank other than 0: the same runner, given its plans by rank 0."""

    def __init__(self, args: ServerArgs, tp: TPRank) -> None:
        self.runner = _build_runner(args, tp)

    def runner_info(self) -> None:
        return None  # rank 0 reports the runner

    def run(self) -> None:
        self.runner.follow()


def run_runner_process(
    args: ServerArgs,
    endpoints: Endpoints,
    tp: TPRank,
    ready: ReadyPipe,
    compile_workers: CompileWorkers | None = None,
) -> None:
    """Rank 0 of the model runner, in the server (entered through `runner_entry`, which may
    have started the warm-up's compile workers)."""
    run_child(
        "model_runner",
        args.log_level,
        ready,
        lambda: RunnerLoop(args, endpoints, tp, compile_workers),
    )


def run_follower_process(args: ServerArgs, tp: TPRank, ready: ReadyPipe) -> None:
    """Rank `tp.rank` (not 0) of the model runner, in the server or under an Engine."""
    run_child(f"model_runner_rank{tp.rank}", args.log_level, ready, lambda: FollowerLoop(args, tp))
