"""What the scheduler and the model runner agree on about a batch plan, without torch.

The scheduler process plans steps on the host with numpy only; the runner turns each plan into
device tensors. Both import the step kinds and the reserved KV slot from here, so that the
scheduler never has to import the model side (and torch) to name them.
"""

from __future__ import annotations

import enum


class ForwardMode(enum.IntEnum):
    EXTEND = 0  # prefill, or prefill on top of a cached prefix (chunked prefill, prefix hits)
    DECODE = 1  # one new token per request


# Padded tokens write their K and V to this slot of the KV cache; no request is given it, so
# nothing ever reads it.
DUMMY_SLOT = 0
