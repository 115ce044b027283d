"""Scheduler-side bookkeeping of the KV cache: which slots and table rows are free.

The runner owns the tensors; the scheduler decides which slot each token's K and V go to and
sends those decisions in the batch plan.
"""

from __future__ import annotations

import numpy as np

from srt.batch_layout import DUMMY_SLOT


class TokenSlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = np.arange(DUMMY_SLOT + 1, num_slots, dtype=np.int32)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of slots: asked {n}, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: np.ndarray) -> None:
        if len(slots):
            self._free = np.concatenate([self._free, slots.astype(np.int32, copy=False)])


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
