"""The KV slot allocator: slots handed out once until freed, the dummy slot never, and a free
of more than is in use refused."""

from __future__ import annotations

import numpy as np
import pytest

from srt.batch_layout import DUMMY_SLOT
from srt.scheduler.kv_allocator import TokenSlotAllocator


def test_alloc_free_round_trip() -> None:
    alloc = TokenSlotAllocator(9)
    assert alloc.capacity == alloc.available == 8
    first = alloc.alloc(3)
    assert first.tolist() == [1, 2, 3]  # a fresh pool hands out slots in order
    rest = alloc.alloc(5)
    assert alloc.available == 0
    with pytest.raises(RuntimeError, match="asked 1, 0 free"):
        alloc.alloc(1)
    alloc.free(first[1:])
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == [2, 3]
    alloc.free(np.concatenate([first[:1], again, rest]))
    assert alloc.available == 8
    everything = np.sort(alloc.alloc(8))
    assert everything.tolist() == list(range(1, 9)) and DUMMY_SLOT not in everything
    alloc.free(everything)
    with pytest.raises(RuntimeError, match="freeing 1 slots, only 0 in use"):
        alloc.free(np.array([1], np.int32))
