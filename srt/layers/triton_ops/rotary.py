"""Rotary embedding (rotate-half) of q and k in one launch: one program per token, every head
of q and of k rotated by the token's cos/sin row of the (llama3-scaled) cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, OUT, num_heads, half, cos, sin, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    offs = heads[:, None] * (2 * half) + dims[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + half, mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    # Each product rounded to the activation dtype before the sum, as the reference's ops.
    x1_cos = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(OUT + offs, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(OUT + offs + half, (x2_cos + x1_sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    POS,
    Q,
    K,
    COS,
    SIN,
    Q_OUT,
    K_OUT,
    stride_q_token,
    stride_k_token,
    stride_cache,
    num_q_heads,
    num_kv_heads,
    half,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = dims < half
    # The float32 cache rounded to the activation dtype first, as the reference does.
    dtype = Q_OUT.dtype.element_ty
    cos = tl.load(COS + pos * stride_cache + dims, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cache + dims, mask=mask, other=0.0).to(dtype).to(tl.float32)
    head_dim = 2 * half
    _rotate_heads(
        Q + token * stride_q_token,
        Q_OUT + token * num_q_heads * head_dim,
        num_q_heads,
        half,
        cos,
        sin,
        BLOCK_QH,
        BLOCK_D,
    )
    _rotate_heads(
        K + token * stride_k_token,
        K_OUT + token * num_kv_heads * head_dim,
        num_kv_heads,
        half,
        cos,
        sin,
        BLOCK_KH,
        BLOCK_D,
    )


def rotary_into(
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """q_out, k_out (contiguous [T, H*D]) = q, k ([T, H*D], unit stride on the last dim)
    rotated by cos/sin_cache[positions] ([max_position, D/2])."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    half = cos_cache.shape[1]
    num_q_heads, num_kv_heads = q.shape[1] // (2 * half), k.shape[1] // (2 * half)
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        cos_cache,
        sin_cache,
        q_out,
        k_out,
        q.stride(0),
        k.stride(0),
        cos_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=4,
    )
