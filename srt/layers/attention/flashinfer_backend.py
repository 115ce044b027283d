"""The `flashinfer` attention backend: FlashInfer's paged kernels over our token-level slots.

Optional (`pip install flashinfer-python`). Our KV cache is a paged cache with page size 1:
a request's pages are its slots, read from its request-to-token row, so `kv_indptr` is the
running sum of sequence lengths and `kv_indices` the slots themselves. Decode batches use
`BatchDecodeWithPagedKVCacheWrapper`, extend batches `BatchPrefillWithPagedKVCacheWrapper`
(causal, queries aligned to the end of their KV).

A step's wrapper and plan arguments (`FlashInferStep`) go on the batch, in
`batch.attn_metadata`, where `forward` reads them; the wrappers and their workspace are the
backend's. `plan` needs the query and KV dtypes, which the backend learns from the first layer
it runs; so a step is planned at its first layer, except a graph replay, which is planned in
the replay hook (the warm-up before every capture has run a layer by then). A plan lives in
the wrappers (and the graph index buffers) until the next one, so a step whose plan another
step's has replaced is planned again before it runs (`plan_id`). Only decode runs inside
`full` CUDA graphs: one wrapper per captured batch size, on static index buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from srt.batch_layout import DUMMY_SLOT, ForwardMode
from srt.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend, AttentionInputs

try:
    import flashinfer
except ImportError as e:
    raise ImportError(
        "--attention-backend flashinfer needs the flashinfer package "
        "(pip install flashinfer-python); or choose --attention-backend triton"
    ) from e

WORKSPACE_BYTES = 128 * 2**20


@dataclass
class FlashInferStep:
    """One batch's `attn_metadata`: what to plan its wrapper with, and what it was planned for."""

    wrapper: Any  # the decode or prefill wrapper planned for this step
    plan_args: tuple
    plan_kwargs: dict[str, Any]
    out_cache_loc: torch.Tensor
    rows: int  # query rows the kernel computes; the rest of `out` is zeroed
    pad_rows: torch.Tensor | None = None  # captured decode: [bucket] bool, padded requests
    planned: dict[str, Any] = field(default_factory=dict)  # dtypes and scale it was planned for
    plan_id: int | None = None  # which of the backend's plans is its (None: not planned)


