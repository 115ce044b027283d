"""The scheduler's account of the KV cache: free slots, table rows, the prefix cache, and the
slots that admitted requests may still take.

Admission reserves a request's whole future (prompt plus max_new_tokens) on top of its cached
prefix, so a decode step never runs out of slots; slots are taken from the reservation as steps
are planned, and a finished request's slots go back (to the prefix cache, when it is on).
"""

from __future__ import annotations

import numpy as np

from srt.scheduler.kv_allocator import RequestRowPool, TokenSlotAllocator
from srt.scheduler.prefix_cache import PrefixCache
from srt.scheduler.req import NO_SLOTS, Req


class KVAccounting:
    def __init__(self, num_slots: int, num_rows: int, enable_prefix_caching: bool) -> None:
        self.allocator = TokenSlotAllocator(num_slots)
        self.rows = RequestRowPool(num_rows)
        self.prefix_cache = PrefixCache(self.allocator) if enable_prefix_caching else None
        # future_need summed over admitted requests, kept up to date as slots are allocated
        # (summing it every step would cost O(running)).
        self.reserved = 0

    @property
    def cached(self) -> int:
        """Slots the prefix cache holds."""
        return self.prefix_cache.size if self.prefix_cache else 0

    def admit(self, req: Req) -> bool:
        """Give a waiting request a table row, its longest cached prefix, and a reservation
        of every slot it may still need; False, holding nothing, if either does not fit."""
        if not self.rows.available:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.attach(req)
        if self._free_slots() < req.future_need:
            if self.prefix_cache is not None:
                self.prefix_cache.detach(req)
            return False
        req.row = self.rows.alloc()
        self.reserved += req.future_need
        return True

    def alloc(self, n: int) -> np.ndarray:
        """`n` slots for an admitted request, within its reservation (evicting cached
        prefixes if the free ones run short)."""
        if self.allocator.available < n and self.prefix_cache is not None:
            self.prefix_cache.evict(n - self.allocator.available)
        self.reserved -= n
        return self.allocator.alloc(n)

    def release(self, req: Req) -> None:
        """Give back a finished or aborted request's KV slots (to the prefix cache if on), its
        table row and what is left of its reservation."""
        if req.row >= 0:
            self.reserved -= req.future_need
            if self.prefix_cache is not None:
                # KV holds the tokens [0, kv_len) of prompt and output: every output token but
                # the last, or the last too if a step that was in flight took it as input. A
                # request that stopped or was aborted while steps ahead of it were in flight
                # (overlap) has KV of ids it never learnt (their results were dropped): only
                # the known tokens are cached, the slots past them are freed.
                assert req.kv_len == req.num_slots, "a slot for every planned token"
                tokens = (req.input_ids + req.output_ids)[: req.kv_len]
                known = len(tokens)
                self.prefix_cache.release(req, tokens, req.slots[:known])
                self.allocator.free(req.slots[known:])
            else:
                self.allocator.free(req.slots)
            self.rows.free(req.row)
        req.slots, req.row, req.table_len = NO_SLOTS, -1, 0

    def flush(self) -> None:
        """Drop every cached prefix; only with no request admitted."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    def _free_slots(self) -> int:
        evictable = self.prefix_cache.evictable_size if self.prefix_cache else 0
        return self.allocator.available + evictable - self.reserved
