"""The layer ops' kernel cases shared by tests/test_layer_ops.py and the opcheck samples of
tests/test_compilation_ops.py: where kernels can run, and each op on strided views as the
model passes them, at odd sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import srt.layers.skinny_matmul_table as skinny_table
from srt.layers.activation import silu_and_mul, silu_and_mul_kernel
from srt.layers.layernorm import fused_add_rms_norm_kernel, rms_norm, rms_norm_kernel
from srt.layers.linear import (
    linear_reference,
    skinny_matmul_kernel,
    skinny_matmul_silu_and_mul_kernel,
)
from srt.layers.rotary_embedding import RotaryEmbedding, rotary_kernel
from srt.layers.skinny_matmul_table import BUCKETS, shape_key, table_path

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


# The skinny matmul cases' products (n weight rows, k inputs, gated) and the tiles a table
# gives them: a tile per row bucket, odd shapes, K a multiple of BLOCK_K in one and not the other.
SKINNY_SHAPES = [(70, 200, False), (2 * 48, 256, True)]
SKINNY_TILES = {1: [4, 128, 2, 1], 2: [16, 64, 4, 2], 4: [16, 64, 4, 2], 8: [32, 128, 4, 2]}


def skinny_entries(shapes: list[tuple[int, int, bool]], dtypes: list[str]) -> dict:
    """A table's `shapes`: the kernel for every bucket of SKINNY_TILES, cuBLAS above."""
    return {
        shape_key(dtype, n, k, gated): {
            str(b): {"choice": "triton", "config": SKINNY_TILES[b]}
            if b in SKINNY_TILES
            else {"choice": "cublas"}
            for b in BUCKETS
        }
        for n, k, gated in shapes
        for dtype in dtypes
    }


@contextmanager
def skinny_table_for(device_name: str, shapes: dict) -> Iterator[Path]:
    """A skinny matmul table for `device_name` ("cpu": the interpreter's) while inside."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = skinny_table.TUNED_DIR
        skinny_table.TUNED_DIR = Path(tmp)
        path = table_path(device_name)
        path.write_text(json.dumps({"device": device_name, "shapes": shapes}))
        skinny_table.load_table.cache_clear()
        skinny_table.choose.cache_clear()
        try:
            yield path
        finally:
            skinny_table.TUNED_DIR = saved
            skinny_table.load_table.cache_clear()
            skinny_table.choose.cache_clear()


def skinny_cases_table(device: str) -> AbstractContextManager[Path]:
    """The table under which the skinny cases of `op_cases` run the kernel on `device`."""
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return skinny_table_for(name, skinny_entries(SKINNY_SHAPES, ["float32", "float16", "bfloat16"]))


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
    # Weights at a model's scale (1 / sqrt(k)): products of order one, as the layers see them.
    w70, w96 = randn(70, 200) / 14, randn(2 * 48, 256) / 16
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
        # Under skinny_cases_table: 5 rows (the tensor cores' path, a partial last tile),
        # 1 row (the dot products'), 3 strided with a bias, 20 (above the buckets: cuBLAS).
        (skinny_matmul_kernel, F.linear, (randn(5, 200), w70, None)),
        (skinny_matmul_kernel, F.linear, (randn(1, 200), w70, None)),
        (skinny_matmul_kernel, F.linear, (randn(3, 260)[:, 30:230], w70, randn(70))),
        (skinny_matmul_kernel, F.linear, (randn(20, 200), w70, None)),
        (
            skinny_matmul_silu_and_mul_kernel,
            lambda x, w, silu_kernel: silu_and_mul(F.linear(x, w)),
            (randn(7, 256), w96, True),
        ),
        (
            skinny_matmul_silu_and_mul_kernel,
            lambda x, w, silu_kernel: silu_and_mul(F.linear(x, w)),
            (randn(1, 256), w96, False),
        ),
        # The norms in the products (the input RMS-normalised, the residual added): 1 and 5
        # rows (an input far from unit scale), then 20 (the norm kernel, cuBLAS's addmm).
        (skinny_matmul_kernel, _fused_linear, (randn(1, 200), w70, None, 0, randn(1, 70), eps)),
        (
            skinny_matmul_kernel,
            _fused_linear,
            (randn(5, 200) * 7, w70, randn(70), 0, randn(5, 70), eps),
        ),
        (skinny_matmul_kernel, _fused_linear, (randn(20, 200), w70, None, 0, randn(20, 70))),
        (skinny_matmul_kernel, _fused_linear, (randn(20, 200) * 7, w70, None, 0, None, eps)),
        (skinny_matmul_silu_and_mul_kernel, _fused_gated, (randn(7, 256) * 7, w96, True, 0, eps)),
        (skinny_matmul_silu_and_mul_kernel, _fused_gated, (randn(1, 256), w96, False, 0, eps)),
    ]


def _fused_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    launch: int,
    residual: torch.Tensor | None,
    rms_eps: float | None = None,
) -> torch.Tensor:
    """The reference of `skinny_matmul_kernel` called with the norm and the residual."""
    return linear_reference(x, w, bias, residual, rms_eps)


def _fused_gated(
    x: torch.Tensor, w: torch.Tensor, silu_kernel: bool, launch: int, rms_eps: float
) -> torch.Tensor:
    return silu_and_mul(linear_reference(x, w, None, rms_eps=rms_eps))
