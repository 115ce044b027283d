"""Rotary position embedding (rotate-half layout, as Llama and Qwen), with llama3 scaling.

One op (see custom_op.py), `rotary_embedding`: the reference below or the Triton kernel behind
the custom op `srt::rotary_embedding`, which rotates q and k in one launch. Both read the
same cos/sin cache, so the llama3 scaling is the cache's and not the kernel's. The graph pass
`rotary_kernel` (`--compile-passes`) puts the kernel where Inductor would compile the
reference.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from srt.compilation.graph_passes import (
    BEFORE_KERNEL_PASSES,
    add_replacement,
    pattern_pass,
    register_graph_pass,
)
from srt.compilation.op_registry import register_custom_op
from srt.layers.custom_op import CustomOp

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import PatternMatcherPass


class Rope(NamedTuple):
    """A rotation that q and k still need, for the attention op to run with its KV write
    (`AttentionBackend.write_kv`: one launch for both on CUDA)."""

    positions: torch.Tensor  # [T]
    cos_cache: torch.Tensor  # [max_position, D / 2] float32
    sin_cache: torch.Tensor


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


def rotate_heads(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference on heads: q [T, Hq, D], k [T, Hkv, D] -> rotated, [T, Hq*D] and [T, Hkv*D]."""
    cos = cos_cache[positions].to(q.dtype)
    sin = sin_cache[positions].to(q.dtype)
    t = q.shape[0]
    return apply_rotary(q, cos, sin).reshape(t, -1), apply_rotary(k, cos, sin).reshape(t, -1)


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: q [T, Hq*D], k [T, Hkv*D] -> rotated, same shapes (D: the caches' D/2 twice)."""
    t, d = q.shape[0], 2 * cos_cache.shape[-1]
    return rotate_heads(positions, q.view(t, -1, d), k.view(t, -1, d), cos_cache, sin_cache)


def _rotated(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous tensors of q's and k's shapes, for the rotated q and k."""
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rotary_fake(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # The op's fake: its outputs take q's and k's shapes, whatever the cos/sin tables.
    return _rotated(q, k)


@register_custom_op("rotary_embedding", mutates_args=(), fake_impl=_rotary_fake, reference=rotary)
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
        freqs = torch.outer(
            torch.arange(max_position, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling)
        )
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def rope_for_attention(self, positions: torch.Tensor) -> Rope | None:
        """The rotation for the attention op to run with its KV write (one launch for both),
        where this layer runs the kernel; None where q and k are rotated here (`forward`)."""
        if self.uses_kernel("rotary_embedding"):
            return Rope(positions, self.cos_cache, self.sin_cache)
        return None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq*D], k: [T, Hkv*D] -> rotated, same shapes."""
        if self.uses_kernel("rotary_embedding"):
            return rotary_kernel(positions, q, k, self.cos_cache, self.sin_cache)
        return rotary(positions, q, k, self.cos_cache, self.sin_cache)


def _rotate_heads_kernel(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    t = q.shape[0]
    return rotary_kernel.op(positions, q.reshape(t, -1), k.reshape(t, -1), cos_cache, sin_cache)


@register_graph_pass("rotary_kernel", after=BEFORE_KERNEL_PASSES, op="rotary_embedding")
@pattern_pass
def use_rotary_kernel(patterns: PatternMatcherPass) -> None:
    """The rotary reference on q and k replaced by `srt::rotary_embedding`."""
    # The pattern starts at the heads, not at `rotary`'s views of q and k: where q and k are
    # already heads (Qwen3's per-head norm gives [T, H, D]), Inductor folds the reshape to
    # [T, H*D] and back away. Elsewhere the views stay outside the match, and the kernel reads
    # them flattened again (a view: no copy).
    add_replacement(
        patterns,
        rotate_heads,
        _rotate_heads_kernel,
        lambda dtype: [
            torch.arange(8),
            torch.empty(8, 4, 16, dtype=dtype),
            torch.empty(8, 2, 16, dtype=dtype),
            torch.empty(32, 8),  # the caches stay float32 in every model dtype
            torch.empty(32, 8),
        ],
    )
