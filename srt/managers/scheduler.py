"""Continuous batching: admit requests, plan prefill and decode steps, apply stop conditions.

Each step is either a prefill batch (new requests, chunked when long, on top of any cached
prefix) or a decode batch (one token for every running request). Admission reserves KV for a
request's whole future (prompt plus max_new_tokens), so decoding never runs out of slots; a
request that does not fit waits in the queue.

The scheduler works on token ids only: stop strings are matched where the text is, on the
tokenizer side, which aborts the request here once one matches.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from srt.batch_layout import ForwardMode
from srt.managers.frontend import RequestLimits, check_seq
from srt.managers.io_struct import BatchPlan, BatchResult, GenerateReq, TokenOutput
from srt.managers.kv_allocator import RequestRowPool, TokenSlotAllocator
from srt.managers.prefix_cache import PrefixCache
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(eq=False)  # identity: requests are compared in queue lookups on the hot path
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool = False
    max_new_tokens: int = 0  # the params' own, resolved by the front end before admission
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # request-to-token table row, -1 while waiting
    # KV slots of tokens [0, kv_len): the first `num_slots` entries of a buffer that grows by
    # doubling, so a decode step appends in O(1) instead of copying the whole history.
    slot_buf: np.ndarray = field(default_factory=lambda: _EMPTY)
    num_slots: int = 0
    kv_len: int = 0
    table_len: int = 0  # entries of its row the runner has been sent
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    cache_node: Any = None  # prefix-cache node locked while the request runs
    finished_reason: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def slots(self) -> np.ndarray:
        return self.slot_buf[: self.num_slots]

    @slots.setter
    def slots(self, slots: np.ndarray) -> None:
        self.slot_buf, self.num_slots = slots, len(slots)

    def add_slots(self, new: np.ndarray) -> None:
        end = self.num_slots + len(new)
        if end > len(self.slot_buf):
            buf = np.empty(max(end, 2 * len(self.slot_buf), 64), np.int32)
            buf[: self.num_slots] = self.slots
            self.slot_buf = buf
        self.slot_buf[self.num_slots : end] = new
        self.num_slots = end

    @property
    def prompt_done(self) -> bool:
        return self.kv_len >= len(self.input_ids)

    @property
    def future_need(self) -> int:
        """KV slots this request may still allocate."""
        return len(self.input_ids) + self.max_new_tokens - self.num_slots


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
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is half prefilled
        self.reqs: dict[str, Req] = {}
        self.rng = random.Random(args.seed)
        self.step_count = 0
        self.stats = {
            "prefill_steps": 0,
            "decode_steps": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "cached_tokens": 0,
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
        req = self.reqs.get(rid)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        req.finished_reason = "abort"
        self._release(req)
        return self._output(req, [])

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when no request is in flight."""
        if self.reqs or self.prefix_cache is None:
            return not self.reqs
        self.prefix_cache.reset()
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> tuple[BatchPlan, list[tuple[Req, int]]] | None:
        """Choose the next batch: prefill if any request can be admitted, else decode."""
        items = self._schedule_prefill()
        mode = ForwardMode.EXTEND
        if not items:
            items = [(r, 1) for r in self.running]
            mode = ForwardMode.DECODE
        if not items:
            return None
        self.step_count += 1
        return self._build_plan(mode, items), items

    def process_result(
        self, items: list[tuple[Req, int]], result: BatchResult
    ) -> list[TokenOutput]:
        outputs = []
        decode = all(r.prompt_done for r, _ in items)
        self.stats["decode_steps" if decode else "prefill_steps"] += 1
        for i, (req, extend) in enumerate(items):
            if req.finished_reason is not None:  # aborted while the step ran
                continue
            was_prefilling = not req.prompt_done
            req.kv_len += extend
            if not req.prompt_done:
                continue
            if req is self.chunked:
                self.chunked = None
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
                self._release(req)
            elif was_prefilling:  # its prompt is done: it joins the decode batch
                self.running.append(req)
            outputs.append(self._output(req, new_ids))
        return outputs

    def step(self, forward: Callable[[BatchPlan], BatchResult]) -> list[TokenOutput]:
        """Schedule, run `forward` on the plan, and process its result."""
        scheduled = self.schedule()
        if scheduled is None:
            return []
        plan, items = scheduled
        return self.process_result(items, forward(plan))

    # ---- internals -------------------------------------------------------------------------

    def _reserved(self) -> int:
        active = self.running + ([self.chunked] if self.chunked else [])
        return sum(r.future_need for r in active)

    def _free_slots(self) -> int:
        evictable = self.prefix_cache.evictable_size if self.prefix_cache else 0
        return self.allocator.available + evictable - self._reserved()

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
        admitted_need = 0  # future KV of requests admitted below (not yet in `running`)
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
            if self._free_slots() - admitted_need < req.future_need:
                if self.prefix_cache is not None:
                    self.prefix_cache.detach(req)
                break
            self.waiting.popleft()
            req.row = self.rows.alloc()
            remaining = len(req.input_ids) - req.kv_len
            extend = min(remaining, self.args.chunked_prefill_size, budget)
            items.append((req, extend))
            budget -= extend
            admitted_need += req.future_need
            self.stats["prompt_tokens"] += len(req.input_ids)
            self.stats["cached_tokens"] += req.cached_tokens
            if extend < remaining:
                self.chunked = req
        return items

    def _alloc(self, n: int) -> np.ndarray:
        if self.allocator.available < n and self.prefix_cache is not None:
            self.prefix_cache.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def _build_plan(self, mode: ForwardMode, items: list[tuple[Req, int]]) -> BatchPlan:
        n = len(items)
        req_rows = np.fromiter((r.row for r, _ in items), np.int32, n)
        kv_lens = np.fromiter((r.kv_len for r, _ in items), np.int32, n)
        if mode is ForwardMode.DECODE:
            # One token each, and each row already holds [0, kv_len): built as whole arrays,
            # since this runs every step for every running request.
            new = self._alloc(n)
            for i, (req, _) in enumerate(items):
                req.add_slots(new[i : i + 1])
                req.table_len = req.kv_len + 1
            ids = np.fromiter((r.output_ids[-1] for r, _ in items), np.int32, n)
            positions, locs = kv_lens, new
            table = [req_rows, kv_lens, new]
        else:
            parts: list[list[np.ndarray]] = [[], [], [], [], [], []]
            for req, extend in items:
                new = self._alloc(extend)
                start, end = req.kv_len, req.kv_len + extend
                req.add_slots(new)
                # The runner's table row learns every slot it lacks (a prefix hit's too).
                for part, array in zip(
                    parts,
                    (
                        np.asarray(req.input_ids[start:end], np.int32),
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
        )

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

    def _release(self, req: Req) -> None:
        """Give back a finished or aborted request's KV slots (to the prefix cache if on)."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req.row >= 0:
            if self.prefix_cache is not None:
                # KV holds the prompt and every output token but the last.
                tokens = (req.input_ids + req.output_ids)[: len(req.slots)]
                computed = min(req.kv_len, len(req.slots))
                self.prefix_cache.release(req, tokens[:computed], req.slots[:computed])
                self.allocator.free(req.slots[computed:])
            else:
                self.allocator.free(req.slots)
            self.rows.free(req.row)
        req.slots, req.row, req.table_len = _EMPTY, -1, 0
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
