"""The inner loop both attention kernels share: a request's paged keys and values of one KV
head, a block at a time, folded into a running (online) softmax.

The kernels hand the KV side over as one tuple, `kv = (k_cache, v_cache, table, kv_head)`:
each cache a `(pointer, slot stride, head stride)` triple of a [slots, heads, D] tensor, `table`
the request's row of the request-to-token table, `kv_head` the head read.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_head_rows(cache, slots, kv_head, offs_d, mask):
    CACHE, stride_slot, stride_head = cache
    return tl.load(
        CACHE + slots[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :],
        mask=mask,
        other=0.0,
    )


@triton.jit
def attend_kv(
    q,
    query_pos,
    kv,
    kv_start,
    kv_end,
    offs_d,
    mask_d,
    scale_log2,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_V_WITH_K: tl.constexpr = False,
):
    """The rows of `q` ([rows, BLOCK_D]) against keys [kv_start, kv_end), row i seeing keys at
    positions <= query_pos[i]: the running max, sum and unnormalised output (float32), in base
    2 (`scale_log2` folds log2(e) into the softmax scale).

    LOAD_V_WITH_K issues a block's value load beside its key load, so the two memory round
    trips overlap instead of the value's waiting for the scores: decode, whose few query rows
    leave each block latency-bound, wants it; extend, whose K and V tiles of 64 query rows
    already fill the registers, does not."""
    k_cache, v_cache, table, kv_head = kv
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    acc = tl.zeros(q.shape, dtype=tl.float32)
    for block in range(kv_start, kv_end, BLOCK_N):
        offs_n = block + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(table + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = _load_head_rows(k_cache, slots, kv_head, offs_d, kv_mask)
        if LOAD_V_WITH_K:
            v = _load_head_rows(v_cache, slots, kv_head, offs_d, kv_mask)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (offs_n[None, :] <= query_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not LOAD_V_WITH_K:
            v = _load_head_rows(v_cache, slots, kv_head, offs_d, kv_mask)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc
