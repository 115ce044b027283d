"""RMSNorm over the last dimension, alone or after the residual add, one row per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.triton_ops.dependent_launch import release_dependents, releases_dependents


@triton.jit
def _rms_norm_kernel(
    X,
    W,
    OUT,
    RES,
    RES_OUT,
    num_heads,
    stride_x_token,
    stride_x_head,
    stride_res_token,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    RELEASE_DEPENDENTS: tl.constexpr,
):
    release_dependents(RELEASE_DEPENDENTS)
    # Row r is (token r // num_heads, head r % num_heads): a [T, H, D] view of packed q/k
    # projections is normalised per head in place of a copy to a contiguous tensor.
    row = tl.program_id(0).to(tl.int64)
    token = row // num_heads
    head = row % num_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + token * stride_x_token + head * stride_x_head + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(RES + token * stride_res_token + cols, mask=mask, other=0.0)
        summed = (x + res.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * n_cols + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    if HAS_RESIDUAL:
        norm_dtype = RES_OUT.dtype.element_ty
    else:
        norm_dtype = X.dtype.element_ty
    normed = (x * tl.rsqrt(variance + eps)).to(norm_dtype).to(tl.float32)
    if HAS_WEIGHT:
        normed *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * n_cols + cols, normed.to(OUT.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x as [T, H, D] or [rows, D], unit stride on D: (x, H (1 for rows), token and head
    strides)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])
    return x, 1, x.stride(0), 0


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, min(max(block // 256, 1), 8)


def rms_norm_into(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """out = rms_norm(x [+ residual]) (times `weight` unless None) and, with a residual,
    residual_out = x + residual.
    `out` and `residual_out` are contiguous, of x's shape; x is 2-D or [T, H, D] with unit
    stride on D; a residual is 2-D like x."""
    x, num_heads, stride_token, stride_head = _as_rows(x)
    n_cols = x.shape[-1]
    rows = out.numel() // n_cols
    if rows == 0:
        return
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        assert residual_out is not None and x.dim() == 2
    block, num_warps = _launch_config(n_cols)
    _rms_norm_kernel[(rows,)](
        x,
        weight if weight is not None else x,
        out,
        residual if residual is not None else x,
        residual_out if residual_out is not None else out,
        num_heads,
        stride_token,
        stride_head,
        residual.stride(0) if residual is not None else 0,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        BLOCK=block,
        RELEASE_DEPENDENTS=releases_dependents(x),
        num_warps=num_warps,
    )
