"""The paged KV cache tensors (one K and one V pool per layer, token granularity).

Slot `DUMMY_SLOT` (in `srt.batch_layout`) is reserved: padded tokens write their K and V there,
and no request reads it.
"""

from __future__ import annotations

import torch

from srt.model_config import ModelConfig


def kv_bytes_per_token(config: ModelConfig) -> int:
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


class KVCache:
    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device) -> None:
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        self.num_slots = num_slots
        self.k = [
            torch.zeros(shape, dtype=config.dtype, device=device) for _ in range(config.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=config.dtype, device=device) for _ in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
