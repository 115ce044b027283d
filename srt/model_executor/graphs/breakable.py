"""The `breakable` capture kind: per bucket, a sequence of CUDA-graph segments split at the
split ops (the ops marked eager-on-graph with `@register_split_op`: attention).

The bucket's forward (the phase's, compiled or not) runs once under a `TorchFunctionMode`
that ends the current segment at each split op, records the op and its arguments instead of
running it, and begins the next segment. On replay each segment replays, then its split op
runs eagerly on the live batch (its metadata from `init_forward_metadata`, as in an eager
step), writing into the output buffer the captured segments read. All segments share the
runner's pool; the recorded arguments are held `unowned` (pool.py), so a captured bucket
pins nothing in the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from srt.compilation.op_registry import split_ops
from srt.forward_batch import ForwardBatch
from srt.ipc.reports import CaptureInfo
from srt.layers.attention.layer import forward_context
from srt.model_executor.graphs.capture import CaptureContext, SamplesOutsideTheGraph, StaticLogits
from srt.model_executor.graphs.config import Backend
from srt.model_executor.graphs.pool import CaptureSession, Graph, unowned
from srt.model_executor.graphs.static_batch import real_requests


@dataclass
class SplitCall:
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> None:
        self.op(*self.args, **self.kwargs)


@dataclass
class SegmentedGraph:
    """segments[0], calls[0], segments[1], ..., calls[-1], segments[-1]."""

    segments: list[Graph]
    calls: list[SplitCall]

    def replay(self) -> None:
        for segment, call in zip(self.segments, self.calls, strict=False):
            segment.replay()
            call()
        self.segments[-1].replay()


class SplitAtOps(TorchFunctionMode):
    """Ends the capture segment at each call of a split op and records the call unrun."""

    def __init__(self, names: set[str], session: CaptureSession) -> None:
        super().__init__()
        self.names = names
        self.session = session
        self.segments: list[Graph] = []
        self.calls: list[SplitCall] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not (isinstance(func, torch._ops.OpOverload) and func.name() in self.names):
            return func(*args, **kwargs)
        if func._schema.returns:
            raise RuntimeError(
                f"breakable capture: split op {func.name()} returns a value; a split op must "
                "write its result into an argument (mutates_args) to be replayed eagerly"
            )
        self.segments.append(self.session.end())
        self.calls.append(SplitCall(func, args, kwargs))
        self.session.begin()
        return None


class BreakableCapture(SamplesOutsideTheGraph):
    name: ClassVar[Backend] = Backend.BREAKABLE
    warmup_runs: ClassVar[int] = 2

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.out = StaticLogits(ctx.max_rows)

    def _eager_batch(self, padded: ForwardBatch) -> ForwardBatch:
        """Eager attention takes the real requests (their token tensors stay padded)."""
        batch = real_requests(padded)
        self.ctx.attn_backend.init_forward_metadata(batch)
        return batch

    def warmup(self, padded: ForwardBatch, bucket: int) -> None:
        self.out.keep(self.ctx.forward(self._eager_batch(padded), bucket))

    def record(self, padded: ForwardBatch, bucket: int, session: CaptureSession) -> SegmentedGraph:
        splitter = SplitAtOps(set(split_ops()), session)
        with splitter:
            session.begin()
            logits = self.ctx.forward(padded, bucket)
            self.out.view(logits.shape[0]).copy_(logits)
            splitter.segments.append(session.end())
        calls = [
            SplitCall(
                c.op,
                tree_map_only(torch.Tensor, unowned, c.args),
                tree_map_only(torch.Tensor, unowned, c.kwargs),
            )
            for c in splitter.calls
        ]
        return SegmentedGraph(splitter.segments, calls)

    def replay(self, graph: SegmentedGraph, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        with forward_context(self._eager_batch(padded), self.ctx.attn_backend):
            graph.replay()
        return self.out.view(padded.batch_size)

    def info(self) -> CaptureInfo:
        return CaptureInfo(static_bytes=self.out.nbytes)
