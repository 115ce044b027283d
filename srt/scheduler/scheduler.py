"""Continuous batching: admit requests, plan prefill and decode steps, apply stop conditions.

Each step is either a prefill batch (new requests, chunked when long, on top of any cached
prefix) or a decode batch (one token for every running request); with `--enable-mixed-chunk`
a prefill batch also carries one token of every running request (as a one-token extend on
its cached prefix), so that admitting a request does not stall the others. Admission
reserves KV for a request's whole future (prompt plus max_new_tokens), so decoding never runs
out of slots; a request that does not fit waits in the queue.

A plan commits its effects when it is built (KV lengths, slots, which requests decode next),
so the next steps can be planned before this one's sampled ids are back: with overlap, up to
`--overlap-depth` steps are launched ahead of the one whose result is processed, and a decode
whose input is a token still on the device says so in the plan (`input_from_row`: the
request's table row, whose latest sampled id the runner keeps). What only the sampled ids
decide (stop tokens) is applied when the result arrives; a request that stopped at step N but
was already in the steps after it has those tokens dropped, and nothing of a request (KV
slots, table row, prefix-cache insertion) is freed while a step in flight still uses it.

Why more than one step ahead: the host's work between two steps (the scheduler's processing
of a result and its next plan, the runner's upload and launch) is on the critical path when
step N+1 must be planned from step N-1's result within step N's time on the device; two steps
ahead give it two steps' time, so a small model's short steps are not host-bound.

The scheduler works on token ids only: stop strings are matched where the text is, on the
tokenizer side, which aborts the request here once one matches.

`Scheduler` runs the steps and tracks the requests; its parts are the KV account
(`kv_accounting`), admission from the queue (`admission`), plan building (`plan_builder`) and
what a sampled id does (`token_outputs`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from collections.abc import Callable

from srt.batch_layout import ForwardMode
from srt.ipc.messages import (
    BatchPlan,
    BatchResult,
    GenerateReq,
    StepOutputs,
    StepOutputsBuilder,
    TokenOutput,
)
from srt.ipc.reports import SchedulerInfo
from srt.request_limits import RequestLimits, check_seq
from srt.scheduler.admission import Admission
from srt.scheduler.kv_accounting import KVAccounting
from srt.scheduler.plan_builder import SamplingRows, build_plan
from srt.scheduler.req import Req, ScheduledStep, StepCounters
from srt.scheduler.token_outputs import add_outputs_if_due, take_sample, token_output
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        num_slots: int,
        context_length: int,
        vocab_size: int,
        eos_token_ids: list[int],
    ) -> None:
        self.args = args
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.kv = KVAccounting(num_slots, args.max_running_requests, args.enable_prefix_caching)
        self.counters = StepCounters()
        self.sampling = SamplingRows(args.max_running_requests, vocab_size)
        self.admission = Admission(args, self.kv, self.sampling, self.counters)
        # Requests whose prompt is planned in full and that may decode, in admission order
        # (a dict: removal by rid is O(1)).
        self.running: dict[str, Req] = {}
        self.reqs: dict[str, Req] = {}
        self.rng = random.Random(args.seed)
        self.step_count = 0
        # The number of the latest step whose result is processed: steps are processed in
        # the order they are planned, so those in flight are the ones numbered past it.
        self.processed_step = 0
        # Overlap: the steps launched but not yet processed, oldest first, each with how to
        # wait for its result; at most `overlap_depth` stay in flight after a step is taken.
        self.in_flight: deque[tuple[ScheduledStep, Callable[[], BatchResult]]] = deque()
        self.overlap_depth = args.overlap_depth

    @property
    def waiting(self) -> deque[Req]:
        return self.admission.waiting

    @property
    def chunked(self) -> Req | None:
        """The request whose prompt is half planned."""
        return self.admission.chunked

    # ---- requests in and out -------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.context_length, self.kv.allocator.capacity)

    def add_request(self, req: GenerateReq) -> None:
        """Queue a request; ValueError if it can never be served.

        The front end has checked it already; checking again with the same rules here means
        that no value that would break a later step (a top_k past int64 in the plan's arrays)
        can get in, whoever sent it.
        """
        params = req.sampling_params
        params.verify(self.vocab_size)
        check_seq(req.input_ids, params, self.limits)
        if req.rid in self.reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        assert params.max_new_tokens is not None  # check_seq refuses it otherwise
        r = Req(req.rid, list(req.input_ids), params, seed, req.stream, params.max_new_tokens)
        self.reqs[r.rid] = r
        self.waiting.append(r)

    def abort(self, rid: str) -> TokenOutput | None:
        """Finish a request now; None if it is unknown or has finished already. Its slots
        are freed once no step in flight uses them."""
        req = self.reqs.get(rid)
        if req is None or req.finished_reason is not None:
            return None
        req.finished_reason = "abort"
        self._finish(req)
        return token_output(req)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when no request is in flight."""
        if self.reqs:
            return False
        self.kv.flush()
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.in_flight)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Plan the next batch (prefill if any request can be admitted, else decode) and
        commit its effects, so that the step after it can be planned at once."""
        items = self.admission.next_prefill(len(self.running))
        reqs, extends = [r for r, _ in items], [e for _, e in items]
        mode = ForwardMode.EXTEND
        # Length limits are known in advance: a request whose last token is already planned
        # is not decoded again.
        decoding = [r for r in self.running.values() if r.planned_outputs < r.max_new_tokens]
        if not reqs:
            reqs, extends, mode = decoding, [1] * len(decoding), ForwardMode.DECODE
        elif self.args.enable_mixed_chunk:
            # The running requests ride along, one token each, so that admitting a request
            # does not stall every other stream for a step.
            reqs += decoding
            extends += [1] * len(decoding)
            self.counters.mixed_decode_tokens += len(decoding)
        if not reqs:
            return None
        self.step_count += 1
        plan = build_plan(mode, reqs, extends, self.step_count, self.sampling, self.kv.alloc)
        return ScheduledStep(plan, reqs, self._commit(reqs, extends))

    def process_result(self, step: ScheduledStep, result: BatchResult) -> StepOutputs:
        """Apply a step's sampled ids: stop checks, outputs, and the releases it allows."""
        outputs = StepOutputsBuilder()
        self._process(step, result, outputs)
        return outputs.build()

    def step(self, forward: Callable[[BatchPlan], BatchResult]) -> StepOutputs:
        """Schedule, run `forward` on the plan, and process its result."""
        scheduled = self.schedule()
        if scheduled is None:
            return StepOutputsBuilder().build()
        return self.process_result(scheduled, forward(scheduled.plan))

    def step_overlapped(
        self, launch: Callable[[BatchPlan], Callable[[], BatchResult]]
    ) -> StepOutputs | None:
        """Plan and launch the next step, then process the oldest one in flight once more
        than `overlap_depth` are (or, with nothing to plan, whichever is oldest); None when
        there was nothing to plan and none in flight. `launch` starts a step and returns what
        waits for its result."""
        scheduled = self.schedule()
        if scheduled is None and not self.in_flight:
            return None
        if scheduled is not None:
            self.in_flight.append((scheduled, launch(scheduled.plan)))
            if len(self.in_flight) <= self.overlap_depth:
                # The device has work queued; its results come in later turns.
                return StepOutputsBuilder().build()
        step, wait = self.in_flight.popleft()
        return self.process_result(step, wait())

    def drain(self) -> StepOutputs:
        """Wait for every step in flight, oldest first, and process them: their outputs in
        one message."""
        outputs = StepOutputsBuilder()
        while self.in_flight:
            step, wait = self.in_flight.popleft()
            self._process(step, wait(), outputs)
        return outputs.build()

    def info(self) -> SchedulerInfo:
        slots = self.kv.allocator
        used = slots.capacity - slots.available
        return SchedulerInfo(
            running_requests=len(self.running) + (1 if self.chunked else 0),
            queued_requests=len(self.waiting),
            kv_slots_total=slots.capacity,
            kv_slots_free=slots.available,
            kv_slots_used=used,
            kv_slots_cached=self.kv.cached,
            kv_usage=used / max(slots.capacity, 1),
            **dataclasses.asdict(self.counters),
        )

    # ---- internals -------------------------------------------------------------------------

    def _commit(self, reqs: list[Req], extends: list[int]) -> list[bool]:
        """Commit a planned step's effect on its requests: for each, whether the step samples
        a token for it (it does once the prompt is planned in full)."""
        samples = []
        for req, extend in zip(reqs, extends, strict=True):
            prompt_len = req.prompt_len
            was_prefilling = req.kv_len < prompt_len
            req.kv_len += extend
            req.last_step = self.step_count
            if req.kv_len < prompt_len:
                samples.append(False)
                continue
            if req.max_new_tokens > 0:
                req.planned_outputs += 1
                if was_prefilling:  # its prompt is planned: it decodes from the next step on
                    self.running[req.rid] = req
            samples.append(True)
        return samples

    def _process(
        self, step: ScheduledStep, result: BatchResult, outputs: StepOutputsBuilder
    ) -> None:
        if step.plan.forward_mode == ForwardMode.DECODE:
            self.counters.decode_steps += 1
        else:
            self.counters.prefill_steps += 1
        assert step.plan.step > self.processed_step, "steps are processed in order"
        self.processed_step = step.plan.step
        # One conversion for the step: indexing the array per request costs a numpy scalar
        # each.
        tokens = result.next_token_ids.tolist()
        eos_token_ids = self.eos_token_ids
        sampled: list[Req] = []
        generated = 0
        for i, (req, samples) in enumerate(zip(step.reqs, step.samples, strict=True)):
            dropped = req.finished_reason is not None  # finished before: its token drops
            if dropped:
                if not self._in_flight(req):
                    self._release(req)
            elif samples:
                generated += take_sample(req, tokens[i], result, i, eos_token_ids)
                if req.finished_reason is not None:
                    self._finish(req)
                sampled.append(req)
        self.counters.generated_tokens += generated
        # After the loop, as columns: an output reads nothing that a release changes.
        add_outputs_if_due(sampled, self.args.stream_interval, outputs)

    def _finish(self, req: Req) -> None:
        """A finished request is planned no more; released now if no step in flight has it,
        else when the last such step comes back."""
        self.running.pop(req.rid, None)
        self.admission.withdraw(req)
        if not self._in_flight(req):
            self._release(req)

    def _in_flight(self, req: Req) -> bool:
        """Whether a step in flight has `req`."""
        return req.last_step > self.processed_step

    def _release(self, req: Req) -> None:
        self.kv.release(req)
        self.reqs.pop(req.rid, None)
