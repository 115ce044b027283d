"""The layer ops' kernel cases shared by tests/test_layer_ops.py and the opcheck samples of
tests/test_compilation_ops.py: where kernels can run, and each op on strided views as the
model passes them, at odd sizes."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

from srt.layers.activation import silu_and_mul, silu_and_mul_kernel
from srt.layers.layernorm import fused_add_rms_norm_kernel, rms_norm, rms_norm_kernel
from srt.layers.rotary_embedding import RotaryEmbedding, rotary_kernel

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETED, reason="needs triton and TRITON_INTERPRET=1 to run kernels on a CPU"
        ),
    ),
]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def kernel_device() -> str:
    """Where the kernels can run in this process (skips the test where nowhere)."""
    if HAS_TRITON and torch.cuda.is_available():
        return "cuda"
    if INTERPRETED:
        return "cpu"
    pytest.skip("needs triton with CUDA, or TRITON_INTERPRET=1")


def op_cases(dtype: torch.dtype, device: str) -> list[tuple[Callable, Callable, tuple]]:
    """(kernel op, reference, args) on strided views as the model passes them, odd sizes."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    qkv = randn(7, (6 + 2 * 2) * 24)  # 6 q heads, 2 kv heads, head_dim 24, packed
    q, k, _ = qkv.split([6 * 24, 2 * 24, 2 * 24], dim=-1)
    rotary = RotaryEmbedding(24, 300, 500000.0, LLAMA3_SCALING).to(device)
    positions = torch.tensor([0, 299, 3, 3, 31, 32, 100], device=device)
    per_head = q.reshape(7, 6, 24)  # Qwen3's q norm: a [T, H, D] view of the packed q
    eps = 1e-5
    return [
        (rms_norm_kernel, rms_norm, (randn(5, 333), randn(333), eps)),
        (rms_norm_kernel, rms_norm, (per_head, randn(24), eps)),
        (
            fused_add_rms_norm_kernel,
            lambda x, r, w, e: (rms_norm(x + r, w, e), x + r),
            (randn(9, 1000), randn(9, 1000), randn(1000), eps),
        ),
        (
            rotary_kernel,
            lambda p, q, k, c, s: rotary.forward(p, q, k),
            (positions, q, k, rotary.cos_cache, rotary.sin_cache),
        ),
        (silu_and_mul_kernel, silu_and_mul, (randn(3, 2 * 1500),)),
    ]
