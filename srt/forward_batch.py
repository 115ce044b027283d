"""The per-step batch on the device: what the runner builds from a plan and attention reads.

The model's forward takes only `(input_ids, positions)`, so it traces with one dynamic token
dimension; everything else a step needs (KV slots, sequence lengths, the attention metadata)
is on the `ForwardBatch`, which the attention op reads from the forward context
(`srt.layers.attention.layer.forward_context`). Defined below both the layers and the runner:
neither knows the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from srt.batch_layout import ForwardMode


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int  # real requests
    num_tokens: int  # real tokens; the token tensors may be padded beyond it
    input_ids: torch.Tensor  # [T] (padded)
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot of each token; padding writes slot 0
    req_pool_indices: torch.Tensor  # [B] row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] prefix + extend
    prefix_lens: torch.Tensor  # [B] tokens already in the KV cache
    extend_lens: torch.Tensor  # [B] tokens computed this step
    extend_start_loc: torch.Tensor  # [B] offset of each request's first token
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_pool_indices_cpu: list[int]
    req_to_token: torch.Tensor  # [max_requests, context_len] token slot table
    # What the attention backend prepared for this step: set by its `init_forward_metadata*` hooks,
    # read by its `forward`. On the batch rather than the backend, so that a forward reads
    # the metadata of its own batch and no other; None until a hook runs, and on the copies
    # that reshape a batch (`pad_tokens`, `StaticBatch.load`, `real_requests`).
    attn_metadata: Any = None

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.shape[0]


def to_device_packed(
    arrays: list[np.ndarray], device: torch.device, dtype: torch.dtype = torch.int64
) -> list[torch.Tensor]:
    """1-D host arrays as `dtype` (int64 or float32) tensors on `device`, in one copy: a step's
    inputs are a dozen small arrays, and each copy costs a host-device round trip."""
    np_dtype = np.int64 if dtype == torch.int64 else np.float32
    packed = torch.from_numpy(np.concatenate(arrays).astype(np_dtype, copy=False))
    return list(packed.to(device, dtype=dtype, non_blocking=True).split([len(a) for a in arrays]))


def forward_batch_from_host(
    mode: ForwardMode,
    input_ids: np.ndarray,
    positions: np.ndarray,
    out_cache_loc: np.ndarray,
    req_pool_indices: np.ndarray,
    prefix_lens: np.ndarray,
    extend_lens: np.ndarray,
    req_to_token: torch.Tensor,
    input_from_prev: np.ndarray | None = None,
    prev_sampled: torch.Tensor | None = None,
) -> ForwardBatch:
    """A ForwardBatch on `req_to_token`'s device from host arrays (uploaded in one copy).

    With `input_from_prev` (one per token: a row of `prev_sampled`, the previous step's
    sampled ids on the device, or -1), those tokens' ids are taken from there instead of
    `input_ids`.
    """
    prefix_lens = prefix_lens.astype(np.int64)
    extend_lens = extend_lens.astype(np.int64)
    seq_lens = prefix_lens + extend_lens
    extend_start = np.concatenate([[0], np.cumsum(extend_lens)[:-1]]).astype(np.int64)
    arrays = [
        input_ids,
        positions,
        out_cache_loc,
        req_pool_indices,
        np.concatenate([seq_lens, prefix_lens, extend_lens, extend_start]),
    ]
    if input_from_prev is not None:
        arrays.append(input_from_prev)
    ids, pos, locs, rows, lens, *src = to_device_packed(arrays, req_to_token.device)
    if src:
        assert prev_sampled is not None, "ids from the previous step need its sampled ids"
        ids = torch.where(src[0] >= 0, prev_sampled[src[0].clamp(min=0)], ids)
    seq, prefix, extend, start = lens.to(torch.int32).split(len(extend_lens))
    return ForwardBatch(
        mode=mode,
        batch_size=len(extend_lens),
        num_tokens=len(input_ids),
        input_ids=ids,
        positions=pos,
        out_cache_loc=locs,
        req_pool_indices=rows,
        seq_lens=seq,
        prefix_lens=prefix,
        extend_lens=extend,
        extend_start_loc=start,
        seq_lens_cpu=seq_lens.tolist(),
        prefix_lens_cpu=prefix_lens.tolist(),
        extend_lens_cpu=extend_lens.tolist(),
        req_pool_indices_cpu=req_pool_indices.tolist(),
        req_to_token=req_to_token,
    )


def pad_tokens(batch: ForwardBatch, padded_tokens: int) -> ForwardBatch:
    """A view of `batch` whose token tensors are padded to `padded_tokens`.

    Padded tokens take id 0, position 0 and KV slot 0 (the dummy slot); the attention op
    attends only the real `num_tokens` and zeroes the tail, so real outputs are unchanged.
    The copy starts without attention metadata: what was prepared for `batch` does not fit it.
    """
    extra = padded_tokens - batch.padded_tokens
    if extra <= 0:
        return batch

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(extra)])

    return dataclasses.replace(
        batch,
        input_ids=pad(batch.input_ids),
        positions=pad(batch.positions),
        out_cache_loc=pad(batch.out_cache_loc),
        attn_metadata=None,
    )