def indptr(lengths: np.ndarray) -> torch.Tensor:
    """[len + 1] int32 on the host: FlashInfer's plan reads it there (no device sync)."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def kv_indices(batch: ForwardBatch) -> torch.Tensor:
    """The slots of every real request's KV, concatenated: its pages at page size 1. Built
    on the device without a sync, the total being known from the host lengths."""
    bs = batch.batch_size
    total = int(batch.seq_lens_cpu.sum())
    seq_lens = batch.seq_lens[:bs].long()
    rows = torch.repeat_interleave(batch.req_pool_indices[:bs].long(), seq_lens, output_size=total)
    firsts = torch.repeat_interleave(seq_lens.cumsum(0) - seq_lens, seq_lens, output_size=total)
    cols = torch.arange(total, device=seq_lens.device) - firsts
    return batch.req_to_token[rows, cols]


class FlashInferBackend(AttentionBackend):
    graph_modes = frozenset({ForwardMode.DECODE})

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        # Tensor cores pay off once several query heads share each KV head.
        self.use_tensor_cores = num_heads // num_kv_heads >= 4
        self.workspace: torch.Tensor | None = None
        self.decode_wrapper: Any = None
        self.prefill_wrapper: Any = None
        self.dtypes: dict[str, Any] = {}  # q/kv dtypes and scale, from the first layer run
        self.plans = 0  # plans made; a step runs on its plan while that is the latest
        # CUDA graphs (decode only)
        self.max_bs = 0
        self.graph_wrappers: dict[int, Any] = {}
        self.graph_indptr: torch.Tensor | None = None
        self.graph_indices: torch.Tensor | None = None
        self.graph_last_page_len: torch.Tensor | None = None
        self.graph_pad_rows: torch.Tensor | None = None

    def _ensure_wrappers(self, device: torch.device) -> None:
        if self.workspace is not None:
            return
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def _plan(self, step: FlashInferStep) -> None:
        step.wrapper.plan(*step.plan_args, **step.plan_kwargs, **self.dtypes)
        self.plans += 1
        step.planned, step.plan_id = dict(self.dtypes), self.plans

    # ---- eager steps ----

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._ensure_wrappers(batch.out_cache_loc.device)
        bs = batch.batch_size
        pages = (indptr(batch.seq_lens_cpu), kv_indices(batch), torch.ones(bs, dtype=torch.int32))
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        if batch.mode == ForwardMode.DECODE:
            batch.attn_metadata = FlashInferStep(
                self.decode_wrapper, (*pages, *heads), {}, batch.out_cache_loc, rows=bs
            )
        else:
            batch.attn_metadata = FlashInferStep(
                self.prefill_wrapper,
                (indptr(batch.extend_lens_cpu), *pages, *heads),
                {"causal": True},
                batch.out_cache_loc,
                rows=batch.num_tokens,
            )

    # ---- CUDA graphs (decode) ----

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        self.max_bs = max_bs

    def init_forward_metadata_replay(self, batch: ForwardBatch, bucket: int) -> None:
        if batch.mode != ForwardMode.DECODE:
            raise RuntimeError(
                "flashinfer attention is captured for decode only; use "
                "--cuda-graph-backend-prefill breakable or tc_piecewise, or "
                "--attention-backend triton"
            )
        device = batch.out_cache_loc.device
        self._ensure_wrappers(device)
        if (
            self.graph_indptr is None
            or self.graph_indices is None
            or self.graph_last_page_len is None
            or self.graph_pad_rows is None
        ):  # all four are allocated together
            # Outside any capture: the first capture hook comes before its warm-up.
            width = batch.req_to_token.shape[1]
            self.graph_indptr = torch.zeros(self.max_bs + 1, dtype=torch.int32, device=device)
            self.graph_indices = torch.zeros(self.max_bs * width, dtype=torch.int32, device=device)
            self.graph_last_page_len = torch.ones(self.max_bs, dtype=torch.int32, device=device)
            self.graph_pad_rows = torch.zeros(self.max_bs, dtype=torch.bool, device=device)
        wrapper = self.graph_wrappers.get(bucket)
        if wrapper is None:
            wrapper = self.graph_wrappers[bucket] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self.graph_indptr[: bucket + 1],
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:bucket],
            )
        # Padded requests read one page, the dummy slot; their rows are zeroed after the run.
        bs = batch.batch_size
        pad = bucket - bs
        real = kv_indices(batch)
        pages = (
            indptr(np.concatenate([batch.seq_lens_cpu, np.ones(pad, np.int64)])),
            torch.cat([real, real.new_full((pad,), DUMMY_SLOT)]),
            torch.ones(bucket, dtype=torch.int32),
        )
        pad_rows = self.graph_pad_rows[:bucket]
        pad_rows[:bs].fill_(False)
        pad_rows[bs:].fill_(True)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        step = FlashInferStep(
            wrapper, (*pages, *heads), {}, batch.out_cache_loc, rows=bucket, pad_rows=pad_rows
        )
        if self.dtypes:
            self._plan(step)
        batch.attn_metadata = step

    # ---- the layer op ----

    def forward(self, batch: ForwardBatch, x: AttentionInputs) -> None:
        step = batch.attn_metadata
        if not isinstance(step, FlashInferStep):
            raise RuntimeError("flashinfer attention: init_forward_metadata must run first")
        dtypes = {"q_data_type": x.q.dtype, "kv_data_type": x.k_cache.dtype, "sm_scale": x.scaling}
        if step.planned and step.planned != dtypes:
            raise RuntimeError(f"flashinfer attention was planned for {step.planned}, got {dtypes}")
        if step.plan_id != self.plans:  # not planned yet, or another step was planned since
            if x.q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"flashinfer attention: the step being captured is not planned for {dtypes} "
                    "(the replay hook plans it once a warm-up has run a layer)"
                )
            self.dtypes = dtypes
            self._plan(step)
        self.write_kv(step.out_cache_loc, x)
        q, o = self.heads(x)
        # Page size 1, NHD: [slots, 1, Hkv, D].
        kv = (x.k_cache.unsqueeze(1), x.v_cache.unsqueeze(1))
        step.wrapper.run(q[: step.rows], kv, out=o[: step.rows])
        o[step.rows :].zero_()
        if step.pad_rows is not None:
            o.masked_fill_(step.pad_rows[:, None, None], 0)
