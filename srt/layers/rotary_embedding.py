"""Rotary position embedding (rotate-half layout, as Llama and Qwen), with llama3 scaling.

One op (see custom_op.py), `rotary_embedding`: the reference below or the Triton kernel behind
the custom op `srt::rotary_embedding`, which rotates q and k in one launch. Both read the
same cos/sin cache, so the llama3 scaling is the cache's and not the kernel's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from srt.compilation.op_registry import register_custom_op
from srt.layers.custom_op import CustomOp


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled).float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D/2] in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotated(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous tensors of q's and k's shapes, for the rotated q and k."""
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rotary_fake(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # The op's fake: its outputs take q's and k's shapes, whatever the cos/sin tables.
    return _rotated(q, k)


@register_custom_op("rotary_embedding", mutates_args=(), fake_impl=_rotary_fake)
def rotary_kernel(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq*D], k [T, Hkv*D] rotated by the Triton kernel: new contiguous tensors. The
    head size D is the caches' [max_position, D/2] times two."""
    from srt.layers.triton_ops.rotary import rotary_into

    q_out, k_out = _rotated(q, k)
    rotary_into(q_out, k_out, positions, q, k, cos_cache, sin_cache)
    return q_out, k_out


class RotaryEmbedding(CustomOp):
    cos_cache: torch.Tensor  # buffers, [max_position, head_dim / 2]
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        freqs = torch.outer(
            torch.arange(max_position, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling)
        )
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq*D], k: [T, Hkv*D] -> rotated, same shapes."""
        if self.uses_kernel("rotary_embedding"):
            return rotary_kernel(positions, q, k, self.cos_cache, self.sin_cache)
        cos = self.cos_cache[positions].to(q.dtype)
        sin = self.sin_cache[positions].to(q.dtype)
        t = q.shape[0]
        q = apply_rotary(q.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        k = apply_rotary(k.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        return q, k
