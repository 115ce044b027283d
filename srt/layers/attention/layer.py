"""The attention layer, its custom op `srt::attention` (a split op of the piecewise graph), and
the forward context the op reads.

The op is opaque to the compiler and is called with tensors only (compiled code passes it
nothing else), so what it needs besides them, this step's batch and the attention backend
that runs it, comes from the forward context: whoever runs a forward (the runner's phase
forwards and captures, the tools) sets it around the call. It writes the step's K and V into
the paged cache and the result into `out`; given the positions and the rotary tables, it
rotates q and k first, in the same launch as the KV write (the layer's rotary kernel fused
with it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from srt.compilation.op_registry import register_custom_op, register_split_op
from srt.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend, AttentionInputs
from srt.layers.rotary_embedding import Rope


@dataclass(frozen=True)
class ForwardContext:
    batch: ForwardBatch
    backend: AttentionBackend


_current: ForwardContext | None = None


@contextmanager
def forward_context(batch: ForwardBatch, backend: AttentionBackend) -> Iterator[ForwardBatch]:
    """Run the layers inside this: their attention reads `batch` (and the metadata its
    backend's hook set on it) and is computed by `backend`."""
    global _current
    previous, _current = _current, ForwardContext(batch, backend)
    try:
        yield batch
    finally:
        _current = previous


@contextmanager
def eager_forward_context(batch: ForwardBatch, backend: AttentionBackend) -> Iterator[ForwardBatch]:
    """`forward_context` of an eager (uncaptured) step: `backend`'s metadata for `batch` is
    prepared first."""
    backend.init_forward_metadata(batch)
    with forward_context(batch, backend):
        yield batch


def current_forward() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward_context")
    return _current


@register_split_op
@register_custom_op("attention", mutates_args=("out", "k_cache", "v_cache"))
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float,
    positions: torch.Tensor | None = None,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
) -> None:
    ctx = current_forward()
    rope = None
    if positions is not None and cos_cache is not None and sin_cache is not None:
        rope = Rope(positions, cos_cache, sin_cache)
    x = AttentionInputs(q, k, v, out, k_cache, v_cache, scaling, rope)
    ctx.backend.forward(ctx.batch, x)


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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        """Attention of q over the cache with k and v written into it; with `rope`, q and k
        are rotated first, in the backend's KV write."""
        out = torch.empty_like(q)
        if rope is None:
            attention_op(q, k, v, out, self.k_cache, self.v_cache, self.scaling)
        else:
            attention_op(q, k, v, out, self.k_cache, self.v_cache, self.scaling, *rope)
        return out
