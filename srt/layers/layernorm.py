"""RMSNorm, with the fused residual-add form used between decoder sublayers.

Two ops (see custom_op.py): `rms_norm` (also Qwen3's per-head q/k norm, on a [T, H, D] view)
and `fused_add_rms_norm`, each the reference below or the Triton kernel behind the custom
ops `srt::rms_norm` and `srt::fused_add_rms_norm`. Two graph passes (`--compile-passes`)
put the kernels where Inductor would compile the reference: `fused_add_rms_norm_kernel` and,
after it (its pattern is the tail of the fused one), `rms_norm_kernel`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Reference RMSNorm: statistics in float32, result in the input dtype (as transformers);
    without a weight (one folded into the product after it), the normalised rows alone."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(dtype) if weight is None else weight * x32.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the fused form: `(rms_norm(x + residual), x + residual)`."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _empty(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of x's shape in the dtype the reference computes in."""
    dtype = x.dtype
    for other in others:
        dtype = torch.promote_types(dtype, other.dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _empty(x, weight)


@register_custom_op("rms_norm", mutates_args=(), fake_impl=_rms_norm_fake, reference=rms_norm)
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


@register_custom_op(
    "fused_add_rms_norm",
    mutates_args=(),
    fake_impl=_fused_add_rms_norm_fake,
    reference=fused_add_rms_norm,
)
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
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


# ---- the graph passes: the references Inductor would compile, replaced by the kernels ----
# Patterns are traced on small stand-ins (T = 8 rows of D = 16): the matcher ignores sizes,
# then checks each match again on the graph's own shapes and dtypes.
EPS = {"eps": 1e-6}  # eps is a pattern argument: every model's eps matches


def _addmm_fused_add_rms_norm(
    residual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused reference where the sum is `addmm(residual, a, b)`: Inductor folds a
    residual add into the product before it (o_proj's, down_proj's) on the CPU, and on CUDA
    where the sum has a user that is not pointwise (the piece's output)."""
    summed = torch.addmm(residual, a, b)
    return rms_norm(summed, weight, eps), summed


def _addmm_fused_add_rms_norm_kernel(
    residual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_kernel.op(a @ b, residual, weight, eps)


@register_graph_pass(
    "fused_add_rms_norm_kernel", after=BEFORE_KERNEL_PASSES, op="fused_add_rms_norm"
)
@pattern_pass
def use_fused_add_rms_norm_kernel(patterns: PatternMatcherPass) -> None:
    """The residual add + RMSNorm reference replaced by `srt::fused_add_rms_norm`."""
    add_replacement(
        patterns,
        fused_add_rms_norm,
        fused_add_rms_norm_kernel.op,
        lambda dtype: [
            torch.empty(8, 16, dtype=dtype),
            torch.empty(8, 16, dtype=dtype),
            torch.empty(16, dtype=dtype),
        ],
        EPS,
    )
    add_replacement(
        patterns,
        _addmm_fused_add_rms_norm,
        _addmm_fused_add_rms_norm_kernel,
        lambda dtype: [
            torch.empty(8, 16, dtype=dtype),
            torch.empty(8, 24, dtype=dtype),
            torch.empty(24, 16, dtype=dtype),
            torch.empty(16, dtype=dtype),
        ],
        EPS,
    )


@register_graph_pass(
    "rms_norm_kernel", after=("fused_add_rms_norm_kernel", *BEFORE_KERNEL_PASSES), op="rms_norm"
)
@pattern_pass
def use_rms_norm_kernel(patterns: PatternMatcherPass) -> None:
    """The RMSNorm reference (also per head, on a [T, H, D] view) replaced by `srt::rms_norm`."""
    add_replacement(
        patterns,
        rms_norm,
        rms_norm_kernel.op,
        lambda dtype: [torch.empty(8, 16, dtype=dtype), torch.empty(16, dtype=dtype)],
        EPS,
    )
