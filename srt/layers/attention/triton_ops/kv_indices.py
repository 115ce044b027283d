"""The flat list of KV slots that FlashInfer reads as a batch's pages (page size 1), gathered
from the request-to-token table in one launch: each request's first `len` table entries, a
block of them per program (in plain PyTorch it is a repeat_interleave, an arange and a gather,
about ten small kernels per step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512  # table entries per program


@triton.jit
def _kv_indices_kernel(REQ_TO_TOKEN, stride_row, ROWS, KV_INDPTR, OUT, BLOCK: tl.constexpr):
    req = tl.program_id(0)
    row = tl.load(ROWS + req).to(tl.int64)
    start = tl.load(KV_INDPTR + req)
    length = tl.load(KV_INDPTR + req + 1) - start
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < length
    slots = tl.load(REQ_TO_TOKEN + row * stride_row + cols, mask=mask)
    tl.store(OUT + start + cols, slots, mask=mask)


def kv_indices(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: torch.Tensor,
    max_len: int,
) -> None:
    """`out[kv_indptr[i] + j] = req_to_token[rows[i], j]` for every request i and every
    `j < kv_indptr[i + 1] - kv_indptr[i]` (at most `max_len`, known on the host); `rows` [R]
    and `kv_indptr` [R + 1] int32 on the device, `req_to_token` with unit column stride."""
    if req_to_token.stride(1) != 1:
        raise ValueError(f"kv_indices needs a contiguous table row, got {req_to_token.stride()}")
    if rows.shape[0] == 0 or max_len == 0:
        return
    grid = (rows.shape[0], triton.cdiv(max_len, BLOCK))
    _kv_indices_kernel[grid](
        req_to_token, req_to_token.stride(0), rows, kv_indptr, out, BLOCK=BLOCK, num_warps=4
    )
