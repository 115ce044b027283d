"""The attention layer and its custom op `srt::attention`, a split op of the piecewise graph.

The op is opaque to the compiler: it writes the step's K and V into the paged cache and the
result into `out`, reading per-step metadata from the current forward batch.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.compilation.custom_ops import register_custom_op, register_split_op
from srt.model_executor.forward_batch import get_forward_batch


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float,
) -> None:
    return None


@register_split_op
@register_custom_op(
    "attention", mutates_args=("out", "k_cache", "v_cache"), fake_impl=_attention_fake
)
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float,
) -> None:
    batch = get_forward_batch()
    batch.attn_backend.forward(batch, q, k, v, out, k_cache, v_cache, scaling)


class Attention(nn.Module):
    """Paged attention over this layer's KV cache (bound by the runner after allocation)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.register_buffer("k_cache", torch.empty(0), persistent=False)
        self.register_buffer("v_cache", torch.empty(0), persistent=False)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        attention_op(q, k, v, out, self.k_cache, self.v_cache, self.scaling)
        return out
