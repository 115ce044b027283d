"""Per-phase forward runners: how a phase (prefill, decode) turns a batch into logits.

Every runner has `run(batch) -> logits [B, V]` (valid until the runner's next run),
`run_general(batch)` (the same logits through the uncaptured, unspecialised path, moving no
bucket state, counter or manifest entry: the warm-up before ready runs it), `prewarm(buckets)`
(specialise those buckets now: `upfront` / `manifest` capture) and `info()`.
`create_phase_runner` picks the class for a phase's backend:

- `disabled`: `EagerRunner`, also the uncaptured path every other backend falls back to;
- `full`: `cuda_graph_runner.FullGraphRunner`;
- `breakable`: `breakable_runner.BreakableGraphRunner`;
- `tc_piecewise`: `srt.model_executor.piecewise_runner.PiecewiseRunner`.

`BucketRunner` is the lazy per-bucket state machine of the capturing backends: the first
batch of a bucket warms it up and captures it (unseen -> captured, or skipped when the graph
memory budget says no), every later batch of that bucket is padded and replayed, and batches
beyond the largest bucket run eagerly.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.batch_layout import ForwardMode
from srt.model_executor.forward_batch import ForwardBatch, forward_context
from srt.model_executor.graph_config import Backend, Phase, PhaseConfig
from srt.model_executor.graph_memory import Captured, CaptureSession, GraphPool
from srt.model_executor.static_batch import StaticBatch, dummy_batch

if TYPE_CHECKING:
    from srt.compilation.cache import CompileCache
    from srt.compilation.dispatch import BucketDispatcher
    from srt.compilation.piecewise_model import PiecewiseModel
    from srt.layers.attention.base import AttentionBackend
    from srt.models.llama import LlamaForCausalLM
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def forward_logits(model: LlamaForCausalLM, batch: ForwardBatch) -> torch.Tensor:
    """Logits [B, V] of each request's last token; device work only (capturable as is)."""
    return logits_of(
        model, batch.input_ids, batch.positions, batch.extend_start_loc, batch.extend_lens
    )


def logits_of(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
) -> torch.Tensor:
    """`forward_logits` on tensors only (what torch.compile traces)."""
    return last_token_logits(model, model(input_ids, positions), extend_start_loc, extend_lens)


def last_token_logits(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
) -> torch.Tensor:
    """Logits [B, V] from the hidden states of every token: each request's last one."""
    return model.compute_logits(hidden[extend_start_loc.long() + extend_lens.long() - 1])


def compiled_logits(
    compiled: PiecewiseModel,
    env: RunnerEnv,
    batch: ForwardBatch,
    dispatcher: BucketDispatcher,
    bucket: int | None,
) -> torch.Tensor:
    """Logits [B, V] of `batch` (its attention metadata set) through the compiled graph, each
    piece routed to `dispatcher` for `bucket` (None: the general pieces)."""
    if batch.padded_tokens > compiled.max_tokens:
        raise ValueError(
            f"a batch of {batch.padded_tokens} tokens exceeds the {compiled.max_tokens} the "
            "graph was compiled for (--max-prefill-tokens)"
        )
    with forward_context(batch):
        hidden = compiled(batch.input_ids, batch.positions, dispatcher, bucket)
    return last_token_logits(env.model, hidden, batch.extend_start_loc, batch.extend_lens)


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
    piecewise: PiecewiseModel | None = None  # traced once by the first tc_piecewise runner

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device


class PhaseRunner(Protocol):
    @property
    def backend(self) -> str: ...

    def run(self, batch: ForwardBatch) -> torch.Tensor: ...

    def take_greedy(self) -> torch.Tensor | None:
        """The argmax of the logits the last `run` returned, where its graph computed it
        (then the step needs no argmax launch of its own); None otherwise. Once only."""
        ...

    def run_general(self, batch: ForwardBatch) -> torch.Tensor: ...

    def prewarm(self, buckets: list[int]) -> None: ...

    def info(self) -> dict[str, Any]: ...


class EagerRunner:
    """Runs the model forward as plain PyTorch."""

    backend = "disabled"

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of each request's last token."""
        batch.attn_backend.init_forward_metadata(batch)
        with forward_context(batch):
            return forward_logits(self.model, batch)

    run_general = run  # the eager forward is the general path

    def take_greedy(self) -> torch.Tensor | None:
        return None  # nothing computed it

    def prewarm(self, buckets: list[int]) -> None:
        """Nothing to specialise: the eager forward serves every shape."""

    def info(self) -> dict[str, Any]:
        return {"backend": self.backend}


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


