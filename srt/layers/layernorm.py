"""RMSNorm, with the fused residual-add form used between decoder sublayers.

Two ops (see custom_op.py): `rms_norm` (also Qwen3's per-head q/k norm, on a [T, H, D] view)
and `fused_add_rms_norm`, each the reference below or the Triton kernel behind the custom
ops `srt::rms_norm` and `srt::fused_add_rms_norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.compilation.op_registry import register_custom_op
from srt.layers.custom_op import CustomOp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm: statistics in float32, result in the input dtype (as transformers)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _empty(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of x's shape in the dtype the reference computes in."""
    dtype = x.dtype
    for other in others:
        dtype = torch.promote_types(dtype, other.dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _empty(x, weight)


@register_custom_op("rms_norm", mutates_args=(), fake_impl=_rms_norm_fake)
def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` by the Triton kernel; x is [T, D] or [T, H, D] (per head)."""
    from srt.layers.triton_ops.rms_norm import rms_norm_into

    out = _empty(x, weight)
    rms_norm_into(out, x, weight, eps)
    return out


def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty(x, residual, weight), _empty(x, residual)


@register_custom_op("fused_add_rms_norm", mutates_args=(), fake_impl=_fused_add_rms_norm_fake)
def fused_add_rms_norm_kernel(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` by one Triton kernel; x, residual [T, D]."""
    from srt.layers.triton_ops.rms_norm import rms_norm_into

    out, summed = _empty(x, residual, weight), _empty(x, residual)
    rms_norm_into(out, x, weight, eps, residual, summed)
    return out, summed


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`."""
        if residual is None:
            if self.uses_kernel("rms_norm"):
                return rms_norm_kernel(x, self.weight, self.eps)
            return rms_norm(x, self.weight, self.eps)
        if self.uses_kernel("fused_add_rms_norm"):
            return fused_add_rms_norm_kernel(x, residual, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x
