"""Paged decode attention (one query token per request) with split-K (flash decoding).

Stage 1 splits each request's KV into `num_splits` chunks and computes, per chunk, the
normalised partial output and its log-sum-exp for every query head of one KV head group
(GQA heads share each K/V load). Stage 2 merges the chunks. The grid depends only on the
batch size and `num_splits`, never on sequence lengths, so a CUDA graph captured for a batch
size replays for any lengths. A request with `seq_len == 0` (a padded one) outputs zeros.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops import LOG2E, head_constexprs
from srt.layers.attention.triton_ops.kv_block import attend_kv

BLOCK_N = 64  # keys per inner step; every split is a multiple of it
MAX_SPLITS = 16  # a power of two: stage 2 loads all chunks as one block
TARGET_PROGRAMS = 256  # stage-1 programs to aim for (about two per SM of an H100/H200)


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    # Both stages must agree on where the chunks lie.
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _chunk_out_ptrs(part_out, req, heads, splits, offs_d):
    # The [B, Hq, S, D] scratch both stages agree on, as (pointer, its first three strides).
    PART_OUT, stride_req, stride_head, stride_split = part_out
    return (
        PART_OUT + req * stride_req + heads * stride_head + splits * stride_split + offs_d[None, :]
    )


# Triton specialises integer arguments on divisibility by 16; these vary with the split count
# (`num_decode_splits`, which falls as the batch grows), so specialising on them would compile
# a new variant for batch sizes the warm-up before ready did not run.
SPLIT_DEPENDENT = ["stride_pl_req", "stride_pl_head", "num_splits"]


@triton.jit(do_not_specialize=SPLIT_DEPENDENT)
def _decode_split_kernel(
    Q,
    K,
    V,
    req_to_token,
    req_pool_indices,
    seq_lens,
    part_out,
    part_lse,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_table,
    stride_po_req,
    stride_po_head,
    stride_po_split,
    stride_pl_req,
    stride_pl_head,
    scale_log2,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        mask_h = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        mask = mask_h[:, None] & mask_d[None, :]
        q_ptrs = Q + req * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask, other=0.0)
        table = req_to_token + tl.load(req_pool_indices + req).to(tl.int64) * stride_table
        kv = ((K, stride_k_slot, stride_k_head), (V, stride_v_slot, stride_v_head), table, kv_head)
        # The one query sits at the last position: every key of the split is visible, and
        # every block starts below `end`, so each row sees a finite score in every block.
        query_pos = tl.full([BLOCK_H], 0, dtype=tl.int32) + (seq_len - 1)
        m_i, l_i, acc = attend_kv(
            q, query_pos, kv, start, end, offs_d, mask_d, scale_log2, BLOCK_N, DOT_PRECISION
        )
        chunk_out = (part_out, stride_po_req, stride_po_head, stride_po_split)
        out_ptrs = _chunk_out_ptrs(chunk_out, req, heads[:, None], split, offs_d)
        tl.store(out_ptrs, acc / l_i[:, None], mask=mask)
        lse_ptrs = part_lse + req * stride_pl_req + heads * stride_pl_head + split
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit(do_not_specialize=SPLIT_DEPENDENT)
def _decode_merge_kernel(
    part_out,
    part_lse,
    seq_lens,
    Out,
    stride_po_req,
    stride_po_head,
    stride_po_split,
    stride_pl_req,
    stride_pl_head,
    stride_o_tok,
    stride_o_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)

    seq_len = tl.load(seq_lens + req)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    # Chunks past the end of the sequence were never written.
    valid = (offs_s < num_splits) & (offs_s * split_len < seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        part_lse + req * stride_pl_req + head * stride_pl_head + offs_s, mask=valid, other=-1e30
    )
    weights = tl.where(valid, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    chunk_out = (part_out, stride_po_req, stride_po_head, stride_po_split)
    out_ptrs = _chunk_out_ptrs(chunk_out, req, head, offs_s[:, None], offs_d)
    partial = tl.load(out_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weights, 0)
    o = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + req * stride_o_tok + head * stride_o_head + offs_d, o, mask=mask_d)


def num_decode_splits(batch_size: int, num_kv_heads: int) -> int:
    """KV chunks per request: enough programs to fill the GPU at small batch sizes.

    Depends only on the batch size, so it is fixed for each captured decode bucket.
    """
    return max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS, batch_size * num_kv_heads)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    scaling: float,
) -> None:
    """q, out: [B, Hq, D] (last dim contiguous); k_cache, v_cache: [slots, Hkv, D];
    req_pool_indices, seq_lens: [B] (seq_len 0 gives a zero output row);
    part_out: [B, Hq, S, D] float32 and part_lse: [B, Hq, S] float32 scratch, S = splits."""
    num_splits = part_out.shape[2]
    heads = head_constexprs(q, k_cache)
    _decode_split_kernel[(q.shape[0], k_cache.shape[1], num_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        part_out,
        part_lse,
        *q.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        req_to_token.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        scaling * LOG2E,
        num_splits,
        **heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads["GROUP"])),  # tl.dot needs >= 16 rows
        BLOCK_N=BLOCK_N,
        num_warps=4,
        num_stages=2,
    )
    _merge_chunks(part_out, part_lse, seq_lens, out, heads)


def _merge_chunks(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    heads: dict[str, Any],
) -> None:
    """Stage 2: out [B, Hq, D] from stage 1's chunks (`heads`: stage 1's head constexprs)."""
    _decode_merge_kernel[(out.shape[0], out.shape[1])](
        part_out,
        part_lse,
        seq_lens,
        out,
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        *out.stride()[:2],
        part_out.shape[2],
        HEAD_DIM=heads["HEAD_DIM"],
        BLOCK_D=heads["BLOCK_D"],
        BLOCK_S=MAX_SPLITS,
        BLOCK_N=BLOCK_N,
        num_warps=4,
    )
