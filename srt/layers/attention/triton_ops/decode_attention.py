"""Paged decode attention (one query token per request) with split-K (flash decoding), in
one launch.

Each program attends one KV chunk of one request for every query head of one KV head group
(GQA heads share each K/V load). A request uses as many of the bucket's splits as its length
fills (of at least `min_split_tokens` keys each); the others exit at once. A request that fits
one split (most of them at short contexts) is written straight into the output. Otherwise each
chunk stores its normalised partial output and log-sum-exp, and the chunk that arrives last
(a counter per request and KV head, which it sets back to zero) merges them: no second
launch, whose programs would mostly find nothing to merge. The grid depends only on the
batch size and the bucket's split count, never on sequence lengths, so a CUDA graph captured
for a batch size replays for any lengths. A request with `seq_len == 0` (a padded one)
outputs zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops import LOG2E, head_constexprs
from srt.layers.attention.triton_ops.kv_block import attend_kv
from srt.layers.triton_ops.dependent_launch import release_dependents, releases_dependents

BLOCK_N = 64  # keys per inner step; every split is a multiple of it
MAX_SPLITS = 16
# The merge folds the chunks in groups of this many, each group unrolled (its loads all in
# flight at once), the groups in a loop: a batch-1 step's 2-4 chunks take one turn, 16 take
# four. Unrolled over all 16, the kernel was the longest compile of a first start (about
# 1.4 s of Triton's passes and ptxas on one CPU, 0.8 s in groups of 4: the 1B shape,
# `scripts/time_triton_compile.py`), which the start's compile-ahead block waits for.
MERGE_GROUP = tl.constexpr(4)  # a kernel may read a module global only as a constexpr
# The constants below are what `scripts/sweep_decode_attention.py` measures on the GPU (see
# docs/benchmarks.md), over batches 1-128 and contexts 160-4,096 of the 1B and 8B heads.
# Programs a bucket's grid aims for: with more, a long context at batch 8-64 streams
# its keys from many SMs at once instead of walking them in one program per KV head.
TARGET_PROGRAMS = 512
# Keys per split at least, once a bucket has SPLIT_FULL_GPU requests x KV heads: there, a
# split's fixed cost (its loads of the request's length, table row and queries, its partial
# output's round trip and the merge) outweighs a short split's keys; below it, splits as short
# as a block fill an idle GPU.
MIN_SPLIT_TOKENS = 256
SPLIT_FULL_GPU = 256
NUM_WARPS = 2
NUM_STAGES = 2
# Decode's few query rows leave each block latency-bound: the value load beside the key load.
LOAD_V_WITH_K = True


@triton.jit
def _split_len(seq_len, num_splits, min_split, BLOCK_N: tl.constexpr):
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split)


# Triton specialises integer arguments on divisibility by 16; these vary with the split count
# (`num_decode_splits`, which falls as the batch grows), so specialising on them would compile
# a new variant for batch sizes the warm-up before ready did not run.
SPLIT_DEPENDENT = ["stride_pl_req", "stride_pl_head", "num_splits", "min_split"]


@triton.jit(do_not_specialize=SPLIT_DEPENDENT)
def _decode_kernel(
    Q,
    K,
    V,
    req_to_token,
    req_pool_indices,
    seq_lens,
    Out,
    part_out,
    part_lse,
    arrivals,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
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
    min_split,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_V_WITH_K: tl.constexpr,
    RELEASE_DEPENDENTS: tl.constexpr,
):
    # The output projection after it, launched as a dependent, may start (dependent_launch.py).
    release_dependents(RELEASE_DEPENDENTS)
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    split_len = _split_len(seq_len, num_splits, min_split, BLOCK_N)
    num_chunks = tl.cdiv(seq_len, split_len)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # Split 0 of a request with no keys runs too: it writes the request's zeros.
    if (start < end) | (split == 0):
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
            q,
            query_pos,
            kv,
            start,
            end,
            offs_d,
            mask_d,
            scale_log2,
            BLOCK_N,
            DOT_PRECISION,
            LOAD_V_WITH_K,
        )
        o_ptrs = Out + req * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
        if num_chunks <= 1:
            # The whole request in this one split (or none of it: l_i = 0, acc = 0, zeros).
            tl.store(o_ptrs, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=mask)
        else:
            po_ptrs = (
                part_out + req * stride_po_req + heads[:, None] * stride_po_head + offs_d[None, :]
            )
            pl_ptrs = part_lse + req * stride_pl_req + heads * stride_pl_head
            tl.store(po_ptrs + split * stride_po_split, acc / l_i[:, None], mask=mask)
            tl.store(pl_ptrs + split, m_i + tl.log2(l_i), mask=mask_h)
            # The barrier puts every thread's stores before the arrival (one thread's atomic);
            # acq_rel makes them visible to the last chunk to arrive, and its loads see all.
            tl.debug_barrier()
            counter = arrivals + req * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_chunks - 1:
                _merge_chunks(
                    part_out + req * stride_po_req,
                    part_lse + req * stride_pl_req,
                    Out + req * stride_o_tok,
                    kv_head * GROUP,
                    num_chunks,
                    stride_po_head,
                    stride_po_split,
                    stride_pl_head,
                    stride_o_head,
                    GROUP,
                    HEAD_DIM,
                    BLOCK_D,
                    BLOCK_G,
                    MERGE_GROUP,
                )
                tl.store(counter, 0)  # ready for the next layer's launch


@triton.jit
def _merge_chunks(
    part_out,
    part_lse,
    Out,
    first_head,
    num_chunks,
    stride_po_head,
    stride_po_split,
    stride_pl_head,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_CHUNKS: tl.constexpr,
):
    """Out's GROUP heads from `first_head` on = one request's chunks, each weighted by its
    share of the softmax (base 2); the pointers are the request's rows. The chunks are folded
    in one after another into a running max and sum over all of the group's heads at once,
    GROUP_CHUNKS at a time, unrolled (those past `num_chunks` masked off): no load of a group
    waits on another, and no step reduces across threads (a reduction over the chunk axis
    costs a cross-warp exchange per head, which outweighs a batch-1 step's 2-3 chunks)."""
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = first_head + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_g[:, None] & (offs_d < HEAD_DIM)[None, :]
    lse_ptrs = part_lse + heads * stride_pl_head
    po_ptrs = part_out + heads[:, None] * stride_po_head + offs_d[None, :]
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for first in range(0, num_chunks, GROUP_CHUNKS):
        for offset in tl.static_range(GROUP_CHUNKS):
            chunk = first + offset
            valid = chunk < num_chunks
            # .cg: from L2, where the other programs' stores are (not a stale L1 line).
            lse = tl.load(
                lse_ptrs + chunk, mask=mask_g & valid, other=float("-inf"), cache_modifier=".cg"
            )
            partial = tl.load(
                po_ptrs + chunk * stride_po_split,
                mask=mask & valid,
                other=0.0,
                cache_modifier=".cg",
            )
            # A padded head (past GROUP) never sees a finite lse: keep its max finite, no NaNs.
            m_new = tl.where(mask_g, tl.maximum(m, lse), 0.0)
            alpha = tl.exp2(m - m_new)
            weight = tl.exp2(lse - m_new)
            total = total * alpha + weight
            acc = acc * alpha[:, None] + weight[:, None] * partial
            m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(Out + heads[:, None] * stride_o_head + offs_d[None, :], out, mask=mask)


def num_decode_splits(batch_size: int, num_kv_heads: int) -> int:
    """The most KV chunks a request of this batch may use: enough programs to fill the GPU
    when the contexts are long (short ones use fewer, see `min_split_tokens`).

    Depends only on the batch size, so it is fixed for each captured decode bucket.
    """
    return max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS, batch_size * num_kv_heads)))


