"""The `full` graph backend: one CUDA graph per bucket around the whole forward, logits included.

Inputs live in static buffers sized for the largest bucket (`StaticBatch`); a batch is padded
to its bucket, padded tokens writing KV to the dummy slot. Attention runs inside the graph, so
the attention backend keeps its metadata in static buffers (`init_graph_state`) and refills
them before every replay (`init_forward_metadata_replay`); the logits are copied, inside the
graph, into one static output buffer shared by all buckets, so no graph pins pool memory, and
their argmax is taken there too: an all-greedy step is one replay and one small copy of ids
to the host (`take_greedy`).

Prefill: buckets are token counts and the number of requests varies up to the bucket's
capacity (min(tokens, --max-running-requests)). Only an attention backend that lays a varying
number of requests out in static buffers can do this (it lists EXTEND in `graph_modes`, as
`triton` does); with any other, `--cuda-graph-backend-prefill full` is rejected at startup.
The same holds for decode (`torch_native` reads host-side lengths, so it is never capturable).

What runs inside the graph is one of:

- the model's eager forward (no tc compiler);
- with a tc compiler (`--cuda-graph-tc-compiler`, or `tc_compiler` in `--cuda-graph-config`):
  the traced general graph that `tc_piecewise` uses too, its pieces compiled once for every
  token count (and cached), attention ops between them; each bucket's capture records all of
  it, so a new bucket costs a capture, never a compile. Uncaptured batches (beyond the largest
  bucket, over the memory budget, or on the CPU) run the same compiled graph;
- with `--enable-torch-compile` (SGLang's way): the forward compiled by Inductor for each
  bucket up to `--torch-compile-max-bs` (static shapes), on that bucket's first hit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from srt.compilation.custom_ops import inductor_trace
from srt.compilation.dispatch import BucketDispatcher
from srt.layers.sampler import greedy_ids
from srt.model_executor.forward_batch import ForwardBatch, forward_context
from srt.model_executor.graph_config import Backend, GraphConfigError, Phase, PhaseConfig
from srt.model_executor.graph_memory import CaptureSession, Graph
from srt.model_executor.graph_runner import (
    BucketRunner,
    PhaseRunner,
    RunnerEnv,
    compiled_logits,
    logits_of,
    phase_mode,
)

if TYPE_CHECKING:  # imported with the compiler, only when a phase compiles
    from srt.compilation.piecewise_model import PiecewiseModel

# Every compiled bucket is one Dynamo cache entry of the same code; the default limit (8)
# would fall back to eager after the 8th bucket.
RECOMPILE_LIMIT = 1024


class FullGraphRunner(BucketRunner):
    backend = Backend.FULL

    def __init__(self, phase: Phase, config: PhaseConfig, env: RunnerEnv) -> None:
        attn = env.attn_backend
        if env.device.type == "cuda" and phase_mode(phase) not in attn.graph_modes:
            raise GraphConfigError(
                f"--cuda-graph-backend-{phase.value} full: the {type(attn).__name__} attention "
                f"backend cannot run {phase.value} inside a CUDA graph; use breakable or "
                "tc_piecewise, or an attention backend that can (--attention-backend triton)"
            )
        super().__init__(phase, config, env)
        self.compiled = (
            torch.compile(logits_of, dynamic=False) if env.args.enable_torch_compile else None
        )
        # With a tc compiler: the shared compiled model, and a dispatcher that always runs
        # its general pieces (the capture is of the whole forward, not per piece).
        self.general: tuple[PiecewiseModel, BucketDispatcher] | None = None
        if config.tc_compiler is not None:
            from srt.model_executor.piecewise_runner import shared_piecewise_model

            model = shared_piecewise_model(env)
            self.general = (model, BucketDispatcher(model.general(config.tc_compiler)))

    def _compiled_general(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits through the compiled general graph, when the phase has a tc compiler."""
        if self.general is None:
            return None
        model, dispatcher = self.general
        return compiled_logits(model, self.env, batch, dispatcher, None)

    def run_uncaptured(self, batch: ForwardBatch) -> torch.Tensor:
        if self.general is None:
            return super().run_uncaptured(batch)
        self.uncaptured_runs += 1
        batch.attn_backend.init_forward_metadata(batch)
        logits = self._compiled_general(batch)
        assert logits is not None, "the phase has a tc compiler"
        return logits

    def run_general(self, batch: ForwardBatch) -> torch.Tensor:
        if self.general is None:
            return super().run_general(batch)
        # Through a dispatcher of its own: `general_runs` counts serving's forwards only.
        model, dispatcher = self.general
        batch.attn_backend.init_forward_metadata(batch)
        return compiled_logits(model, self.env, batch, BucketDispatcher(dispatcher.general), None)

    def _forward(self, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        logits = self._compiled_general(padded)
        if logits is not None:
            return logits
        fn, limits, compiled = logits_of, contextlib.nullcontext(), False
        if self.compiled is not None and bucket <= self.env.args.torch_compile_max_bs:
            limits = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)
            fn, compiled = self.compiled, True
        with forward_context(padded), limits, inductor_trace(compiled):
            return fn(
                self.env.model,
                padded.input_ids,
                padded.positions,
                padded.extend_start_loc,
                padded.extend_lens,
            )

    def warmup(self, padded: ForwardBatch, bucket: int) -> None:
        self.env.attn_backend.init_forward_metadata_capture(padded)
        logits = self._forward(padded, bucket)
        self.keep_logits(logits)
        greedy_ids(logits)  # whatever JIT-compiles on first use does it outside the capture

    def record(self, padded: ForwardBatch, bucket: int, session: CaptureSession) -> Graph:
        session.begin()
        logits = self._forward(padded, bucket)
        static = self.static_logits(logits.shape[0])
        static.copy_(logits)
        # The greedy ids too (the sampler's own argmax), so that an all-greedy step is one
        # replay and one small copy to the host.
        assert self.greedy is not None, "keep_logits allocates it with the logits"
        greedy_ids(static, out=self.greedy[: logits.shape[0]])
        return session.end()

    def replay(self, graph: Graph, padded: ForwardBatch, bucket: int) -> torch.Tensor:
        self.env.attn_backend.init_forward_metadata_replay(padded, bucket)
        with forward_context(padded):
            graph.replay()
        self.greedy_rows = padded.batch_size
        return self.static_logits(padded.batch_size)

    def info(self) -> dict[str, Any]:
        info = super().info()
        info["tc_compiler"] = self.config.tc_compiler
        if self.compiled is not None:
            info["torch_compile_max_bs"] = self.env.args.torch_compile_max_bs
        if self.general is not None:
            info["general_runs"] = self.general[1].general_runs
        return info


def init_attention_graph_state(runners: Iterable[PhaseRunner], env: RunnerEnv) -> None:
    """Size the attention backend's static buffers once for every `full` phase (the backend
    is shared by both phases, and re-sizing would move buffers that graphs already read)."""
    full = [r for r in runners if isinstance(r, FullGraphRunner) and r.static is not None]
    if full:
        env.attn_backend.init_graph_state(
            max(r.requests_for(r.config.bs[-1]) for r in full),
            max(r.config.bs[-1] for r in full),
        )
