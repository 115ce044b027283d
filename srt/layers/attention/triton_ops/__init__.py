"""Triton kernels of the attention backends (imported only when a CUDA backend is used), and
what the `triton` backend's launches share."""

from __future__ import annotations

from typing import Any

import torch
import triton

LOG2E = 1.4426950408889634  # the kernels' softmax is in base 2: exp(x) = exp2(x * LOG2E)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: float32 inputs (tiny test models) are multiplied exactly,
    not in TF32, so that float32 runs match the PyTorch reference closely."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_constexprs(q: torch.Tensor, k_cache: torch.Tensor) -> dict[str, Any]:
    """The constexprs both attention kernels take from the heads of q [T, Hq, D] and of the
    cache [slots, Hkv, D]: GROUP query heads per KV head, HEAD_DIM, BLOCK_D (HEAD_DIM rounded up
    to a power of two) and the `tl.dot` precision."""
    head_dim = q.shape[2]
    return {
        "GROUP": q.shape[1] // k_cache.shape[1],
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "DOT_PRECISION": dot_precision(q.dtype),
    }
