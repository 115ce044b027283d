"""Triton kernels of the `triton` attention backend (imported only when that backend is used)."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: float32 inputs (tiny test models) are multiplied exactly,
    not in TF32, so that float32 runs match the PyTorch reference closely."""
    return "ieee" if dtype == torch.float32 else "tf32"
