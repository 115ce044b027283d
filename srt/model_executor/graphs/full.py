"""The `full` capture kind: one CUDA graph per bucket around the whole forward, logits included.

Attention runs inside the graph, so the attention backend keeps its metadata in static buffers
(`init_graph_state`) and refills them before every replay (`init_forward_metadata_replay`);
the logits are copied, inside the graph, into one static output buffer shared by all buckets,
so no graph pins pool memory, and their argmax is taken there too: an all-greedy step is one
replay and one small copy of ids to the host (`take_greedy`). A step with sampling
(temperature, top-k, top-p, min-p, seeds) replays a second, small graph of the bucket's own,
captured on its first such step: the sampler over the static logits, its parameters uploaded
into fixed buffers (`take_sampled`).

Prefill: buckets are token counts and the number of requests varies up to the bucket's
capacity (min(tokens, --max-running-requests)). Only an attention backend that lays a varying
number of requests out in static buffers can do this (it lists EXTEND in `graph_modes`, as
`triton` does); with any other, `--cuda-graph-backend-prefill full` is rejected at startup.
The same holds for decode (`torch_native` reads host-side lengths, so it is never capturable).

What runs inside the graph is the phase's forward, whichever it is (phase_forward.py): the
model's eager forward; the traced general graph its pieces compiled once (with a tc compiler),
so that a new bucket costs a capture, never a compile; or SGLang's per-bucket compile.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from srt.forward_batch import ForwardBatch
from srt.ipc.reports import CaptureInfo
from srt.layers.attention.layer import forward_context
from srt.layers.sampler import SamplingArrays, SamplingBatch, SamplingBuffers, greedy_ids, sample
from srt.model_executor.graphs.capture import CaptureContext, StaticLogits
from srt.model_executor.graphs.config import Backend, GraphConfigError
from srt.model_executor.graphs.pool import CaptureSession, Graph


class FullCapture:
    name: ClassVar[Backend] = Backend.FULL
    warmup_runs: ClassVar[int] = 2

    def __init__(self, ctx: CaptureContext) -> None:
        attn = ctx.attn_backend
        if ctx.device.type == "cuda" and ctx.mode not in attn.graph_modes:
            raise GraphConfigError(
                f"--cuda-graph-backend-{ctx.phase.value} full: the {type(attn).__name__} "
                f"attention backend cannot run {ctx.phase.value} inside a CUDA graph; use "
                "breakable or tc_piecewise, or an attention backend that can "
                "(--attention-backend triton)"
            )
        self.ctx = ctx
        self.out = StaticLogits(ctx.max_rows)
        self.last: tuple[int, ForwardBatch] | None = None  # the last replay's bucket and batch
        # Sampling in a graph of each bucket's own, captured on the bucket's first step with
        # sampling (None: skipped): the parameters, uploaded into fixed buffers, and the ids.
        self.params = SamplingBuffers(ctx.max_rows, ctx.device)
        self.sampled = torch.zeros(ctx.max_rows, dtype=torch.int64, device=ctx.device)
        self.samplers: dict[int, Graph | None] = {}

    def warmup(self, padded: ForwardBatch, bucket: int) -> None:
        self.ctx.attn_backend.init_forward_metadata_capture(padded)
        logits = self.ctx.forward(padded, bucket)
        self.out.keep(logits)
        greedy_ids(logits)  # whatever JIT-compiles on first use does it outside the capture

    def record(self, padded: ForwardBatch, bucket: int, session: CaptureSession) -> Graph:
        session.begin()
        logits = self.ctx.forward(padded, bucket)
        static = self.out.view(logits.shape[0])
        static.copy_(logits)
        # The greedy ids too (the sampler's own argmax), so that an all-greedy step is one
        # replay and one small copy to the host.
        assert self.out.greedy is not None, "keep() allocates it with the logits"
        greedy_ids(static, out=self.out.greedy[: logits.shape[0]])
        return session.end()

    def replay(self, graph: Graph, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        backend = self.ctx.attn_backend
        backend.init_forward_metadata_replay(padded, bucket)
        # The context is read by nothing on CUDA; by the CPU's emulated replay.
        with forward_context(padded, backend):
            graph.replay()
        self.last = bucket, padded
        return self.out.view(padded.batch_size)

    def take_greedy(self) -> torch.Tensor | None:
        if self.last is None or self.out.greedy is None:
            return None
        return self.out.greedy[: self.last[1].batch_size]

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        """Top-k/top-p/min-p sampling of the last replay's logits, in the bucket's sampler
        graph: the same `sample` as the uncaptured path, on fixed buffers, so the same ids."""
        assert self.last is not None, "only after a replay"
        bucket, padded = self.last
        # The upload stays outside the graph: a replay reads the buffers it fills, the same
        # views for every step of the bucket.
        params = self.params.load(arrays, padded.seq_lens, self.ctx.requests_for(bucket))
        if bucket not in self.samplers:
            self.samplers[bucket] = self._capture_sampler(bucket, params)
        graph = self.samplers[bucket]
        if graph is None:
            return None
        graph.replay()
        return self.sampled[: padded.batch_size]

    def _capture_sampler(self, bucket: int, params: SamplingBatch) -> Graph | None:
        rows = len(params.seeds)
        assert self.out.greedy is not None, "a replay has run, so the warm-up allocated it"
        logits, greedy = self.out.view(rows), self.out.greedy[:rows]

        def record(session: CaptureSession) -> Graph:
            session.begin()
            self.sampled[:rows].copy_(sample(logits, params, greedy))
            return session.end()

        captured = self.ctx.pool.capture(
            self.ctx.label(bucket, "full sampler"), lambda: sample(logits, params, greedy), record
        )
        return None if captured is None else captured.result

    def info(self) -> CaptureInfo:
        buffers = (self.params.floats, self.params.ints, self.sampled)
        return CaptureInfo(
            static_bytes=self.out.nbytes + sum(t.numel() * t.element_size() for t in buffers),
            samplers_captured=tuple(sorted(b for b, g in self.samplers.items() if g is not None)),
        )
