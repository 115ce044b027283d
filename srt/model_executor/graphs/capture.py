"""The capture axis's contract: what a capture kind implements, and the narrow context it gets.

A capture kind (`full.py`, `breakable.py`, `piecewise.py`) records a bucket around the phase's
forward and replays it. The bucket engine (`graph_runner.GraphRunner`) specialises a bucket
the same way for every kind: the graph pool warms it up (`warmup`, `warmup_runs` times),
checks the memory budget, and records it in one capture session (`record`). The kinds see
only a `CaptureContext`: the phase's forward, the attention backend, the pool, the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from srt.batch_layout import ForwardMode
from srt.forward_batch import ForwardBatch
from srt.ipc.reports import CaptureInfo
from srt.layers.attention.base import AttentionBackend
from srt.layers.sampler import SamplingArrays
from srt.model_executor.graphs.config import Backend, Phase
from srt.model_executor.graphs.phase_forward import ModelForward
from srt.model_executor.graphs.pool import CaptureSession, GraphPool


@dataclass(frozen=True)
class CaptureContext:
    """What a capture kind of one phase works with."""

    phase: Phase
    model: nn.Module  # its weights and buffers (the KV cache too) are read in place
    forward: ModelForward
    attn_backend: AttentionBackend
    pool: GraphPool
    device: torch.device
    largest: int  # the phase's largest bucket
    max_requests: int  # the most requests in one batch (request-to-token table rows)

    @property
    def mode(self) -> ForwardMode:
        return self.phase.mode

    def requests_for(self, bucket: int) -> int:
        """A bucket's request capacity: decode buckets are batch sizes; a prefill bucket of T
        tokens holds at most T requests."""
        return bucket if self.mode == ForwardMode.DECODE else min(bucket, self.max_requests)

    @property
    def max_rows(self) -> int:
        """The request capacity of the largest bucket: the rows of every static output."""
        return self.requests_for(self.largest)

    def label(self, bucket: int, kind: str) -> str:
        """How the log names a capture: `decode bucket 8 (full)`."""
        return f"{self.phase.value} bucket {bucket} ({kind})"


class Capture(Protocol):
    """One capture kind: how a bucket is recorded around the phase's forward and replayed."""

    name: ClassVar[Backend]  # the backend it implements
    # Eager runs before the budget check and the capture: the first compiles and allocates what
    # a capture must not, the last measures the peak memory the capture will need.
    warmup_runs: ClassVar[int]

    def warmup(self, padded: ForwardBatch, bucket: int) -> None:
        """Run `padded` (a batch loaded into the static buffers, padded to `bucket`) eagerly."""
        ...

    def record(self, padded: ForwardBatch, bucket: int, session: CaptureSession) -> Any:
        """Record `padded` in `session`; returns what `replay` is given for the bucket."""
        ...

    def replay(self, graph: Any, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        """Replay what `record` captured for the batch loaded in `padded`; logits of its real
        requests."""
        ...

    def take_greedy(self) -> torch.Tensor | None:
        """The argmax of the logits the last replay returned, where its graph computed it
        (then the step needs no argmax launch of its own); None otherwise."""
        ...

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        """The last replay's logits sampled with `arrays` in a graph of the bucket's own, or
        None where the kind does not (or that capture was skipped)."""
        ...

    def info(self) -> CaptureInfo: ...


class SamplesOutsideTheGraph:
    """For a capture kind whose graphs end at the logits: the caller takes their argmax and
    samples them (`breakable`, `tc_piecewise`)."""

    def take_greedy(self) -> torch.Tensor | None:
        return None

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        return None


class StaticLogits:
    """The one static output of a phase's captured graphs, [rows, vocab], shared by all its
    buckets (so no graph pins pool memory for its output), and its argmax's."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.logits: torch.Tensor | None = None
        self.greedy: torch.Tensor | None = None

    def keep(self, logits: torch.Tensor) -> None:
        """Allocate the buffers on the first warm-up, outside any capture."""
        if self.logits is None:
            self.logits = logits.new_empty((self.rows, logits.shape[-1]))
            self.greedy = torch.empty(self.rows, dtype=torch.int64, device=logits.device)

    def view(self, rows: int) -> torch.Tensor:
        assert self.logits is not None, "keep() allocates it in the first warm-up"
        return self.logits[:rows]

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.logits, self.greedy) if t is not None
        )