def min_split_tokens(batch_size: int, num_kv_heads: int) -> int:
    """The fewest keys a split of this batch holds (fixed per bucket, as the split count)."""
    return MIN_SPLIT_TOKENS if batch_size * num_kv_heads >= SPLIT_FULL_GPU else BLOCK_N


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
    arrivals: torch.Tensor,
    scaling: float,
) -> None:
    """q, out: [B, Hq, D] (last dim contiguous); k_cache, v_cache: [slots, Hkv, D];
    req_pool_indices, seq_lens: [B] (seq_len 0 gives a zero output row);
    part_out: [B, Hq, S, D] float32 and part_lse: [B, Hq, S] float32 scratch, S = splits;
    arrivals: [B * Hkv] int32, zeros (the kernel leaves them zero)."""
    batch, num_kv_heads = q.shape[0], k_cache.shape[1]
    num_splits = part_out.shape[2]
    if arrivals.numel() < batch * num_kv_heads or arrivals.dtype != torch.int32:
        raise ValueError(f"arrivals needs {batch * num_kv_heads} int32s, got {arrivals.shape}")
    heads = head_constexprs(q, k_cache)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out,
        part_out,
        part_lse,
        arrivals,
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        req_to_token.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        scaling * LOG2E,
        num_splits,
        min_split_tokens(batch, num_kv_heads),
        **heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads["GROUP"])),  # tl.dot needs >= 16 rows
        BLOCK_G=triton.next_power_of_2(heads["GROUP"]),  # the merge's rows: no dot there
        BLOCK_N=BLOCK_N,
        LOAD_V_WITH_K=LOAD_V_WITH_K,
        RELEASE_DEPENDENTS=releases_dependents(q),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
