"""The static inputs of a captured phase, and the batches a capture is made with.

A captured graph reads fixed addresses, so each step of a bucket is laid out, padded to the
bucket, in one device buffer sized for the phase's largest bucket (`StaticBatch`): the padding
rule and the one upload are `step_inputs`'s, and the padding contract is spelled out in
`AttentionBackend`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from srt.batch_layout import DUMMY_SLOT, ForwardMode
from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan
from srt.model_executor.step_inputs import (
    ExtrasLayout,
    InputsLayout,
    apply_extras,
    batch_views,
    extras_layout,
    pack_extras,
    pack_inputs,
    staging,
)


class StaticBatch:
    """The device buffer a phase's captured graphs read their inputs from: a bucket's step is
    laid out from its start (the same views for every step of that bucket), and the rest of
    the step's upload follows the largest bucket's region."""

    # Room for the table writes and sources of a step, beyond which they come in a second
    # upload (a prefill over a long cached prefix writes its whole table row).
    EXTRAS_PER_TOKEN = 4

    def __init__(self, max_tokens: int, max_requests: int, device: torch.device) -> None:
        self.device = device
        self.region = InputsLayout(max_tokens, max_requests).nbytes
        self.extras_room = ExtrasLayout(self.EXTRAS_PER_TOKEN * max_tokens, max_tokens).nbytes
        self.buffer = torch.zeros(self.region + self.extras_room, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def load(
        self,
        plan: BatchPlan,
        tokens: int,
        requests: int,
        req_to_token: torch.Tensor,
        latest_ids: torch.Tensor | None,
    ) -> ForwardBatch:
        """`plan` padded to `tokens` tokens and `requests` requests in the static buffer, its
        table writes applied; the batch's device tensors view the buffer. It has no attention
        metadata yet (the capture kind's hook prepares it for the padded batch)."""
        layout = InputsLayout(tokens, requests)
        extras = extras_layout(plan)
        fits = extras.nbytes <= self.extras_room
        host = staging(self.region + (extras.nbytes if fits else 0), self.device)
        view = host.numpy()
        pack_inputs(plan, layout, view[: layout.nbytes])
        if fits:
            pack_extras(plan, extras, req_to_token.shape[1], view[self.region :])
        self.buffer[: host.numel()].copy_(host, non_blocking=True)
        batch = batch_views(plan, layout, self.buffer, req_to_token)
        if fits:
            apply_extras(batch, extras, self.buffer[self.region :], latest_ids)
        else:
            apart = staging(extras.nbytes, self.device)
            pack_extras(plan, extras, req_to_token.shape[1], apart.numpy())
            apply_extras(batch, extras, apart.to(self.device, non_blocking=True), latest_ids)
        return batch


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


def dummy_plan(mode: ForwardMode, tokens: int, table_width: int) -> BatchPlan:
    """A step of `tokens` tokens to capture a bucket with before any real batch has come:
    decode, `tokens` requests of one token; prefill, as few requests as the table width allows.
    Every token writes its KV to the dummy slot; requests read table row 0, greedy."""
    if mode == ForwardMode.DECODE:
        extend = np.ones(tokens, dtype=np.int32)
    else:
        extend = np.full(-(-tokens // table_width), table_width, dtype=np.int32)
        extend[-1] = tokens - table_width * (len(extend) - 1)
    starts = np.concatenate([[0], np.cumsum(extend)[:-1]])
    return BatchPlan.greedy(
        mode,
        input_ids=np.zeros(tokens, np.int32),
        positions=(np.arange(tokens) - np.repeat(starts, extend)).astype(np.int32),
        out_cache_loc=np.full(tokens, DUMMY_SLOT, np.int32),
        req_pool_indices=np.zeros(len(extend), np.int32),
        prefix_lens=np.zeros_like(extend),
        extend_lens=extend,
    )
