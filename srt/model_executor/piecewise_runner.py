"""The `tc_piecewise` capture kind: a CUDA graph per compiled piece and bucket, attention run
eagerly between them as the opaque split op.

The phase's forward is the traced general graph (`compiled_forward.GeneralGraphForward`, its
pieces compiled once, `--cuda-graph-tc-compiler eager|inductor`, shared by both phases) with
`PieceGraphs` (piece_capture.py) as the per-piece specializer of the compilation layer's
`BucketDispatcher`: a (piece, bucket)'s first call runs the general piece, its second captures
it, later ones replay it. So a bucket is specialised by two forwards of the live batch, padded
to the bucket (its attention on the real requests, as in an eager step); each piece's capture
is budgeted on its own, and a bucket none of whose pieces could be captured runs uncaptured.
On the CPU there is nothing to capture and the general graph runs unpadded.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from srt.layers.sampler import SamplingArrays
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.graph_memory import Captured
from srt.model_executor.graph_runner import GraphRunner
from srt.model_executor.piece_capture import PieceGraphs
from srt.model_executor.static_batch import real_requests


class PiecewiseCapture:
    """The `tc_piecewise` capture kind of a phase's `GraphRunner`."""

    def __init__(self, runner: GraphRunner, pieces: PieceGraphs) -> None:
        self.runner = runner
        self.pieces = pieces  # the per-piece specializer the runner's forward routes to

    def specialise(self, padded: ForwardBatch, bucket: int) -> Captured[None] | None:
        pool = self.runner.env.pool
        start, before = time.perf_counter(), pool.bytes
        captured = self.pieces.captured.get(bucket, 0)
        for _ in range(2):  # the warm-up hit, then the one that captures each piece
            self._forward(padded, bucket)
        if self.pieces.captured.get(bucket, 0) == captured:
            return None  # every piece over the budget: the bucket runs uncaptured
        return Captured(None, (time.perf_counter() - start) * 1000, pool.bytes - before)

    def replay(self, graph: None, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        return self._forward(padded, bucket)

    def _forward(self, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        batch = real_requests(padded)
        self.runner.env.attn_backend.init_forward_metadata(batch)
        return self.runner.forward(batch, bucket)

    def take_greedy(self) -> torch.Tensor | None:
        return None  # the pieces' graphs end before the logits' argmax

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        return None  # sampled by the caller, from the logits

    def info(self) -> dict[str, Any]:
        return {
            "pieces_captured": sum(self.pieces.captured.values()),
            "pieces_skipped": sum(self.pieces.skipped.values()),
        }
