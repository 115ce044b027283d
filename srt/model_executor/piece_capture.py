"""CUDA graphs for `tc_piecewise`: the specializer that captures each (piece, bucket).

The compilation layer's `BucketDispatcher` calls a specializer on the second hit of a
(piece, bucket) (the first hit ran the general graph: the warm-up) with the piece's general
callable and this hit's arguments (see `srt.compilation.dispatch`). `PieceGraphs` captures
`general(*args)` into the runner's one graph pool and returns the replay. Attention runs
eagerly between pieces, as the opaque split op.

Arguments: weights and buffers (the model's own tensors) and the outputs of pieces already
captured for the bucket keep their addresses from hit to hit, so the graph reads them in
place; any other tensor is copied into a static buffer, allocated outside the pool, before
each replay.

Outputs live in the pool. A replay returns tensors that do not own that memory (vLLM does
the same with weak references), so a captured bucket pins nothing and later captures reuse
the memory. This is safe because every bucket's pieces are captured in one forward, in order,
while the capture hit holds each output (strongly, for that forward only) until its last use:
no later piece of the bucket was captured writing over a value still to be read, and graphs
of one pool never run concurrently.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from srt.compilation.dispatch import PieceFn
from srt.model_executor.breakable_runner import unowned
from srt.model_executor.graph_config import Phase
from srt.model_executor.graph_memory import CaptureSession, GraphPool


class PieceGraphs:
    """A `Specializer` (srt.compilation.dispatch) capturing CUDA graphs for one phase."""

    def __init__(self, pool: GraphPool, model: nn.Module, phase: Phase) -> None:
        self.pool = pool
        self.phase = phase
        # Weights and buffers (the KV cache included) are the same tensors every hit.
        self.fixed = {t.data_ptr() for t in chain(model.parameters(), model.buffers())}
        self.outputs: dict[int, set[int]] = {}  # per bucket: addresses of captured outputs
        self.captured: dict[int, int] = {}  # per bucket: pieces captured
        self.skipped: dict[int, int] = {}  # per bucket: pieces left on the general graph

    def __call__(self, piece: int, bucket: int, general: PieceFn, args: tuple[Any, ...]) -> PieceFn:
        if self.pool.capturer is None:
            return general
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

        def record(session: CaptureSession) -> tuple[Any, Any]:
            session.begin()
            out = general(*static)
            return session.end(), out

        captured = self.pool.capture(
            f"{self.phase.value} bucket {bucket} piece {piece} (tc_piecewise)",
            lambda: general(*static),
            record,
        )
        if captured is None:
            self.skipped[bucket] = self.skipped.get(bucket, 0) + 1
            return general
        self.captured[bucket] = self.captured.get(bucket, 0) + 1
        graph, out = captured.result
        stable.update(t.data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        kept = tree_map_only(torch.Tensor, unowned, out)
        first = [out]  # the capture hit gets the owning outputs (see the module docstring)

        def replay(*live: Any) -> Any:
            for i in copied:
                static[i].copy_(live[i])
            graph.replay()
            return first.pop() if first else kept

        return replay
