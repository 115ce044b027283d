"""Paged causal attention for extend batches (prefill, and prefill on top of a cached prefix).

The new tokens' K and V are already in the cache, so each request's whole KV (prefix and
extend) is read through its row of the request-to-token table. Work is cut into tiles of
BLOCK_M query rows of one request; the host lists the tiles (`extend_tiles`), so the grid is
(tiles, query heads) and a padded count of tiles whose extra entries exit at once keeps the
grid fixed for a captured bucket. A request with `seq_len == 0` outputs zeros for its rows,
which is how the padded tail of a batch is zeroed.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops import LOG2E, head_constexprs
from srt.layers.attention.triton_ops.kv_block import attend_kv

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per inner step
# A tile start that no request reaches: marks the unused tiles of a padded tile list.
UNUSED_TILE = 2**30


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    extend_starts,
    seq_lens,
    tile_req,
    tile_row,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_table,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP

    req = tl.load(tile_req + tile)
    first_row = tl.load(tile_row + tile)
    extend_len = tl.load(extend_lens + req)
    if first_row < extend_len:
        prefix_len = tl.load(prefix_lens + req)
        seq_len = tl.load(seq_lens + req)
        tokens = tl.load(extend_starts + req) + first_row + tl.arange(0, BLOCK_M)
        rows = first_row + tl.arange(0, BLOCK_M)
        mask_m = rows < extend_len
        query_pos = prefix_len + rows
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        mask = mask_m[:, None] & mask_d[None, :]
        q_ptrs = Q + tokens[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask, other=0.0)
        table = req_to_token + tl.load(req_pool_indices + req).to(tl.int64) * stride_table
        kv = ((K, stride_k_slot, stride_k_head), (V, stride_v_slot, stride_v_head), table, kv_head)
        # Causal: the tile's last row sees keys up to its own position. Key 0 is visible to
        # every row, so each row has a finite score in the first block.
        kv_end = tl.minimum(seq_len, prefix_len + first_row + BLOCK_M)
        m_i, l_i, acc = attend_kv(
            q, query_pos, kv, 0, kv_end, offs_d, mask_d, scale_log2, BLOCK_N, DOT_PRECISION
        )
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = Out + tokens[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, o, mask=mask)


def tiles_per_request(extend_lens: np.ndarray) -> np.ndarray:
    return -(-extend_lens // BLOCK_M)


def count_extend_tiles(extend_lens: np.ndarray) -> int:
    return int(tiles_per_request(extend_lens).sum())


def extend_tiles(extend_lens: np.ndarray, num_tiles: int) -> np.ndarray:
    """[2, num_tiles] int32: the request and first row of each BLOCK_M-row query tile, then
    tiles that do nothing up to `num_tiles` (a fixed grid for graph capture)."""
    per_req = tiles_per_request(extend_lens)
    count = int(per_req.sum())
    if count > num_tiles:
        raise ValueError(f"{count} query tiles do not fit the {num_tiles} reserved")
    tiles = np.zeros((2, num_tiles), dtype=np.int32)
    tiles[1, count:] = UNUSED_TILE
    req = np.repeat(np.arange(len(extend_lens), dtype=np.int32), per_req)
    first_tile = np.cumsum(per_req) - per_req
    tiles[0, :count] = req
    tiles[1, :count] = (np.arange(count) - first_tile[req]) * BLOCK_M
    return tiles


def max_extend_tiles(num_tokens: int, num_reqs: int) -> int:
    """An upper bound on the tiles of up to `num_reqs` requests plus the padded tail holding
    `num_tokens` tokens in all: each of the k non-empty ones (k <= min(num_reqs, num_tokens)
    + 1) wastes less than one tile, so there are fewer than num_tokens / BLOCK_M + k."""
    return triton.cdiv(num_tokens, BLOCK_M) + min(num_reqs, num_tokens)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: torch.Tensor,
    scaling: float,
) -> None:
    """q, out: [T, Hq, D] (last dim contiguous); k_cache, v_cache: [slots, Hkv, D];
    per-request [R] tensors (seq_len = prefix_len + extend_len, or 0 for rows to zero);
    tiles: [2, N] from `extend_tiles`."""
    per_request = (req_pool_indices, prefix_lens, extend_lens, extend_starts, seq_lens)
    _extend_kernel[(tiles.shape[1], q.shape[1])](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        *per_request,
        tiles[0],
        tiles[1],
        *q.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        *out.stride()[:2],
        req_to_token.stride(0),
        scaling * LOG2E,
        **head_constexprs(q, k_cache),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        num_warps=4,
        num_stages=2,
    )
