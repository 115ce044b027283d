"""Static input buffers of a captured phase, and padding a batch into them.

A captured graph reads fixed addresses, so each live batch is copied into buffers sized for
the phase's largest bucket, padded to its bucket: padded tokens take id 0, position 0 and KV
slot 0 (the dummy slot); padded requests use table row 0 with prefix 0 and one token each
(decode) or none (prefill). The padding contract is spelled out in `AttentionBackend`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from srt.batch_layout import DUMMY_SLOT, ForwardMode
from srt.forward_batch import ForwardBatch, forward_batch_from_host


class StaticBatch:
    def __init__(self, max_tokens: int, max_requests: int, device: torch.device) -> None:
        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.input_ids = zeros(max_tokens, torch.int64)
        self.positions = zeros(max_tokens, torch.int64)
        self.out_cache_loc = zeros(max_tokens, torch.int64)
        self.req_pool_indices = zeros(max_requests, torch.int64)
        self.seq_lens = zeros(max_requests, torch.int32)
        self.prefix_lens = zeros(max_requests, torch.int32)
        self.extend_lens = zeros(max_requests, torch.int32)
        self.extend_start_loc = zeros(max_requests, torch.int32)
        self.arange = torch.arange(max_requests, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())

    def load(self, batch: ForwardBatch, tokens: int, requests: int) -> ForwardBatch:
        """Copy `batch` in, padded to `tokens` tokens and `requests` requests; return the padded
        batch, whose device tensors view the buffers (the same views for every batch of a
        bucket). Its counts and CPU lists stay those of the real requests; it has no attention
        metadata yet (the runner's hook prepares it for the padded batch)."""
        n, r = batch.num_tokens, batch.batch_size
        if n > tokens or r > requests:
            raise ValueError(
                f"a batch of {r} requests and {n} tokens does not fit a bucket of {requests} "
                f"requests and {tokens} tokens"
            )
        decode = batch.mode == ForwardMode.DECODE
        pad_len = 1 if decode else 0
        # Padded requests start at their own token (decode) or past the real tokens (prefill).
        pad_start = self.arange[r:requests] if decode else n
        for buf, live, used, size, pad in (
            (self.input_ids, batch.input_ids, n, tokens, 0),
            (self.positions, batch.positions, n, tokens, 0),
            (self.out_cache_loc, batch.out_cache_loc, n, tokens, DUMMY_SLOT),
            (self.req_pool_indices, batch.req_pool_indices, r, requests, 0),
            (self.seq_lens, batch.seq_lens, r, requests, pad_len),
            (self.prefix_lens, batch.prefix_lens, r, requests, 0),
            (self.extend_lens, batch.extend_lens, r, requests, pad_len),
            (self.extend_start_loc, batch.extend_start_loc, r, requests, pad_start),
        ):
            buf[:used].copy_(live[:used])
            tail = buf[used:size]
            if isinstance(pad, torch.Tensor):
                tail.copy_(pad)
            elif size > used:
                tail.fill_(pad)
        return dataclasses.replace(
            batch,
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            out_cache_loc=self.out_cache_loc[:tokens],
            req_pool_indices=self.req_pool_indices[:requests],
            seq_lens=self.seq_lens[:requests],
            prefix_lens=self.prefix_lens[:requests],
            extend_lens=self.extend_lens[:requests],
            extend_start_loc=self.extend_start_loc[:requests],
            attn_metadata=None,
        )


def real_requests(batch: ForwardBatch) -> ForwardBatch:
    """`batch` with its per-request tensors cut to the real requests (token tensors stay
    padded): the form eager attention takes, its metadata to be prepared for it."""
    r = batch.batch_size
    return dataclasses.replace(
        batch,
        req_pool_indices=batch.req_pool_indices[:r],
        seq_lens=batch.seq_lens[:r],
        prefix_lens=batch.prefix_lens[:r],
        extend_lens=batch.extend_lens[:r],
        extend_start_loc=batch.extend_start_loc[:r],
        attn_metadata=None,
    )


def dummy_batch(
    mode: ForwardMode,
    tokens: int,
    req_to_token: torch.Tensor,
) -> ForwardBatch:
    """A batch of `tokens` tokens to capture a bucket with before any real batch has come:
    decode, `tokens` requests of one token; prefill, as few requests as the table width allows.
    Every token writes its KV to the dummy slot; requests read table row 0."""
    if mode == ForwardMode.DECODE:
        extend = np.ones(tokens, dtype=np.int64)
    else:
        width = req_to_token.shape[1]
        extend = np.full(-(-tokens // width), width, dtype=np.int64)
        extend[-1] = tokens - width * (len(extend) - 1)
    starts = np.concatenate([[0], np.cumsum(extend)[:-1]])
    positions = np.arange(tokens) - np.repeat(starts, extend)
    return forward_batch_from_host(
        mode,
        input_ids=np.zeros(tokens, np.int64),
        positions=positions,
        out_cache_loc=np.full(tokens, DUMMY_SLOT, np.int64),
        req_pool_indices=np.zeros(len(extend), np.int64),
        prefix_lens=np.zeros_like(extend),
        extend_lens=extend,
        req_to_token=req_to_token,
    )
