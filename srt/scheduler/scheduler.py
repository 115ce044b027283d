"""Continuous batching: admit requests, plan prefill and decode steps, apply stop conditions.

Each step is either a prefill batch (new requests, chunked when long, on top of any cached
prefix) or a decode batch (one token for every running request); with `--enable-mixed-chunk`
a prefill batch also carries one token of every running request (as a one-token extend on
its cached prefix), so that admitting a request does not stall the others. Admission
reserves KV for a request's whole future (prompt plus max_new_tokens), so decoding never runs
out of slots; a request that does not fit waits in the queue.

A plan commits its effects when it is built (KV lengths, slots, which requests decode next),
so the next step can be planned before this one's sampled ids are back: with overlap, step N+1
is planned and launched while step N runs, and a decode whose input is a token still on the
device says so in the plan (`input_from_prev`: its index in the previous step's result). What
only the sampled ids decide (stop tokens) is applied when the result arrives; a request that
stopped at step N but was already in step N+1 has that token dropped, and nothing of a request
(KV slots, table row, prefix-cache insertion) is freed while a step in flight still uses it.

The scheduler works on token ids only: stop strings are matched where the text is, on the
tokenizer side, which aborts the request here once one matches.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from srt.batch_layout import ForwardMode
from srt.ipc.messages import BatchPlan, BatchResult, GenerateReq, TokenOutput
from srt.request_limits import RequestLimits, check_seq
from srt.scheduler.kv_allocator import RequestRowPool, TokenSlotAllocator
from srt.scheduler.prefix_cache import PrefixCache
from srt.scheduler.req import NO_SLOTS, Req, ScheduledStep
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
        self.allocator = TokenSlotAllocator(num_slots)
        self.rows = RequestRowPool(args.max_running_requests)
        self.prefix_cache = PrefixCache(self.allocator) if args.enable_prefix_caching else None
        self.waiting: deque[Req] = deque()
        # Requests whose prompt is planned in full and that may decode, in admission order
        # (a dict: removal by rid is O(1)).
        self.running: dict[str, Req] = {}
        self.chunked: Req | None = None  # the request whose prompt is half prefilled
        self.reqs: dict[str, Req] = {}
        # future_need summed over admitted requests, kept up to date as slots are allocated
        # (summing it every step would cost O(running)).
        self.reserved = 0
        self.rng = random.Random(args.seed)
        self.step_count = 0
        # Overlap: the step launched but not yet processed, and how to wait for its result.
        self.in_flight: tuple[ScheduledStep, Callable[[], BatchResult]] | None = None
        self.stats = {
            "prefill_steps": 0,
            "decode_steps": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "cached_tokens": 0,
            "mixed_decode_tokens": 0,  # decodes that rode along in prefill steps
        }

    # ---- requests in and out -------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.context_length, self.allocator.capacity)

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
        if req.row < 0:  # still queued
            self.waiting.remove(req)
        req.finished_reason = "abort"
        self._finish(req)
        return self._output(req, [])

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when no request is in flight."""
        if self.reqs or self.prefix_cache is None:
            return not self.reqs
        self.prefix_cache.reset()
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.in_flight)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Plan the next batch (prefill if any request can be admitted, else decode) and
        commit its effects, so that the step after it can be planned at once."""
        items = self._schedule_prefill()
        mode = ForwardMode.EXTEND
        # Length limits are known in advance: a request whose last token is already planned
        # is not decoded again.
        decoding = [(r, 1) for r in self.running.values() if r.planned_outputs < r.max_new_tokens]
        if not items:
            items, mode = decoding, ForwardMode.DECODE
        elif self.args.enable_mixed_chunk:
            # The running requests ride along, one token each, so that admitting a request
            # does not stall every other stream for a step.
            items += decoding
            self.stats["mixed_decode_tokens"] += len(decoding)
        if not items:
            return None
        self.step_count += 1
        plan = self._build_plan(mode, items)
        samples = []
        for i, (req, extend) in enumerate(items):
            was_prefilling = not req.prompt_done
            req.kv_len += extend
            req.steps_in_flight += 1
            samples.append(req.prompt_done)
            if not req.prompt_done:
                continue
            if req is self.chunked:
                self.chunked = None
            if req.max_new_tokens > 0:
                req.pending_outputs += 1
                req.last_output_index, req.last_output_step = i, self.step_count
                if was_prefilling:  # its prompt is planned: it decodes from the next step on
                    self.running[req.rid] = req
        return ScheduledStep(plan, [r for r, _ in items], samples)

    def process_result(self, step: ScheduledStep, result: BatchResult) -> list[TokenOutput]:
        """Apply a step's sampled ids: stop checks, outputs, and the releases it allows."""
        outputs = []
        mode = step.plan.forward_mode
        self.stats["decode_steps" if mode == ForwardMode.DECODE else "prefill_steps"] += 1
        for i, (req, samples) in enumerate(zip(step.reqs, step.samples, strict=True)):
            req.steps_in_flight -= 1
            if samples and req.max_new_tokens > 0:
                req.pending_outputs -= 1
            if req.finished_reason is not None:  # finished before: this step's token drops
                if req.steps_in_flight == 0:
                    self._release(req)
                continue
            if not samples:
                continue
            new_ids: list[int] = []
            if req.max_new_tokens == 0:
                req.finished_reason = "length"
            else:
                token = int(result.next_token_ids[i])
                new_ids.append(token)
                req.output_ids.append(token)
                self.stats["generated_tokens"] += 1
                if result.logprobs is not None and req.params.logprobs:
                    self._record_logprobs(req, result, i)
                self._check_finished(req, token)
            if req.finished_reason is not None:
                self._finish(req)
            outputs.append(self._output(req, new_ids))
        return outputs

    def step(self, forward: Callable[[BatchPlan], BatchResult]) -> list[TokenOutput]:
        """Schedule, run `forward` on the plan, and process its result."""
        scheduled = self.schedule()
        if scheduled is None:
            return []
        return self.process_result(scheduled, forward(scheduled.plan))

    def step_overlapped(
        self, launch: Callable[[BatchPlan], Callable[[], BatchResult]]
    ) -> list[TokenOutput] | None:
        """Plan and launch the next step, then process the one launched before it (which ran
        meanwhile); None when there was neither. `launch` starts a step and returns what
        waits for its result. At most one step is in flight ahead of the one running."""
        scheduled = self.schedule()
        if scheduled is None and self.in_flight is None:
            return None
        launched = (scheduled, launch(scheduled.plan)) if scheduled is not None else None
        outputs = self.drain()
        self.in_flight = launched
        return outputs

    def drain(self) -> list[TokenOutput]:
        """Wait for the step in flight, if any, and process it."""
        if self.in_flight is None:
            return []
        step, wait = self.in_flight
        self.in_flight = None
        return self.process_result(step, wait())

    # ---- internals -------------------------------------------------------------------------

    def _free_slots(self) -> int:
        evictable = self.prefix_cache.evictable_size if self.prefix_cache else 0
        return self.allocator.available + evictable - self.reserved

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        budget = self.args.max_prefill_tokens
        items: list[tuple[Req, int]] = []
        if self.chunked is not None:
            extend = min(
                len(self.chunked.input_ids) - self.chunked.kv_len,
                self.args.chunked_prefill_size,
                budget,
            )
            items.append((self.chunked, extend))
            budget -= extend
        while (
            self.waiting
            and budget > 0
            and self.chunked is None
            and len(self.running) + len(items) < self.args.max_running_requests
            and self.rows.available
        ):
            req = self.waiting[0]
            if self.prefix_cache is not None:
                self.prefix_cache.attach(req)
            if self._free_slots() < req.future_need:
                if self.prefix_cache is not None:
                    self.prefix_cache.detach(req)
                break
            self.waiting.popleft()
            req.row = self.rows.alloc()
            self.reserved += req.future_need
            remaining = len(req.input_ids) - req.kv_len
            extend = min(remaining, self.args.chunked_prefill_size, budget)
            items.append((req, extend))
            budget -= extend
            self.stats["prompt_tokens"] += len(req.input_ids)
            self.stats["cached_tokens"] += req.cached_tokens
            if extend < remaining:
                self.chunked = req
        return items

    def _alloc(self, n: int) -> np.ndarray:
        if self.allocator.available < n and self.prefix_cache is not None:
            self.prefix_cache.evict(n - self.allocator.available)
        self.reserved -= n  # every allocation is for an admitted request, within its need
        return self.allocator.alloc(n)

    def _build_plan(self, mode: ForwardMode, items: list[tuple[Req, int]]) -> BatchPlan:
        n = len(items)
        req_rows = np.fromiter((r.row for r, _ in items), np.int32, n)
        kv_lens = np.fromiter((r.kv_len for r, _ in items), np.int32, n)
        input_from_prev = None
        if mode is ForwardMode.DECODE:
            # One token each, and each row already holds [0, kv_len): built as whole arrays,
            # since this runs every step for every running request.
            new = self._alloc(n)
            for i, (req, _) in enumerate(items):
                req.add_slots(new[i : i + 1])
                req.table_len = req.kv_len + 1
            ids = np.fromiter(
                (r.output_ids[-1] if not r.pending_outputs else 0 for r, _ in items), np.int32, n
            )
            if any(r.pending_outputs for r, _ in items):
                # The input is the token the step in flight samples; it stays on the device.
                input_from_prev = np.fromiter((self._prev_index(r) for r, _ in items), np.int32, n)
            positions, locs = kv_lens, new
            table = [req_rows, kv_lens, new]
        else:
            parts: list[list[np.ndarray]] = [[], [], [], [], [], []]
            sources: list[np.ndarray] = []  # per token, as input_from_prev
            for req, extend in items:
                new = self._alloc(extend)
                start, end = req.kv_len, req.kv_len + extend
                req.add_slots(new)
                if req.prompt_done:  # a decode riding along (mixed step): its last output
                    ids = np.array([0 if req.pending_outputs else req.output_ids[-1]], np.int32)
                    sources.append(np.array([self._prev_index(req)], np.int32))
                else:
                    ids = np.asarray(req.input_ids[start:end], np.int32)
                    sources.append(np.full(extend, -1, np.int32))
                # The runner's table row learns every slot it lacks (a prefix hit's too).
                for part, array in zip(
                    parts,
                    (
                        ids,
                        np.arange(start, end, dtype=np.int32),
                        new,
                        np.full(end - req.table_len, req.row, np.int32),
                        np.arange(req.table_len, end, dtype=np.int32),
                        req.slots[req.table_len : end],
                    ),
                    strict=True,
                ):
                    part.append(array)
                req.table_len = end
            ids, positions, locs, *table = (np.concatenate(p) for p in parts)
            if any(r.prompt_done and r.pending_outputs for r, _ in items):
                input_from_prev = np.concatenate(sources)
        params = [r.params for r, _ in items]
        return BatchPlan(
            forward_mode=int(mode),
            input_ids=ids,
            positions=positions,
            out_cache_loc=locs,
            req_pool_indices=req_rows,
            prefix_lens=kv_lens,
            extend_lens=np.array([e for _, e in items], np.int32),
            table_rows=table[0],
            table_cols=table[1],
            table_slots=table[2],
            temperatures=np.array([p.temperature for p in params], np.float32),
            top_ps=np.array([p.top_p for p in params], np.float32),
            top_ks=np.array(
                [p.top_k if p.top_k > 0 else self.vocab_size for p in params], np.int64
            ),
            min_ps=np.array([p.min_p for p in params], np.float32),
            seeds=np.array([r.seed for r, _ in items], np.int64),
            return_logprob=any(p.logprobs for p in params),
            top_logprobs_num=max(p.top_logprobs_num for p in params),
            step=self.step_count,
            input_from_prev=input_from_prev,
        )

    def _prev_index(self, req: Req) -> int:
        """Where a decoding request's input id is: its row in the result of the step in
        flight, when that step samples it (overlap: the id stays on the device), else -1 (the
        id is its last output, which the plan carries)."""
        if not req.pending_outputs:
            return -1
        assert req.last_output_step == self.step_count - 1, "one step ahead"
        return req.last_output_index

    def _record_logprobs(self, req: Req, result: BatchResult, i: int) -> None:
        assert result.logprobs is not None, "only for a result that carries logprobs"
        req.logprobs.append(float(result.logprobs[i]))
        n = req.params.top_logprobs_num
        if n and result.top_logprob_ids is not None and result.top_logprob_vals is not None:
            req.top_logprobs.append(
                [
                    (int(t), float(v))
                    for t, v in zip(
                        result.top_logprob_ids[i][:n], result.top_logprob_vals[i][:n], strict=True
                    )
                ]
            )

    def _check_finished(self, req: Req, token: int) -> None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.finished_reason, req.matched_stop = "stop", token
        elif len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = "length"

    def _finish(self, req: Req) -> None:
        """A finished request is planned no more; released now if no step in flight has it,
        else when the last such step comes back."""
        self.running.pop(req.rid, None)
        if req is self.chunked:
            self.chunked = None
        if req.steps_in_flight == 0:
            self._release(req)

    def _release(self, req: Req) -> None:
        """Give back a finished or aborted request's KV slots (to the prefix cache if on)."""
        if req.row >= 0:
            self.reserved -= req.future_need
            if self.prefix_cache is not None:
                # KV holds the tokens [0, kv_len) of prompt and output: every output token but
                # the last, or the last too if a step that was in flight took it as input. (A
                # step's input is known before any abort can arrive: aborts are handled between
                # loop turns, when only the step whose input is the last known token runs.)
                tokens = (req.input_ids + req.output_ids)[: req.kv_len]
                assert len(tokens) == req.kv_len == req.num_slots, "KV past the known tokens"
                self.prefix_cache.release(req, tokens, req.slots)
            else:
                self.allocator.free(req.slots)
            self.rows.free(req.row)
        req.slots, req.row, req.table_len = NO_SLOTS, -1, 0
        self.reqs.pop(req.rid, None)

    def _output(self, req: Req, new_ids: list[int]) -> TokenOutput:
        return TokenOutput(
            rid=req.rid,
            new_token_ids=new_ids,
            finished_reason=req.finished_reason,
            matched_stop=req.matched_stop,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            logprobs=req.logprobs[-len(new_ids) :] if new_ids and req.logprobs else [],
            top_logprobs=req.top_logprobs[-len(new_ids) :] if new_ids and req.top_logprobs else [],
        )

    def info(self) -> dict[str, Any]:
        used = self.allocator.capacity - self.allocator.available
        return {
            "running_requests": len(self.running) + (1 if self.chunked else 0),
            "queued_requests": len(self.waiting),
            "kv_slots_total": self.allocator.capacity,
            "kv_slots_free": self.allocator.available,
            "kv_slots_used": used,
            "kv_slots_cached": self.prefix_cache.size if self.prefix_cache else 0,
            "kv_usage": used / max(self.allocator.capacity, 1),
            **self.stats,
        }
