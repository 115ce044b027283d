"""A step's new K and V into the paged cache in one launch (two indexed assignments are two
kernels per layer: at batch 1 of a 1B model, 32 of a step's ~220 kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    K,
    V,
    K_CACHE,
    V_CACHE,
    LOC,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(LOC + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    k = tl.load(K + token * stride_k_token + head * stride_k_head + d, mask=mask)
    v = tl.load(V + token * stride_v_token + head * stride_v_head + d, mask=mask)
    kc = K_CACHE + slot * stride_kc_slot + head * stride_kc_head + d
    vc = V_CACHE + slot * stride_vc_slot + head * stride_vc_head + d
    tl.store(kc, k.to(K_CACHE.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(V_CACHE.dtype.element_ty), mask=mask)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache[loc] = k and v_cache[loc] = v for k, v [T, H, D] and caches [slots, H, D],
    each with a contiguous last dimension."""
    tokens, heads, head_dim = k.shape
    for t in (k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"write_kv needs a contiguous head dimension, got {t.stride()}")
    if tokens == 0:
        return
    _write_kv_kernel[(tokens, heads)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )
