"""Programmatic dependent launch (Hopper's griddepcontrol) from the side of the kernel before.

A kernel launched as a programmatic dependent (the skinny matmul kernel under
`--skinny-matmul-launch pdl`) may start once every program of the kernel before it has called
`launch_dependents` or ended, and waits in `gdc_wait` for that kernel's end before it reads
what it wrote. The step's RMSNorm and decode attention kernels call it as they start: they fill
one wave at a decode batch (1 to 16 programs, or a few hundred), so a dependent that starts
beside them takes no SM they still need, and (at one row) loads its first weight tile while they
run. Before a kernel launched plainly, the call does nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from srt.op_selection import PDL_MIN_CAPABILITY


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def releases_dependents(t: torch.Tensor) -> bool:
    """Whether a kernel launched on `t`'s device calls `launch_dependents` (griddepcontrol is
    sm_90's: a GPU below it, and Triton's interpreter, go without)."""
    return t.is_cuda and _capability(t.device.index or 0) >= PDL_MIN_CAPABILITY


@triton.jit
def release_dependents(RELEASE: tl.constexpr):
    """Let a programmatic dependent of this kernel start (a constexpr-off call compiles to
    nothing)."""
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
