"""The `flashinfer` attention backend: FlashInfer's kernels over our token-level slots.

Optional (`pip install 'srt[flashinfer]'`, FlashInfer 0.5.3). Its kernels are JIT-compiled
with nvcc on first use, a few minutes per module, into the compile cache root (pointed there
before FlashInfer is imported, `srt.compilation.cache`), so that a restart only loads them.
What it needs (a CUDA GPU of sm80 or newer, head size 64, 128 or 256) is checked at startup
(`srt.flashinfer_support`).

Our KV cache is a paged cache of page size 1 (`KVCache`: per layer `[slots, kv_heads,
head_dim]`, given to FlashInfer as `[slots, 1, kv_heads, head_dim]`, layout NHD): a request's
pages are its slots, read from its request-to-token row, so `kv_indptr` is the running sum of
the KV lengths, `kv_indices` the slots themselves (gathered in one Triton launch) and every
last page holds one token. One wrapper kind per kind of step:

- decode: `BatchDecodeWithPagedKVCacheWrapper`, on tensor cores (FlashInfer's FA2 prefill
  kernel) where at least `TENSOR_CORE_GROUP` query heads share a KV head, else its CUDA-core
  decode kernel;
- prefill with no cached prefix in the batch: `BatchPrefillWithRaggedKVCacheWrapper`, causal,
  on the step's new K and V themselves (FA3 on Hopper, FA2 elsewhere);
- prefill over cached prefixes (prefix cache hits, a long prompt's later chunks, decodes riding
  along in a mixed step): `BatchPrefillWithPagedKVCacheWrapper` over the cache once the new K
  and V are in it, causal with each request's queries aligned to the end of its KV (FA2: the
  module tensor-core decode runs, so one compile serves both).

Plans. FlashInfer splits a step's work when it plans it, on the host, from host copies of the
index arrays (so planning never waits for the device), and every layer's `run` reuses the
split. A plan needs the query and KV dtypes and the softmax scale, which the backend learns
from the first layer it runs: a step is planned in its metadata hook once the backend has seen
a layer, else at its first layer (the warm-up's first step, a capture's warm-up). `plan` writes
the split into a pinned host buffer of the wrapper's and queues its copy to the device without
waiting for it; planning that wrapper again before the copy ran would change what it copies
(overlap scheduling launches steps ahead of the device), so each plan records an event that
the wrapper's next plan waits for (`PlannedWrapper`). Eager steps take turns over
`EAGER_WRAPPERS` wrappers of their kind, so that wait is for a copy steps old; a captured
bucket has one wrapper, whose next plan waits for the previous step's copy, which leaves the
host at most about one step ahead of the device in a run of one bucket.

Decode plans after a wrapper's first go through `flashinfer.fast_decode_plan`: the tensor-core
`plan` finds the longest KV length with Python's `max` over a tensor, microseconds per request
(half a millisecond at batch 128). Prefill has no such shortcut (0.5.3's paged `plan` fails when
given the lengths it would otherwise compute), so a prefill over prefixes pays it per request.

CUDA graphs (`full`): decode only (`graph_modes`); prefill runs eagerly, also between the
captured pieces of `breakable` and `tc_piecewise`. Each decode bucket has its own wrapper,
made with `use_cuda_graph=True` over the backend's static buffers (`GraphBuffers`) and planned
in the replay hook, outside the graph; padded requests attend one slot (the first of their
table row 0) and their rows are zeroed.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from srt import flashinfer_support
from srt.batch_layout import ForwardMode
from srt.flashinfer_support import check_flashinfer
from srt.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend, AttentionInputs
from srt.layers.attention.triton_ops.kv_indices import kv_indices

logger = logging.getLogger(__name__)

# The float workspace all wrappers share (their kernels run one after another on the stream):
# split-KV partial outputs, the largest a captured decode bucket's (bucket 256, 32 query heads
# of 128: about 100 MB as 0.5.3 plans it).
WORKSPACE_BYTES = 256 * 2**20
# Eager wrappers per kind of step, planned in turn: with overlap 2 steps deep (the default), a
# step's wrapper is planned again only once that step's result is back.
EAGER_WRAPPERS = 3
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decode runs on tensor cores
INT_ALIGN = 4  # int32s: index arrays start on 16-byte boundaries (one Triton variant for all)


def aligned(n: int) -> int:
    return -(-n // INT_ALIGN) * INT_ALIGN


@dataclass(frozen=True)
class Precision:
    """What a plan is made for: the query and KV dtypes and the softmax scale."""

    q: torch.dtype
    kv: torch.dtype
    scale: float

    def plan_kwargs(self) -> dict[str, Any]:
        return {"q_data_type": self.q, "kv_data_type": self.kv, "sm_scale": self.scale}


class PlannedWrapper:
    """A FlashInfer wrapper, which step's plan it holds, and the event of that plan's copy to
    the device, which its next plan waits for (see the module's docstring)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.copied = torch.cuda.Event()
        self.plans = 0
        self.step: int | None = None

    def plan(self, step: int, plan: Callable[[Any, bool], None]) -> None:
        """`plan(wrapper, first)` for `step`, once the previous plan's copy has run."""
        if self.plans:
            self.copied.synchronize()
        plan(self.wrapper, self.plans == 0)
        self.copied.record()
        self.plans += 1
        self.step = step


class WrapperRing:
    """`EAGER_WRAPPERS` wrappers of one kind, each made on first use, handed out in turn."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.wrappers: list[PlannedWrapper] = []
        self.turn = 0

    def next(self) -> PlannedWrapper:
        if len(self.wrappers) < EAGER_WRAPPERS:
            self.wrappers.append(PlannedWrapper(self.make()))
        wrapper = self.wrappers[self.turn % len(self.wrappers)]
        self.turn += 1
        return wrapper


@dataclass
class DecodePages:
    """A decode step's pages: the host arrays the first plan of a wrapper takes, the device
    arrays `fast_decode_plan` takes (indptr and last page lengths on both)."""

    indptr_host: torch.Tensor  # [R + 1] int32
    indptr: torch.Tensor  # [R + 1] int32, device
    indices: torch.Tensor  # [indptr[-1]] int32, device
    last_page_len_host: torch.Tensor  # [R] int32 ones
    last_page_len: torch.Tensor  # [R] int32 ones, device

    def plan(self, wrapper: Any, first: bool, heads: tuple[int, ...], p: Precision) -> None:
        if first:
            # The full plan picks the kernel module (compiling it the first time) and keeps
            # the dtypes; a captured wrapper's plan copies the indices into its buffer, which
            # `indices` then views, so it gets them in memory of their own.
            indices = self.indices.clone() if wrapper.is_cuda_graph_enabled else self.indices
            wrapper.plan(
                self.indptr_host, indices, self.last_page_len_host, *heads, **p.plan_kwargs()
            )
        else:
            flashinfer_support.module().decode.fast_decode_plan(
                wrapper,
                self.indptr,
                self.indices,
                self.last_page_len,
                *heads,
                **p.plan_kwargs(),
                global_override_indptr_cpu=self.indptr_host,
            )


class StepKind(enum.Enum):
    DECODE = "decode"
    RAGGED = "ragged"  # prefill on the new K and V only
    PAGED = "paged"  # prefill over the cache


@dataclass
class FlashInferStep:
    """One batch's `attn_metadata`: the wrapper that runs it, how to plan it, what it was
    planned for."""

    kind: StepKind
    wrapper: PlannedWrapper
    plan: Callable[[Any, bool, Precision], None]  # (wrapper, its first plan, precision)
    id: int  # the backend's count of steps prepared when it was
    out_cache_loc: torch.Tensor
    rows: int  # query rows the kernel computes; the rest of `out` is zeroed
    pad_rows: torch.Tensor | None = None  # captured decode: [bucket] bool, padded requests
    precision: Precision | None = None  # None: not planned yet


class GraphBuffers:
    """What captured decode wrappers read, for up to `max_bs` requests: indptr, indices and
    last page lengths (ones), and what the replay hook fills them from, in one copy from the
    host: each request's table row and whether it is padding."""

    def __init__(self, max_bs: int, width: int, device: torch.device) -> None:
        self.region = aligned(max_bs + 1)
        # [indptr | table rows | padded] int32, one region each.
        self.ints = torch.zeros(3 * self.region, dtype=torch.int32, device=device)
        self.host = np.zeros(3 * self.region, dtype=np.int32)
        self.indices = torch.zeros(max_bs * width, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.pad_rows = torch.zeros(max_bs, dtype=torch.bool, device=device)

    def view(self, region: int, n: int) -> torch.Tensor:
        return self.ints[region * self.region : region * self.region + n]

    def fill(self, batch: ForwardBatch, bucket: int) -> DecodePages:
        """The live batch's pages, padded to `bucket` requests, in the static buffers."""
        bs, r = batch.batch_size, self.region
        lens = np.ones(bucket, np.int64)  # padded requests read one slot
        lens[:bs] = batch.seq_lens_cpu
        self.host[:] = 0
        self.host[1 : bucket + 1] = np.cumsum(lens)
        self.host[r : r + bs] = batch.req_pool_indices_cpu  # padded requests: row 0
        self.host[2 * r + bs : 2 * r + bucket] = 1
        # A pageable source is staged at once: the host array may change for the next step.
        self.ints.copy_(torch.from_numpy(self.host), non_blocking=True)
        torch.ne(self.view(2, bucket), 0, out=self.pad_rows[:bucket])
        indptr = self.view(0, bucket + 1)
        kv_indices(batch.req_to_token, self.view(1, bucket), indptr, self.indices, int(lens.max()))
        total = int(self.host[bucket])
        return DecodePages(
            torch.from_numpy(self.host[: bucket + 1].copy()),
            indptr,
            self.indices[:total],
            torch.ones(bucket, dtype=torch.int32),
            self.last_page_len[:bucket],
        )


class FlashInferBackend(AttentionBackend):
    graph_modes = frozenset({ForwardMode.DECODE})
    # Its kernels read the KV slots a Triton kernel gathers (`kv_indices`): with that launch
    # skipped they would read whatever the memory held, out of bounds.
    compiles_ahead = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_GROUP
        self.workspace: torch.Tensor | None = None
        self.rings: dict[StepKind, WrapperRing] = {}
        self.precision: Precision | None = None  # learned from the first layer run
        self.steps = 0  # steps prepared
        self.page_heads = (num_heads, num_kv_heads, head_dim, 1)  # page size 1
        self.ones: torch.Tensor | None = None  # last page lengths of eager decode steps
        self.max_bs = 0  # captured decode
        self.graph: GraphBuffers | None = None
        self.graph_wrappers: dict[int, PlannedWrapper] = {}
        # The package, imported here or on the thread the runner started it on (see
        # srt.flashinfer_support): the class itself, which the runner checks the device and
        # graph modes with before the weights load, needs none of it.
        self.fi = flashinfer_support.module()
        # Where FlashInfer put its JIT directory when it was imported (a module constant).
        logger.info(
            "flashinfer %s: kernels JIT-compile into %s",
            flashinfer_support.version(),
            self.fi.jit.env.FLASHINFER_JIT_DIR,
        )

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        check_flashinfer(device_type=device.type, capability=capability)

    @classmethod
    def kernel_versions(cls) -> dict[str, str]:
        # The installed distribution's, read without importing it (the same as its
        # __version__: the package takes it from there).
        return {"flashinfer": flashinfer_support.version() or "not installed"}

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if self.workspace is None:
            # Zeroed: FlashInfer requires it for the workspace's first use.
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self.workspace

    def _wrapper(self, kind: StepKind, device: torch.device) -> PlannedWrapper:
        """The next eager wrapper of `kind`."""
        workspace = self._workspace(device)
        ring = self.rings.get(kind)
        if ring is None:
            ring = self.rings[kind] = WrapperRing(lambda: self._make_wrapper(kind, workspace))
        return ring.next()

    def _make_wrapper(self, kind: StepKind, workspace: torch.Tensor) -> Any:
        if kind is StepKind.DECODE:
            return self.fi.decode.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend="fa2"
            )
        if kind is StepKind.RAGGED:
            return self.fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        return self.fi.prefill.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")

    def _prepare(self, step: FlashInferStep) -> FlashInferStep:
        """Plan `step` now where the precision is known (else its first layer will)."""
        if self.precision is not None:
            self._plan(step, self.precision)
        return step

    def _plan(self, step: FlashInferStep, precision: Precision) -> None:
        step.wrapper.plan(step.id, lambda wrapper, first: step.plan(wrapper, first, precision))
        step.precision = precision

    def _next_id(self) -> int:
        self.steps += 1
        return self.steps

    # ---- eager steps ----

    def _upload_pages(
        self, batch: ForwardBatch, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr on the host, kv_indptr and kv_indices on the device) of the real
        requests: one upload of their table rows and indptr, one gather of their slots."""
        bs = batch.batch_size
        kv_indptr = np.zeros(bs + 1, np.int32)
        np.cumsum(batch.seq_lens_cpu, out=kv_indptr[1:])
        host = np.zeros(aligned(bs) + bs + 1, np.int32)
        host[:bs] = batch.req_pool_indices_cpu
        host[aligned(bs) :] = kv_indptr
        ints = torch.from_numpy(host).to(device, non_blocking=True)
        rows, indptr = ints[:bs], ints[aligned(bs) :]
        indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device=device)
        kv_indices(batch.req_to_token, rows, indptr, indices, int(batch.seq_lens_cpu.max()))
        return torch.from_numpy(kv_indptr), indptr, indices

    def _ones(self, n: int, device: torch.device) -> torch.Tensor:
        if self.ones is None or self.ones.numel() < n:
            self.ones = torch.ones(max(n, 256), dtype=torch.int32, device=device)
        return self.ones[:n]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.out_cache_loc.device
        bs = batch.batch_size
        if batch.mode == ForwardMode.DECODE:
            indptr_host, indptr, indices = self._upload_pages(batch, device)
            pages = DecodePages(
                indptr_host,
                indptr,
                indices,
                torch.ones(bs, dtype=torch.int32),
                self._ones(bs, device),
            )
            heads = self.page_heads
            step = FlashInferStep(
                StepKind.DECODE,
                self._wrapper(StepKind.DECODE, device),
                lambda wrapper, first, p: pages.plan(wrapper, first, heads, p),
                self._next_id(),
                batch.out_cache_loc,
                rows=bs,
            )
        else:
            qo_indptr = np.zeros(bs + 1, np.int32)
            np.cumsum(batch.extend_lens_cpu, out=qo_indptr[1:])
            qo = torch.from_numpy(qo_indptr)
            if not batch.prefix_lens_cpu.any():
                kind, plan = StepKind.RAGGED, self._ragged_plan(qo)
            else:
                kind, plan = StepKind.PAGED, self._paged_plan(qo, batch, device)
            step = FlashInferStep(
                kind,
                self._wrapper(kind, device),
                plan,
                self._next_id(),
                batch.out_cache_loc,
                rows=batch.num_tokens,
            )
        batch.attn_metadata = self._prepare(step)

    def _ragged_plan(self, qo_indptr: torch.Tensor) -> Callable[[Any, bool, Precision], None]:
        heads = self.page_heads[:3]

        def plan(wrapper: Any, first: bool, p: Precision) -> None:
            # Queries and keys are the same new tokens: one indptr for both.
            wrapper.plan(qo_indptr, qo_indptr, *heads, causal=True, **p.plan_kwargs())

        return plan

    def _paged_plan(
        self, qo_indptr: torch.Tensor, batch: ForwardBatch, device: torch.device
    ) -> Callable[[Any, bool, Precision], None]:
        kv_indptr, _, indices = self._upload_pages(batch, device)
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32)
        heads = self.page_heads

        def plan(wrapper: Any, first: bool, p: Precision) -> None:
            wrapper.plan(
                qo_indptr,
                kv_indptr,
                indices,
                last_page_len,
                *heads,
                causal=True,
                **p.plan_kwargs(),
            )

        return plan

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
        if self.graph is None:  # outside any capture: the first capture hook precedes its warm-up
            self.graph = GraphBuffers(self.max_bs, batch.req_to_token.shape[1], device)
        graph = self.graph
        wrapper = self.graph_wrappers.get(bucket)
        if wrapper is None:
            wrapper = self.graph_wrappers[bucket] = PlannedWrapper(
                self.fi.decode.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace(device),
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=self.use_tensor_cores,
                    paged_kv_indptr_buffer=graph.view(0, bucket + 1),
                    paged_kv_indices_buffer=graph.indices,
                    paged_kv_last_page_len_buffer=graph.last_page_len[:bucket],
                    backend="fa2",
                )
            )
        pages = graph.fill(batch, bucket)
        heads = self.page_heads
        step = FlashInferStep(
            StepKind.DECODE,
            wrapper,
            lambda wrapper, first, p: pages.plan(wrapper, first, heads, p),
            self._next_id(),
            batch.out_cache_loc,
            rows=bucket,
            pad_rows=graph.pad_rows[:bucket],
        )
        batch.attn_metadata = self._prepare(step)

    # ---- the layer op ----

    def forward(self, batch: ForwardBatch, x: AttentionInputs) -> None:
        step = batch.attn_metadata
        if not isinstance(step, FlashInferStep):
            raise RuntimeError("flashinfer attention: init_forward_metadata must run first")
        precision = Precision(x.q.dtype, x.k_cache.dtype, x.scaling)
        if step.precision is not None and step.precision != precision:
            raise RuntimeError(
                f"flashinfer attention plans a step once for all its layers: planned for "
                f"{step.precision}, a layer runs with {precision}"
            )
        if step.precision is None or step.wrapper.step != step.id:
            # Not planned yet, or its wrapper was planned for another step since.
            if x.q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "flashinfer attention: the step being captured is not planned (the replay "
                    "hook plans it once a warm-up has run a layer)"
                )
            self.precision = precision
            self._plan(step, precision)
        x = self.write_kv(step.out_cache_loc, x)
        q, o = self.heads(x)
        n = step.rows
        wrapper = step.wrapper.wrapper
        if step.kind is StepKind.RAGGED:
            # The model hands over v as a column slice of its QKV product; the ragged
            # kernel reads dense rows (a copy once per prefill layer, not per decode step).
            t = x.k.shape[0]
            k = x.k.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
            v = x.v.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
            wrapper.run(q[:n], k[:n], v[:n], out=o[:n])
        else:
            # Page size 1, NHD: [slots, 1, kv_heads, head_dim].
            kv = (x.k_cache.unsqueeze(1), x.v_cache.unsqueeze(1))
            wrapper.run(q[:n], kv, out=o[:n])
        o[n:].zero_()
        if step.pad_rows is not None:
            o.masked_fill_(step.pad_rows[:, None, None], 0)
