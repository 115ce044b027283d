"""Gated activations.

One op (see custom_op.py), `silu_and_mul`: the reference below or the Triton kernel behind
the custom op `srt::silu_and_mul`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.compilation.op_registry import register_custom_op
from srt.layers.custom_op import CustomOp


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate, up]` packed on the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@register_custom_op("silu_and_mul", mutates_args=(), fake_impl=_silu_and_mul_fake)
def silu_and_mul_kernel(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` by the Triton kernel: a new contiguous tensor."""
    from srt.layers.triton_ops.silu_and_mul import silu_and_mul_into

    out = _silu_and_mul_fake(x)
    silu_and_mul_into(out, x)
    return out


class SiluAndMul(CustomOp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernel("silu_and_mul"):
            return silu_and_mul_kernel(x)
        return silu_and_mul(x)