class BucketRunner(ABC):
    """Lazy per-bucket capture around a static-buffer forward; subclasses say what a capture
    records (`record`) and how it replays (`replay`)."""

    backend: Backend

    def __init__(self, phase: Phase, config: PhaseConfig, env: RunnerEnv) -> None:
        self.phase = phase
        self.mode = phase_mode(phase)
        self.config = config
        self.env = env
        self.eager = EagerRunner(env.model)
        self.records = {b: BucketRecord() for b in config.bs}
        self.graphs: dict[int, Any] = {}
        self.uncaptured_runs = 0  # beyond the largest bucket, skipped buckets, or no capturer
        self.logits: torch.Tensor | None = None  # static output [max requests, vocab]
        # Its argmax [max requests], where the graph computes it (full), and the rows of it
        # that the last run's replay filled (None: the last run was no replay).
        self.greedy: torch.Tensor | None = None
        self.greedy_rows: int | None = None
        self.static = (
            StaticBatch(config.bs[-1], self.requests_for(config.bs[-1]), env.device)
            if env.pool.capturer is not None
            else None
        )
        if self.static is None:
            logger.info(
                "%s %s: nothing to capture on %s; running the uncaptured (eager) path",
                phase.value,
                self.backend.value,
                env.device.type,
            )

    def requests_for(self, bucket: int) -> int:
        """A bucket's request capacity: decode buckets are batch sizes; a prefill bucket of T
        tokens holds at most T requests."""
        return bucket if self.mode == ForwardMode.DECODE else min(bucket, self.env.max_requests)

    def bucket_of(self, batch: ForwardBatch) -> int | None:
        n = batch.batch_size if self.mode == ForwardMode.DECODE else batch.num_tokens
        return self.config.bucket_for(n)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.greedy_rows = None
        static = self.static
        bucket = self.bucket_of(batch) if static is not None else None
        if static is None or bucket is None:
            return self.run_uncaptured(batch)
        record = self.records[bucket]
        if record.state is BucketState.UNSEEN:
            if self.env.cache is not None:  # the next start can prewarm it (manifest mode)
                self.env.cache.manifest.record(self.phase.value, bucket)
            self.specialise(bucket, batch)
        if record.state is BucketState.SKIPPED:
            return self.run_uncaptured(batch)
        record.replays += 1
        padded = static.load(batch, bucket, self.requests_for(bucket))
        return self.replay(self.graphs[bucket], padded, bucket)

    def run_uncaptured(self, batch: ForwardBatch) -> torch.Tensor:
        self.uncaptured_runs += 1
        return self.run_general(batch)

    def run_general(self, batch: ForwardBatch) -> torch.Tensor:
        return self.eager.run(batch)

    def prewarm(self, buckets: list[int]) -> None:
        if self.static is None:
            return
        # Largest first: the smaller captures then reuse its pool memory.
        for bucket in sorted(set(buckets) & set(self.records), reverse=True):
            if self.records[bucket].state is BucketState.UNSEEN:
                batch = dummy_batch(self.mode, bucket, self.env.req_to_token, self.env.attn_backend)
                self.specialise(bucket, batch)

    def specialise(self, bucket: int, batch: ForwardBatch) -> None:
        """Warm up and capture `bucket` with `batch` (a live batch of that bucket, or a dummy)."""
        assert self.static is not None, "only runners with a capturer specialise"
        padded = self.static.load(batch, bucket, self.requests_for(bucket))
        captured: Captured | None = self.env.pool.capture(
            f"{self.phase.value} bucket {bucket} ({self.backend.value})",
            lambda: self.warmup(padded, bucket),
            lambda session: self.record(padded, bucket, session),
        )
        record = self.records[bucket]
        if captured is None:
            record.state = BucketState.SKIPPED
            return
        self.graphs[bucket] = captured.result
        record.state = BucketState.CAPTURED
        record.capture_ms = round(captured.ms, 3)
        record.pool_growth = captured.pool_growth

    def keep_logits(self, logits: torch.Tensor) -> None:
        """Allocate the static logits buffer (and its argmax's) on the first warm-up,
        outside any capture."""
        if self.logits is None:
            rows = self.requests_for(self.config.bs[-1])
            self.logits = logits.new_empty((rows, logits.shape[-1]))
            self.greedy = torch.empty(rows, dtype=torch.int64, device=logits.device)

    def take_greedy(self) -> torch.Tensor | None:
        rows, self.greedy_rows = self.greedy_rows, None
        if rows is None or self.greedy is None:
            return None
        return self.greedy[:rows]

    def static_logits(self, rows: int) -> torch.Tensor:
        """The first `rows` of the static logits buffer (after the first warm-up)."""
        assert self.logits is not None, "keep_logits allocates it in the first warm-up"
        return self.logits[:rows]

    @abstractmethod
    def warmup(self, padded: ForwardBatch, bucket: int) -> None:
        """Run the bucket's forward eagerly on the static buffers (before its capture)."""

    @abstractmethod
    def record(self, padded: ForwardBatch, bucket: int, session: CaptureSession) -> Any:
        """Capture the bucket's forward through `session`; returns what `replay` takes."""

    @abstractmethod
    def replay(self, graph: Any, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        """Replay for the live batch already loaded into the static buffers (`padded`);
        logits of its real requests."""

    def info(self) -> dict[str, Any]:
        records = self.records.items()
        return {
            "backend": self.backend.value,
            "max_bs": self.config.max_bs,
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
            # the static inputs and output, outside the pool
            "static_bytes": (self.static.nbytes if self.static is not None else 0)
            + (self.logits.numel() * self.logits.element_size() if self.logits is not None else 0)
            + (self.greedy.numel() * self.greedy.element_size() if self.greedy is not None else 0),
        }


def create_phase_runner(phase: Phase, config: PhaseConfig, env: RunnerEnv) -> PhaseRunner:
    """The runner of `phase` for its configured backend."""
    if config.backend is Backend.DISABLED:
        return EagerRunner(env.model)
    if config.backend is Backend.FULL:
        from srt.model_executor.cuda_graph_runner import FullGraphRunner

        return FullGraphRunner(phase, config, env)
    if config.backend is Backend.BREAKABLE:
        from srt.model_executor.breakable_runner import BreakableGraphRunner

        return BreakableGraphRunner(phase, config, env)
    if config.backend is Backend.TC_PIECEWISE:
        from srt.model_executor.piecewise_runner import PiecewiseRunner

        return PiecewiseRunner(phase, config, env)
    raise ValueError(f"no runner for backend {config.backend.value}")
