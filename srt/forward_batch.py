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
    # The same per-request fields on the host, of the real requests only: what a backend lays
    # its metadata out from without reading the device.
    seq_lens_cpu: np.ndarray
    prefix_lens_cpu: np.ndarray
    extend_lens_cpu: np.ndarray
    req_pool_indices_cpu: np.ndarray
    req_to_token: torch.Tensor  # [max_requests, context_len] token slot table
    # What the attention backend prepared for this step: set by its `init_forward_metadata*` hooks,
    # read by its `forward`. On the batch rather than the backend, so that a forward reads
    # the metadata of its own batch and no other; None until a hook runs, and on the copies
    # that reshape a batch (`pad_tokens`, `StaticBatch.load`, `real_requests`).
    attn_metadata: Any = None

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.shape[0]


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
