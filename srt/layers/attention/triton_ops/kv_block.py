"""The inner step both attention kernels share: one block of paged keys and values folded
into a running (online) softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_kv_block(
    q,
    m_i,
    l_i,
    acc,
    K,
    V,
    table,
    block,
    kv_end,
    query_pos,
    kv_head,
    offs_d,
    mask_d,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    scale_log2,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys [block, block + BLOCK_N) below `kv_end`, read through the request's `table` row;
    row i of `q` sees keys at positions <= query_pos[i]. Returns the updated (m_i, l_i, acc)
    in base 2 (`scale_log2` folds log2(e) into the softmax scale)."""
    offs_n = block + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_end
    slots = tl.load(table + offs_n, mask=mask_n, other=0).to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(
        K + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    visible = (offs_n[None, :] <= query_pos[:, None]) & mask_n[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
