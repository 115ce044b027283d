"""How a phase (prefill, decode) turns a batch into logits: one runner, two choices.

A phase's `GraphRunner` is its forward (the compile axis, `compiled_forward.make_forward`:
eager, the compiled general graph, or SGLang's per-bucket compile) and its capture kind (the
capture axis, a `Capture`: `full`, `breakable` or `tc_piecewise`; none for `disabled`). The two
are independent: any capture kind records whatever forward the phase computes.

The runner owns what every capture kind shares, the lazy per-bucket state machine: a batch is
padded to the smallest bucket that holds it (`StaticBatch`, the one padding rule); the first
batch of a bucket has it specialised by the capture kind (warm-up and capture; unseen ->
captured, or skipped when the graph memory budget says no) and recorded in the compile
cache's manifest; every later batch of that bucket replays; batches beyond the largest bucket,
of a skipped bucket, or on a device with nothing to capture run the forward uncaptured.

`run(batch) -> logits [B, V]` (valid until the next run), `take_greedy()` (their argmax where
the graph computed it), `take_sampled(arrays)` (them sampled in a graph, where the capture kind
does that), `run_general(batch)` (the same logits through the uncaptured general
path, moving no bucket state, counter or manifest entry: the warm-up before ready runs it),
`prewarm(buckets)` (specialise those now: `upfront` / `manifest` capture) and `info()`.

How decode runs, start to end: `ModelRunner.launch` (model_runner.py) builds the batch from the
scheduler's plan, `GraphRunner.run` here pads it into the bucket's static buffers,
`FullCapture.replay` (cuda_graph_runner.py) refills the attention backend's static metadata and
replays the graph, and `ModelRunner.sample` takes the graph's argmax or replays its sampler.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.batch_layout import ForwardMode
from srt.model_executor.compiled_forward import ModelForward, make_forward
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.graph_config import Backend, Phase, PhaseConfig
from srt.model_executor.graph_memory import Captured, GraphPool
from srt.model_executor.static_batch import StaticBatch, dummy_batch

if TYPE_CHECKING:
    from srt.compilation.cache import CompileCache
    from srt.compilation.piecewise_model import PiecewiseModel
    from srt.layers.attention.base import AttentionBackend
    from srt.layers.sampler import SamplingArrays
    from srt.models.llama import LlamaForCausalLM
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def phase_mode(phase: Phase) -> ForwardMode:
    return ForwardMode.DECODE if phase is Phase.DECODE else ForwardMode.EXTEND


@dataclass
class RunnerEnv:
    """What the phase runners of one model runner are built from (shared by both phases)."""

    model: LlamaForCausalLM
    attn_backend: AttentionBackend
    req_to_token: torch.Tensor
    max_requests: int  # the most requests in one batch
    pool: GraphPool
    cache: CompileCache | None  # pieces and the bucket manifest; None when all phases are eager
    args: ServerArgs
    configs: dict[Phase, PhaseConfig]  # both phases' (tc_piecewise compiles for both at once)
    piecewise: PiecewiseModel | None = None  # traced once, by the first phase that compiles

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device


class Capture(Protocol):
    """One capture kind: how a bucket is recorded and replayed around the phase's forward."""

    def specialise(self, padded: ForwardBatch, bucket: int) -> Captured[Any] | None:
        """Warm up and capture `bucket` with `padded` (a batch loaded into the static buffers,
        padded to the bucket); None when the capture was skipped (over the memory budget)."""
        ...

    def replay(self, graph: Any, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        """Replay what `specialise` captured for the batch loaded in `padded`; logits of its
        real requests."""
        ...

    def take_greedy(self) -> torch.Tensor | None:
        """The argmax of the logits the last replay returned, where its graph computed it
        (then the step needs no argmax launch of its own); None otherwise."""
        ...

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        """The last replay's logits sampled with `arrays` in a graph of the bucket's own, or
        None where the kind does not (or the capture was skipped)."""
        ...

    def info(self) -> dict[str, Any]:
        """What to add to the phase's info; `static_bytes`: buffers it keeps outside the pool."""
        ...


class BucketState(enum.StrEnum):
    UNSEEN = "unseen"
    CAPTURED = "captured"
    SKIPPED = "skipped"  # over the graph memory budget: runs uncaptured


@dataclass
class BucketRecord:
    state: BucketState = BucketState.UNSEEN
    capture_ms: float | None = None
    pool_growth: int = 0  # bytes the graph pool grew by when this bucket was captured
    replays: int = 0


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
        kept = [t for t in (self.logits, self.greedy) if t is not None]
        return sum(t.numel() * t.element_size() for t in kept)


class GraphRunner:
    """A phase's forward under its capture kind (None: `disabled`), bucket by bucket."""

    def __init__(
        self,
        phase: Phase,
        config: PhaseConfig,
        env: RunnerEnv,
        forward: ModelForward,
        capture: Callable[[GraphRunner], Capture] | None,
    ) -> None:
        self.phase = phase
        self.mode = phase_mode(phase)
        self.config = config
        self.env = env
        self.forward = forward
        self.records = {b: BucketRecord() for b in config.bs}
        self.graphs: dict[int, Any] = {}
        self.uncaptured_runs = 0  # beyond the largest bucket, skipped buckets, or no capturer
        self.replayed = False  # whether the last run was a replay (its graph's argmax is live)
        self.static: StaticBatch | None = None
        self.capture: Capture | None = None
        if capture is None:
            return
        if env.pool.capturer is None:
            logger.info(
                "%s %s: nothing to capture on %s; running the uncaptured path",
                phase.value,
                config.backend.value,
                env.device.type,
            )
            return
        largest = config.bs[-1]
        self.static = StaticBatch(largest, self.requests_for(largest), env.device)
        self.capture = capture(self)

    @property
    def backend(self) -> str:
        return self.config.backend.value

    def requests_for(self, bucket: int) -> int:
        """A bucket's request capacity: decode buckets are batch sizes; a prefill bucket of T
        tokens holds at most T requests."""
        return bucket if self.mode == ForwardMode.DECODE else min(bucket, self.env.max_requests)

    def bucket_of(self, batch: ForwardBatch) -> int | None:
        n = batch.batch_size if self.mode == ForwardMode.DECODE else batch.num_tokens
        return self.config.bucket_for(n)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of each request's last token."""
        self.replayed = False
        bucket = self.bucket_of(batch) if self.capture is not None else None
        if self.capture is None or self.static is None or bucket is None:
            return self.run_uncaptured(batch)
        record = self.records[bucket]
        if record.state is BucketState.UNSEEN:
            if self.env.cache is not None:  # the next start can prewarm it (manifest mode)
                self.env.cache.manifest.record(self.phase.value, bucket)
            self.specialise(bucket, batch)
        if record.state is BucketState.SKIPPED:
            return self.run_uncaptured(batch)
        record.replays += 1
        padded = self.static.load(batch, bucket, self.requests_for(bucket))
        logits = self.capture.replay(self.graphs[bucket], padded, bucket)
        self.replayed = True
        return logits

    def run_uncaptured(self, batch: ForwardBatch) -> torch.Tensor:
        if self.config.backend is not Backend.DISABLED:
            self.uncaptured_runs += 1
        batch.attn_backend.init_forward_metadata(batch)
        return self.forward(batch, None)

    def run_general(self, batch: ForwardBatch) -> torch.Tensor:
        self.replayed = False
        batch.attn_backend.init_forward_metadata(batch)
        return self.forward.general(batch)

    def take_greedy(self) -> torch.Tensor | None:
        """The argmax of the last run's logits where its replay computed it; None otherwise."""
        return self.capture.take_greedy() if self.replayed and self.capture is not None else None

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        """The last run's logits sampled with `arrays` inside a graph, where its capture kind
        does that for the replayed bucket; None otherwise (the caller samples them)."""
        if not self.replayed or self.capture is None:
            return None
        return self.capture.take_sampled(arrays)

    def prewarm(self, buckets: list[int]) -> None:
        if self.capture is None:
            return
        # Largest first: the smaller captures then reuse its pool memory.
        for bucket in sorted(set(buckets) & set(self.records), reverse=True):
            if self.records[bucket].state is BucketState.UNSEEN:
                batch = dummy_batch(self.mode, bucket, self.env.req_to_token, self.env.attn_backend)
                self.specialise(bucket, batch)

    def specialise(self, bucket: int, batch: ForwardBatch) -> None:
        """Warm up and capture `bucket` with `batch` (a live batch of that bucket, or a dummy)."""
        assert self.capture is not None and self.static is not None, "only capturing runners"
        padded = self.static.load(batch, bucket, self.requests_for(bucket))
        captured = self.capture.specialise(padded, bucket)
        record = self.records[bucket]
        if captured is None:
            record.state = BucketState.SKIPPED
            return
        self.graphs[bucket] = captured.result
        record.state = BucketState.CAPTURED
        record.capture_ms = round(captured.ms, 3)
        record.pool_growth = captured.pool_growth

    def info(self) -> dict[str, Any]:
        if self.config.backend is Backend.DISABLED:
            return {"backend": self.backend, **self.forward.info()}
        records = self.records.items()
        capture = self.capture.info() if self.capture is not None else {}
        # the static inputs and outputs, outside the pool
        static_bytes = (self.static.nbytes if self.static is not None else 0) + capture.pop(
            "static_bytes", 0
        )
        return {
            "backend": self.backend,
            "max_bs": self.config.max_bs,
            **self.forward.info(),
            "buckets": [
                {
                    "bucket": b,
                    "state": r.state.value,
                    "capture_ms": r.capture_ms,
                    "pool_growth": r.pool_growth,
                    "replays": r.replays,
                }
                for b, r in records
            ],
            "captured": [b for b, r in records if r.state is BucketState.CAPTURED],
            "skipped": [b for b, r in records if r.state is BucketState.SKIPPED],
            "capture_s": round(sum(r.capture_ms or 0.0 for _, r in records) / 1000, 3),
            "replays": sum(r.replays for _, r in records),
            "uncaptured_runs": self.uncaptured_runs,
            "pool_bytes": self.env.pool.bytes,
            "static_bytes": static_bytes,
            **capture,
        }


def create_phase_runner(phase: Phase, config: PhaseConfig, env: RunnerEnv) -> GraphRunner:
    """The runner of `phase`: its forward (compile axis) under its backend's capture kind."""
    if config.backend is Backend.DISABLED:
        return GraphRunner(phase, config, env, make_forward(config, env), None)
    if config.backend is Backend.FULL:
        from srt.model_executor.cuda_graph_runner import FullCapture

        return GraphRunner(phase, config, env, make_forward(config, env), FullCapture)
    if config.backend is Backend.BREAKABLE:
        from srt.model_executor.breakable_runner import BreakableCapture

        return GraphRunner(phase, config, env, make_forward(config, env), BreakableCapture)
    if config.backend is Backend.TC_PIECEWISE:
        from srt.model_executor.piece_capture import PieceGraphs
        from srt.model_executor.piecewise_runner import PiecewiseCapture

        pieces = PieceGraphs(env.pool, env.model, phase)
        forward = make_forward(config, env, pieces)
        return GraphRunner(
            phase, config, env, forward, lambda runner: PiecewiseCapture(runner, pieces)
        )
    raise ValueError(f"no runner for backend {config.backend.value}")
