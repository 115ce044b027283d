"""Rotary embedding (rotate-half) of q and k in one launch: one program per token, every head
of q and of k rotated by the token's cos/sin row of the (llama3-scaled) cache. The same launch
may also write the rotated k, and v, into a paged KV cache (`CacheWrite`: the attention
backends' KV write fused with the rotation, see `attention/triton_ops/kv_write.py`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class CacheWrite(NamedTuple):
    """Where the rotated k and v go besides `k_out`: the caches' slots `loc` ([T]); each
    cache [slots, Hkv, D] with a slot's heads contiguous, v [T, Hkv * D] with unit stride on
    its last dim."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    loc: torch.Tensor


@triton.jit
def _rotated_heads(
    X, num_heads, half, cos, sin, dtype: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The heads of one token's row X ([H, 2 * half], rotate-half) rotated by its cos/sin:
    (offsets in the row, mask, first halves, second halves), the halves in `dtype`."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    offs = heads[:, None] * (2 * half) + dims[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + half, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded to the activation dtype before the sum, as the reference's ops.
    x1_cos = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    return offs, mask, (x1_cos - x2_sin).to(dtype), (x2_cos + x1_sin).to(dtype)


@triton.jit
def _store_halves(OUT, offs, mask, half, lo, hi):
    tl.store(OUT + offs, lo.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + offs + half, hi.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    POS,
    Q,
    K,
    COS,
    SIN,
    Q_OUT,
    K_OUT,
    V,
    K_CACHE,
    V_CACHE,
    LOC,
    stride_q_token,
    stride_k_token,
    stride_v_token,
    stride_cache,
    stride_kc_slot,
    stride_vc_slot,
    num_q_heads,
    num_kv_heads,
    half,
    WRITE_CACHE: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    # The float32 cache rounded to the activation dtype first, as the reference does.
    dtype = Q_OUT.dtype.element_ty
    cos = tl.load(COS + pos * stride_cache + dims, mask=dims < half, other=0.0)
    sin = tl.load(SIN + pos * stride_cache + dims, mask=dims < half, other=0.0)
    cos, sin = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)
    head_dim = 2 * half
    offs, mask, lo, hi = _rotated_heads(
        Q + token * stride_q_token, num_q_heads, half, cos, sin, dtype, BLOCK_QH, BLOCK_D
    )
    _store_halves(Q_OUT + token * num_q_heads * head_dim, offs, mask, half, lo, hi)
    offs, mask, lo, hi = _rotated_heads(
        K + token * stride_k_token, num_kv_heads, half, cos, sin, dtype, BLOCK_KH, BLOCK_D
    )
    _store_halves(K_OUT + token * num_kv_heads * head_dim, offs, mask, half, lo, hi)
    if WRITE_CACHE:
        slot = tl.load(LOC + token).to(tl.int64)
        _store_halves(K_CACHE + slot * stride_kc_slot, offs, mask, half, lo, hi)
        v_row = V + token * stride_v_token
        v_lo = tl.load(v_row + offs, mask=mask)
        v_hi = tl.load(v_row + offs + half, mask=mask)
        _store_halves(V_CACHE + slot * stride_vc_slot, offs, mask, half, v_lo, v_hi)


def rotary_into(
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    cache: CacheWrite | None = None,
) -> None:
    """q_out, k_out (contiguous [T, H*D]) = q, k ([T, H*D], unit stride on the last dim)
    rotated by cos/sin_cache[positions] ([max_position, D/2]); with `cache`, the rotated k and
    v also written at its slots."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    half = cos_cache.shape[1]
    num_q_heads, num_kv_heads = q.shape[1] // (2 * half), k.shape[1] // (2 * half)
    # Without a cache write the kernel never reads these four (WRITE_CACHE is off): any
    # tensors of the right kinds stand in, so that one signature serves both launches.
    v, k_cache, v_cache, loc = cache if cache is not None else (k, k_out, k_out, positions)
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        cos_cache,
        sin_cache,
        q_out,
        k_out,
        v,
        k_cache,
        v_cache,
        loc,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        cos_cache.stride(0),
        k_cache.stride(0),
        v_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        half,
        WRITE_CACHE=cache is not None,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=4,
    )
