"""The `tc_piecewise` capture kind: a CUDA graph per compiled piece and bucket, attention run
eagerly between them as the opaque split op.

The phase's forward is the traced general graph (`phase_forward.GeneralGraphForward`, its
pieces compiled once, `--cuda-graph-tc-compiler eager|inductor`, shared by both phases), its
bucketed piece calls routed to `PieceGraphs`, the specializer of the compilation layer's
`BucketDispatcher` (see `srt.compilation.dispatch`): a (piece, bucket)'s first call runs the
general piece, its second calls the specializer, later ones replay what it returned. So the
bucket engine's one warm-up forward is every piece's first hit, and the recording forward,
inside the bucket's capture session, captures each piece as one graph of that session
(attention runs eagerly between them, on the live batch as in an eager step). The bucket is
budgeted as a whole, from the warm-up forward's peak. On the CPU there is nothing to capture
and the general graph runs unpadded.

A piece's arguments: weights and buffers (the model's own tensors) and the outputs of pieces
already captured for the bucket keep their addresses from hit to hit, so the graph reads
them in place; any other tensor is copied into a static buffer, allocated outside the
capture, before each replay. Outputs live in the pool. A replay returns tensors that do not
own that memory (vLLM does the same with weak references), so a captured bucket pins
nothing and later captures reuse the memory. This is safe because every bucket's pieces are
captured in one forward, in order, while the capture hit holds each output (strongly, for
that forward only) until its last use: no later piece of the bucket was captured writing
over a value still to be read, and graphs of one pool never run concurrently.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from srt.compilation.dispatch import PieceFn
from srt.forward_batch import ForwardBatch
from srt.ipc.reports import CaptureInfo
from srt.model_executor.graphs.capture import CaptureContext, SamplesOutsideTheGraph
from srt.model_executor.graphs.config import Backend
from srt.model_executor.graphs.pool import CaptureSession, unowned
from srt.model_executor.graphs.static_batch import real_requests


class PieceGraphs:
    """A `Specializer` (srt.compilation.dispatch) that captures each piece of a bucket into
    the capture session of that bucket."""

    def __init__(self, model: nn.Module) -> None:
        # Weights and buffers (the KV cache included) are the same tensors every hit.
        self.fixed = {t.data_ptr() for t in chain(model.parameters(), model.buffers())}
        self.outputs: dict[int, set[int]] = {}  # per bucket: addresses of captured outputs
        self.captured: dict[int, int] = {}  # per bucket: pieces captured
        self.session: CaptureSession | None = None

    @contextmanager
    def capturing(self, session: CaptureSession) -> Iterator[None]:
        """Capture the pieces that reach their second hit inside this into `session`."""
        self.session = session
        try:
            yield
        finally:
            self.session = None

    def __call__(self, piece: int, bucket: int, general: PieceFn, args: tuple[Any, ...]) -> PieceFn:
        session = self.session
        if session is None:
            raise RuntimeError(
                f"piece {piece} of bucket {bucket} reached its second hit outside the "
                "bucket's capture (the bucket engine specialises a bucket in one go)"
            )
        stable = self.outputs.setdefault(bucket, set())
        in_place = self.fixed | stable
        copied = [
            i
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.data_ptr() not in in_place
        ]
        static = list(args)
        for i in copied:
            static[i] = args[i].clone()
        session.begin()
        out = general(*static)
        graph = session.end()
        self.captured[bucket] = self.captured.get(bucket, 0) + 1
        stable.update(t.data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        kept = tree_map_only(torch.Tensor, unowned, out)
        first = [out]  # the capture hit gets the owning outputs (see the module docstring)

        def replay(*live: Any) -> Any:
            for i in copied:
                static[i].copy_(live[i])
            graph.replay()
            return first.pop() if first else kept

        return replay


class PiecewiseCapture(SamplesOutsideTheGraph):
    name: ClassVar[Backend] = Backend.TC_PIECEWISE
    # One: the dispatcher runs a piece's first hit on the general graph and specialises it on
    # its second, which must be the recording forward.
    warmup_runs: ClassVar[int] = 1

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.pieces = PieceGraphs(ctx.model)
        ctx.forward.route_pieces(self.pieces)

    def _forward(self, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        batch = real_requests(padded)
        self.ctx.attn_backend.init_forward_metadata(batch)
        return self.ctx.forward(batch, bucket)

    def warmup(self, padded: ForwardBatch, bucket: int) -> None:
        self._forward(padded, bucket)

    def record(self, padded: ForwardBatch, bucket: int, session: CaptureSession) -> None:
        with self.pieces.capturing(session):
            self._forward(padded, bucket)

    def replay(self, graph: None, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        return self._forward(padded, bucket)

    def info(self) -> CaptureInfo:
        return CaptureInfo(pieces_captured=sum(self.pieces.captured.values()))
