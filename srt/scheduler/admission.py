"""Admission: which queued requests a prefill step takes, and how much of each prompt.

A prefill step either continues the one prompt that is half prefilled, alone, or admits queued
requests in order while the step's token budget, the running-request limit and the KV cache
allow; a prompt longer than the chunk size or the budget left is split over steps (chunked
prefill), and no request is admitted past it until it is planned in full.
"""

from __future__ import annotations

from collections import deque

from srt.scheduler.kv_accounting import KVAccounting
from srt.scheduler.plan_builder import SamplingRows
from srt.scheduler.req import Req, StepCounters
from srt.server_args import ServerArgs


class Admission:
    def __init__(
        self, args: ServerArgs, kv: KVAccounting, sampling: SamplingRows, counters: StepCounters
    ) -> None:
        self.args = args
        self.kv = kv
        self.sampling = sampling
        self.counters = counters
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # the request whose prompt is half planned

    def next_prefill(self, running: int) -> list[tuple[Req, int]]:
        """The next prefill step's requests, each with how many prompt tokens it computes;
        `running` is how many requests decode. Requests taken are admitted: KV reserved, their
        sampling parameters in their table row."""
        budget = self.args.max_prefill_tokens
        if self.chunked is not None:
            return [(self.chunked, self._take(self.chunked, budget))]
        items: list[tuple[Req, int]] = []
        while (
            self.waiting
            and budget > 0
            and self.chunked is None
            and running + len(items) < self.args.max_running_requests
        ):
            req = self.waiting[0]
            if not self.kv.admit(req):
                break
            self.sampling.write(req)
            self.waiting.popleft()
            extend = self._take(req, budget)
            items.append((req, extend))
            budget -= extend
            self.counters.prompt_tokens += req.prompt_len
            self.counters.cached_tokens += req.cached_tokens
        return items

    def withdraw(self, req: Req) -> None:
        """A request that finished is admitted or planned no more."""
        if req.row < 0:  # still queued
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None

    def _take(self, req: Req, budget: int) -> int:
        """How many of the prompt tokens `req` has not computed yet this step computes; the
        request is the chunked one if that is not all of them."""
        remaining = req.prompt_len - req.kv_len
        extend = min(remaining, self.args.chunked_prefill_size, budget)
        self.chunked = req if extend < remaining else None
        return extend
