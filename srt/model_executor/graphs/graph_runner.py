"""How a phase (prefill, decode) turns a batch into logits: one bucket engine, two choices.

A phase's `GraphRunner` is its forward (the compile axis, `phase_forward.make_forward`: eager,
the compiled general graph, or SGLang's per-bucket compile) and its capture kind (the capture
axis, chosen from `CAPTURE_KINDS`: `full`, `breakable` or `tc_piecewise`; none for
`disabled`). The two are independent: any capture kind records whatever forward the phase
computes.

The runner owns what every capture kind shares, the lazy per-bucket state machine: a batch is
padded to the smallest bucket that holds it (`StaticBatch`, the one padding rule); the first
batch of a bucket has it specialised (`specialise`, the same for every kind: the pool warms it
up, checks the budget and records it; unseen -> captured, or skipped when the graph memory
budget says no) and recorded in the compile cache's manifest; every later batch of that
bucket replays; batches beyond the largest bucket, of a skipped bucket, or on a device with
nothing to capture run the forward uncaptured.

`run(plan, latest_ids) -> (batch, logits [B, V])` (the logits valid until the next run: the
plan uploaded once, fresh or into the bucket's static buffer), `take_greedy()` (their argmax
where the graph computed it), `take_sampled(arrays)` (them sampled in a graph, where the
capture kind does that), `run_general(plan)` (the same logits through the uncaptured general
path, moving no bucket state, counter or manifest entry: the warm-up before ready runs it),
`prewarm(buckets)` (specialise those now: `upfront` / `manifest` capture) and `info()`.

How decode runs, start to end: `ModelRunner.launch` (model_runner.py) hands the scheduler's
plan to the phase's runner, `GraphRunner.run` here lays it out padded in the bucket's static
buffer in one upload (step_inputs.py),
`FullCapture.replay` (full.py) refills the attention backend's static metadata and replays the
graph, and `ModelRunner.sample` takes the graph's argmax or replays its sampler.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from srt.batch_layout import ForwardMode
from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan
from srt.ipc.reports import BucketInfo, PhaseGraphsInfo
from srt.layers.sampler import SamplingArrays
from srt.model_executor.graphs.breakable import BreakableCapture
from srt.model_executor.graphs.capture import Capture, CaptureContext
from srt.model_executor.graphs.config import Backend, Phase, PhaseConfig
from srt.model_executor.graphs.full import FullCapture
from srt.model_executor.graphs.phase_forward import ModelForward, RunnerEnv, make_forward
from srt.model_executor.graphs.piecewise import PiecewiseCapture
from srt.model_executor.graphs.static_batch import StaticBatch, dummy_plan
from srt.model_executor.step_inputs import upload_step

logger = logging.getLogger(__name__)

# The capture kind of each backend that captures (`disabled` has none).
CAPTURE_KINDS: dict[Backend, Callable[[CaptureContext], Capture]] = {
    Backend.FULL: FullCapture,
    Backend.BREAKABLE: BreakableCapture,
    Backend.TC_PIECEWISE: PiecewiseCapture,
}


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


class GraphRunner:
    """A phase's forward under its capture kind (None: `disabled`), bucket by bucket."""

    def __init__(self, phase: Phase, config: PhaseConfig, env: RunnerEnv) -> None:
        self.phase = phase
        self.config = config
        self.env = env
        self.forward: ModelForward = make_forward(config, env)
        self.records = {b: BucketRecord() for b in config.bs}
        self.graphs: dict[int, Any] = {}
        self.uncaptured_runs = 0  # beyond the largest bucket, skipped buckets, or no capturer
        self.replayed = False  # whether the last run was a replay (its graph's argmax is live)
        self.static: StaticBatch | None = None
        self.capture: Capture | None = None
        kind = CAPTURE_KINDS.get(config.backend)
        if kind is None:
            return
        if env.pool.capturer is None:
            logger.info(
                "%s %s: nothing to capture on %s; running the uncaptured path",
                phase.value,
                config.backend.value,
                env.device.type,
            )
            return
        self.ctx = CaptureContext(
            phase,
            env.model,
            self.forward,
            env.attn_backend,
            env.pool,
            env.device,
            largest=config.bs[-1],
            max_requests=env.max_requests,
        )
        self.static = StaticBatch(self.ctx.largest, self.ctx.max_rows, env.device)
        self.capture = kind(self.ctx)

    def bucket_of(self, plan: BatchPlan) -> int | None:
        n = plan.batch_size if self.phase.mode == ForwardMode.DECODE else plan.num_tokens
        return self.config.bucket_for(n)

    def run(
        self, plan: BatchPlan, latest_ids: torch.Tensor | None = None
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's batch on the device (its table writes applied, its ids from
        `latest_ids` where the plan says so) and the logits [B, V] of each request's last
        token."""
        self.replayed = False
        bucket = self.bucket_of(plan) if self.capture is not None else None
        if self.capture is None or self.static is None or bucket is None:
            return self.run_uncaptured(plan, latest_ids)
        record = self.records[bucket]
        padded = None
        if record.state is BucketState.UNSEEN:
            if self.env.cache is not None:  # the next start can prewarm it (manifest mode)
                self.env.cache.manifest.record(self.phase.value, bucket)
            # Replayed on the inputs it was captured with: the capture left them in the
            # static buffers.
            padded = self.specialise(bucket, plan, latest_ids)
        if record.state is BucketState.SKIPPED:
            return self.run_uncaptured(plan, latest_ids)
        record.replays += 1
        if padded is None:
            padded = self.load(plan, bucket, latest_ids)
        logits = self.capture.replay(self.graphs[bucket], padded, bucket)
        self.replayed = True
        return padded, logits

    def load(self, plan: BatchPlan, bucket: int, latest_ids: torch.Tensor | None) -> ForwardBatch:
        """`plan` padded to `bucket` in the static buffer its graphs read."""
        assert self.static is not None, "only capturing runners"
        requests = self.ctx.requests_for(bucket)
        return self.static.load(plan, bucket, requests, self.env.req_to_token, latest_ids)

    def run_uncaptured(
        self, plan: BatchPlan, latest_ids: torch.Tensor | None
    ) -> tuple[ForwardBatch, torch.Tensor]:
        if self.config.backend is not Backend.DISABLED:
            self.uncaptured_runs += 1
        batch = upload_step(plan, self.env.req_to_token, latest_ids)
        self.env.attn_backend.init_forward_metadata(batch)
        return batch, self.forward(batch, None)

    def run_general(self, plan: BatchPlan) -> tuple[ForwardBatch, torch.Tensor]:
        self.replayed = False
        batch = upload_step(plan, self.env.req_to_token)
        self.env.attn_backend.init_forward_metadata(batch)
        return batch, self.forward.general(batch)

    def take_greedy(self) -> torch.Tensor | None:
        """The argmax of the last run's logits where its replay computed it; None otherwise."""
        return self.capture.take_greedy() if self.replayed and self.capture is not None else None

    def take_sampled(self, arrays: SamplingArrays) -> torch.Tensor | None:
        """The last run's logits sampled with `arrays` inside a graph, where its capture kind
        does that for the replayed bucket; None otherwise (the caller samples them)."""
        if not self.replayed or self.capture is None:
            return None
        return self.capture.take_sampled(arrays)

    def prewarm(self, buckets: Iterable[int]) -> None:
        if self.capture is None:
            return
        # Largest first: the smaller captures then reuse its pool memory.
        for bucket in sorted(set(buckets) & set(self.records), reverse=True):
            if self.records[bucket].state is BucketState.UNSEEN:
                width = self.env.req_to_token.shape[1]
                self.specialise(bucket, dummy_plan(self.phase.mode, bucket, width))

    def specialise(
        self, bucket: int, plan: BatchPlan, latest_ids: torch.Tensor | None = None
    ) -> ForwardBatch:
        """Warm up and capture `bucket` with `plan` (a live step of that bucket, or a dummy),
        padded into the static buffers, the same way for every capture kind; returns the
        padded batch (its inputs stay in the buffers: a replay can follow at once)."""
        capture = self.capture
        assert capture is not None, "only capturing runners"
        padded = self.load(plan, bucket, latest_ids)
        captured = self.ctx.pool.capture(
            self.ctx.label(bucket, capture.name.value),
            lambda: capture.warmup(padded, bucket),
            lambda session: capture.record(padded, bucket, session),
            warmup_runs=capture.warmup_runs,
        )
        record = self.records[bucket]
        if captured is None:
            record.state = BucketState.SKIPPED
            return padded
        self.graphs[bucket] = captured.result
        record.state = BucketState.CAPTURED
        record.capture_ms = round(captured.ms, 3)
        record.pool_growth = captured.pool_growth
        return padded

    def info(self) -> PhaseGraphsInfo:
        backend = self.config.backend.value
        if self.config.backend is Backend.DISABLED:
            return PhaseGraphsInfo(backend, self.forward.info())
        records = sorted(self.records.items())
        capture = self.capture.info() if self.capture is not None else None
        static = self.static.nbytes if self.static is not None else 0
        return PhaseGraphsInfo(
            backend,
            self.forward.info(),
            capture,
            max_bs=self.config.max_bs,
            buckets=tuple(
                BucketInfo(b, r.state.value, r.capture_ms, r.pool_growth, r.replays)
                for b, r in records
            ),
            captured=tuple(b for b, r in records if r.state is BucketState.CAPTURED),
            skipped=tuple(b for b, r in records if r.state is BucketState.SKIPPED),
            capture_s=round(sum(r.capture_ms or 0.0 for _, r in records) / 1000, 3),
            replays=sum(r.replays for _, r in records),
            uncaptured_runs=self.uncaptured_runs,
            pool_bytes=self.env.pool.bytes,
            static_bytes=static + (capture.static_bytes if capture is not None else 0),
        )


def init_attention_graph_state(runners: Iterable[GraphRunner], env: RunnerEnv) -> None:
    """Size the attention backend's static buffers once for every capturing `full` phase (the
    backend is shared by both phases, and re-sizing would move buffers that graphs read)."""
    full = [r.ctx for r in runners if isinstance(r.capture, FullCapture)]
    if full:
        env.attn_backend.init_graph_state(
            max(ctx.max_rows for ctx in full), max(ctx.largest for ctx in full)
        )
