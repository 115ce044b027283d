"""Gated activations.

One op (see custom_op.py), `silu_and_mul`: the reference below or the Triton kernel behind
the custom op `srt::silu_and_mul`. The graph pass `silu_and_mul_kernel` (`--compile-passes`)
puts the kernel where Inductor would compile the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate, up]` packed on the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@register_custom_op(
    "silu_and_mul", mutates_args=(), fake_impl=_silu_and_mul_fake, reference=silu_and_mul
)
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


@register_graph_pass("silu_and_mul_kernel", after=BEFORE_KERNEL_PASSES, op="silu_and_mul")
@pattern_pass
def use_silu_and_mul_kernel(patterns: PatternMatcherPass) -> None:
    """The SiLU-and-mul reference replaced by `srt::silu_and_mul`."""
    add_replacement(
        patterns,
        silu_and_mul,
        silu_and_mul_kernel.op,
        lambda dtype: [torch.empty(8, 32, dtype=dtype)],
    )
