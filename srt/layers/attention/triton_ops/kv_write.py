"""A step's new K and V into the paged cache in one launch (two indexed assignments are two
kernels per layer: at batch 1 of a 1B model, 32 of a step's ~220 kernels), and the same with
the rotary embedding of q and k before it, also in one launch (`rotary_write_kv`: as two
kernels they took 0.048 ms of the 1B step at batch 1, as one 0.032; 0.100 against 0.070 on
8B; r38b, H100)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.triton_ops.rotary import CacheWrite, rotary_into


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


def rotary_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ([T, H * D], unit stride on the last dim) rotated by cos/sin_cache[positions]
    (`rotary_into`'s rotation, its bits), returned as new contiguous tensors, with the rotated
    k and v ([T, Hkv * D]) written into the caches ([slots, Hkv, D], each slot's heads
    contiguous) at the slots `loc`, as `write_kv` writes them."""
    head_dim = k_cache.shape[2]
    if 2 * cos_cache.shape[1] != head_dim:
        raise ValueError(f"rotary tables of {2 * cos_cache.shape[1]} dims for heads of {head_dim}")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError(f"rotary_write_kv needs a contiguous last dimension, got {t.stride()}")
    for c in (k_cache, v_cache):
        if c.stride(2) != 1 or c.stride(1) != head_dim:
            raise ValueError(f"rotary_write_kv needs contiguous cache slots, got {c.stride()}")
    q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
    cache = CacheWrite(v, k_cache, v_cache, loc)
    rotary_into(q_out, k_out, positions, q, k, cos_cache, sin_cache, cache)
    return q_out, k_out
