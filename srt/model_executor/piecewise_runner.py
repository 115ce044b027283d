"""The `tc_piecewise` phase runner: the model traced once, split at the split ops, its pieces
compiled up front (`--cuda-graph-tc-compiler eager|inductor`), buckets specialised lazily.

Both phases share one `PiecewiseModel` (traced and compiled once, or loaded from the compile
cache, at the first tc_piecewise runner's construction, with every compiler a tc_piecewise
phase asks for); each phase keeps
its own `BucketDispatcher`, whose specializer is `PieceGraphs`: a CUDA graph per (piece,
bucket) on CUDA, the general graph on the CPU. A batch is padded to its bucket (decode: one
token per request, so the bucket is the batch size too); beyond the largest bucket it runs
the general graph unpadded. The buckets real batches hit go to the cache's manifest.
"""

from __future__ import annotations

from typing import Any

import torch

from srt.batch_layout import ForwardMode
from srt.compilation.backend import MIN_TOKENS
from srt.compilation.dispatch import BucketDispatcher
from srt.compilation.piecewise_model import PiecewiseModel
from srt.model_executor.forward_batch import ForwardBatch, forward_context, pad_tokens
from srt.model_executor.graph_config import Backend, Phase, PhaseConfig
from srt.model_executor.graph_runner import RunnerEnv, compiled_logits, phase_mode
from srt.model_executor.piece_capture import PieceGraphs
from srt.model_executor.static_batch import dummy_batch


def tc_compiler(config: PhaseConfig) -> str:
    """A tc_piecewise phase's compiler (`resolve_graph_config` always sets one)."""
    assert config.tc_compiler is not None, f"a {config.backend.value} phase has no tc compiler"
    return config.tc_compiler


def shared_piecewise_model(env: RunnerEnv) -> PiecewiseModel:
    """The runner's `PiecewiseModel`, traced and compiled (or loaded) on first use, with every
    compiler a phase asks for (tc_piecewise phases, and full phases that capture the compiled
    forward)."""
    if env.piecewise is not None:
        return env.piecewise
    if env.cache is None:
        raise RuntimeError("a compiled phase needs the compile cache (RunnerEnv.cache)")
    tc = [c for c in env.configs.values() if c.tc_compiler is not None]
    largest = max(c.bs[-1] for c in tc)
    args = env.args
    model = PiecewiseModel(
        env.model,
        compilers=sorted({tc_compiler(c) for c in tc}),
        cache=env.cache,
        # Every batch the scheduler forms fits: prefill <= max_prefill_tokens, decode <= the
        # request count; padding goes up to the largest bucket.
        max_tokens=max(args.max_prefill_tokens, args.max_running_requests, largest, MIN_TOKENS),
        keep_shape_guards=args.keep_shape_guards,
    )
    # Trace with the largest bucket's size: Inductor tunes the general graph for its hint.
    batch = dummy_batch(
        ForwardMode.EXTEND, max(largest, MIN_TOKENS), env.req_to_token, env.attn_backend
    )
    batch.attn_backend.init_forward_metadata(batch)
    with forward_context(batch):
        model.trace(batch.input_ids, batch.positions)
    env.piecewise = model
    return model


class PiecewiseRunner:
    backend = Backend.TC_PIECEWISE.value

    def __init__(self, phase: Phase, config: PhaseConfig, env: RunnerEnv) -> None:
        self.phase = phase
        self.mode = phase_mode(phase)
        self.config = config
        self.env = env
        self.compiled = shared_piecewise_model(env)
        self.dispatcher = BucketDispatcher(
            self.compiled.general(tc_compiler(config)),
            PieceGraphs(env.pool, env.model, phase),
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of each request's last token."""
        bucket = self.config.bucket_for(batch.num_tokens)
        if bucket is not None:
            self.compiled.cache.manifest.record(self.phase.value, bucket)
        return self._forward(batch, bucket, self.dispatcher)

    def run_general(self, batch: ForwardBatch) -> torch.Tensor:
        """The general graph, unpadded, through a dispatcher of its own: no bucket state or
        run count of the phase moves."""
        return self._forward(batch, None, BucketDispatcher(self.dispatcher.general))

    def _forward(
        self, batch: ForwardBatch, bucket: int | None, dispatcher: BucketDispatcher
    ) -> torch.Tensor:
        if bucket is not None:
            batch = pad_tokens(batch, bucket)
        batch.attn_backend.init_forward_metadata(batch)
        return compiled_logits(self.compiled, self.env, batch, dispatcher, bucket)

    def take_greedy(self) -> torch.Tensor | None:
        return None  # the pieces' graphs end before the logits' argmax

    def prewarm(self, buckets: list[int]) -> None:
        """Specialise `buckets` now with dummy batches: a warm-up hit, then the specialising
        one (not recorded in the manifest: no traffic asked for them)."""
        for bucket in sorted(set(buckets) & set(self.config.bs), reverse=True):
            batch = dummy_batch(self.mode, bucket, self.env.req_to_token, self.env.attn_backend)
            for _ in range(2):
                self._forward(batch, bucket, self.dispatcher)

    def info(self) -> dict[str, Any]:
        stats = self.dispatcher.bucket_stats()
        unseen = {"state": "unseen", "hits": 0, "specialise_s": 0.0}
        return {
            "backend": self.backend,
            "tc_compiler": self.config.tc_compiler,
            "max_bs": self.config.max_bs,
            "buckets": [{"bucket": b, **stats.get(b, unseen)} for b in self.config.bs],
            # The same summary keys as the other graph runners (metrics read them).
            "captured": [b for b, s in stats.items() if s["state"] in ("specialised", "replayed")],
            "capture_s": round(sum(s["specialise_s"] for s in stats.values()), 3),
            "general_runs": self.dispatcher.general_runs,
            "pool_bytes": self.env.pool.bytes,
        }
