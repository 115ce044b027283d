"""Scheduler-side bookkeeping of the KV cache: which slots and table rows are free.

The runner owns the tensors; the scheduler decides which slot each token's K and V go to and
sends those decisions in the batch plan.
"""

from __future__ import annotations

import numpy as np

from srt.batch_layout import DUMMY_SLOT


class TokenSlotAllocator:
    """Free slots on a stack: `alloc` takes from its top and `free` pushes there, each in time
    proportional to the slots moved, never to the pool's size (a request finishes every few
    steps, and the pool holds millions of slots on a large GPU)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Descending, so that a fresh pool hands out 1, 2, 3...
        self._stack = np.arange(num_slots - 1, DUMMY_SLOT, -1, dtype=np.int32)
        self._top = len(self._stack)

    @property
    def available(self) -> int:
        return self._top

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def alloc(self, n: int) -> np.ndarray:
        if n > self._top:
            raise RuntimeError(f"KV cache out of slots: asked {n}, {self._top} free")
        self._top -= n
        return self._stack[self._top : self._top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        end = self._top + len(slots)
        if end > len(self._stack):
            raise RuntimeError(
                f"freeing {len(slots)} slots, only {self.capacity - self._top} in use"
            )
        self._stack[self._top : end] = slots
        self._top = end


class RequestRowPool:
    """Rows of the request-to-token table, one per admitted request."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)
