"""How a phase computes its forward: the compile axis, independent of how it is captured.

Every forward here is called with a batch whose attention metadata is set and returns the
logits [B, V] of each request's last token; `bucket` is the bucket the batch is padded to
(None: no bucket, the general path). `general(batch)` is the same forward through the path
that serves any shape, moving no bucket state or counter (the warm-up before ready runs it).

- `EagerForward`: the model's forward as plain PyTorch, each layer op running its kernel or
  its reference as `--custom-ops` chose;
- `GeneralGraphForward`: the model traced once, split at the split ops, its pieces compiled
  once for every token count (`tc_compiler` eager or inductor) and cached, attention ops
  between them (with `--inductor-graph-partition`, the whole graph compiled by Inductor, cut
  at the split ops into partitions that stand for the pieces). Both phases share the one
  `PiecewiseModel`. Once a capture kind routes its pieces (`route_pieces`: tc_piecewise's CUDA
  graph per piece) a bucket's piece calls go to that specializer; otherwise every call runs
  the general pieces (a whole-forward capture records those);
- `PerBucketCompiledForward`: SGLang's `--enable-torch-compile`: the forward compiled by
  Inductor for each bucket's static shape up to `--torch-compile-max-bs`, on its first hit.

`make_forward` picks one from the phase's config; the capture kind (graph_runner.py) runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from srt.batch_layout import ForwardMode
from srt.compilation.dispatch import BucketDispatcher, Specializer, run_general
from srt.compilation.op_registry import inductor_trace
from srt.forward_batch import ForwardBatch
from srt.ipc.reports import ForwardInfo
from srt.layers.attention.base import AttentionBackend
from srt.layers.attention.layer import eager_forward_context, forward_context
from srt.model_executor.graphs.config import Backend, Phase, PhaseConfig
from srt.model_executor.graphs.pool import GraphPool
from srt.model_executor.graphs.static_batch import dummy_plan
from srt.model_executor.step_inputs import upload_step

if TYPE_CHECKING:  # the compiler is imported only when a phase compiles
    from srt.compilation.cache import CompileCache
    from srt.compilation.piecewise_model import PiecewiseModel
    from srt.models.llama import LlamaForCausalLM
    from srt.server_args import ServerArgs

# Every compiled bucket is one Dynamo cache entry of the same code; the default limit (8)
# would fall back to eager after the 8th bucket.
RECOMPILE_LIMIT = 1024


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
    compile_passes: tuple[str, ...] = ()  # the graph passes Inductor runs (config.py)
    piecewise: PiecewiseModel | None = None  # traced once, by the first phase that compiles

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device


def logits_of(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
) -> torch.Tensor:
    """The eager forward's logits, on tensors only (what torch.compile traces)."""
    return last_token_logits(model, model(input_ids, positions), extend_start_loc, extend_lens)


def forward_inputs(
    batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensors `logits_of` takes after the model, from a batch."""
    return batch.input_ids, batch.positions, batch.extend_start_loc, batch.extend_lens


def last_token_logits(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
) -> torch.Tensor:
    """Logits [B, V] from the hidden states of every token: each request's last one."""
    return model.compute_logits(hidden[extend_start_loc.long() + extend_lens.long() - 1])


class ModelForward(Protocol):
    def __call__(self, batch: ForwardBatch, bucket: int | None) -> torch.Tensor: ...

    def general(self, batch: ForwardBatch) -> torch.Tensor: ...

    def route_pieces(self, specializer: Specializer) -> None:
        """Send a bucket's piece calls to `specializer` (a forward of compiled pieces only)."""
        ...

    def info(self) -> ForwardInfo: ...


class EagerForward:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend

    def __call__(self, batch: ForwardBatch, bucket: int | None) -> torch.Tensor:
        with forward_context(batch, self.backend):
            return logits_of(self.model, *forward_inputs(batch))

    def general(self, batch: ForwardBatch) -> torch.Tensor:
        return self(batch, None)

    def route_pieces(self, specializer: Specializer) -> None:
        raise TypeError("the eager forward has no pieces (tc_piecewise compiles its forward)")

    def info(self) -> ForwardInfo:
        return ForwardInfo("eager")


class GeneralGraphForward:
    def __init__(self, env: RunnerEnv, compiler: str) -> None:
        self.env = env
        self.compiler = compiler
        self.model = shared_piecewise_model(env)
        self.dispatcher = BucketDispatcher(self.model.general(compiler), run_general)
        self.per_piece = False  # whether a bucket's piece calls go to a specializer

    def route_pieces(self, specializer: Specializer) -> None:
        self.dispatcher.specializer, self.per_piece = specializer, True

    def __call__(self, batch: ForwardBatch, bucket: int | None) -> torch.Tensor:
        return self._logits(batch, self.dispatcher, bucket if self.per_piece else None)

    def general(self, batch: ForwardBatch) -> torch.Tensor:
        # Through a dispatcher of its own: `general_runs` counts serving's forwards only.
        return self._logits(batch, BucketDispatcher(self.dispatcher.general), None)

    def _logits(
        self, batch: ForwardBatch, dispatcher: BucketDispatcher, bucket: int | None
    ) -> torch.Tensor:
        if batch.padded_tokens > self.model.max_tokens:
            raise ValueError(
                f"a batch of {batch.padded_tokens} tokens exceeds the {self.model.max_tokens} "
                "the graph was compiled for (--max-prefill-tokens)"
            )
        with forward_context(batch, self.env.attn_backend):
            hidden = self.model(batch.input_ids, batch.positions, dispatcher, bucket)
        return last_token_logits(self.env.model, hidden, batch.extend_start_loc, batch.extend_lens)

    def info(self) -> ForwardInfo:
        return ForwardInfo(
            "general_graph", tc_compiler=self.compiler, general_runs=self.dispatcher.general_runs
        )


class PerBucketCompiledForward:
    def __init__(self, env: RunnerEnv) -> None:
        self.model = env.model
        self.backend = env.attn_backend
        self.max_bs = env.args.torch_compile_max_bs
        self.compiled = torch.compile(logits_of, dynamic=False)
        self.eager = EagerForward(env.model, env.attn_backend)

    def __call__(self, batch: ForwardBatch, bucket: int | None) -> torch.Tensor:
        if bucket is None or bucket > self.max_bs:
            return self.eager(batch, bucket)
        with (
            forward_context(batch, self.backend),
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
            inductor_trace(True),
        ):
            return self.compiled(self.model, *forward_inputs(batch))

    def general(self, batch: ForwardBatch) -> torch.Tensor:
        return self.eager(batch, None)

    def route_pieces(self, specializer: Specializer) -> None:
        raise TypeError("a per-bucket compile has no pieces (tc_piecewise compiles its forward)")

    def info(self) -> ForwardInfo:
        return ForwardInfo("per_bucket_compile", torch_compile_max_bs=self.max_bs)


def make_forward(config: PhaseConfig, env: RunnerEnv) -> ModelForward:
    """The phase's forward: the compiled general graph with a tc compiler, SGLang's
    per-bucket compile for a `full` phase under `--enable-torch-compile`, else eager."""
    if config.tc_compiler is not None:
        return GeneralGraphForward(env, config.tc_compiler)
    if env.args.enable_torch_compile and config.backend is Backend.FULL:
        return PerBucketCompiledForward(env)
    return EagerForward(env.model, env.attn_backend)


def shared_piecewise_model(env: RunnerEnv) -> PiecewiseModel:
    """The runner's `PiecewiseModel`, traced and compiled (or loaded) on first use, with every
    compiler a phase asks for."""
    if env.piecewise is not None:
        return env.piecewise
    from srt.compilation.backend import MIN_TOKENS
    from srt.compilation.piecewise_model import PiecewiseModel

    if env.cache is None:
        raise RuntimeError("a compiled phase needs the compile cache (RunnerEnv.cache)")
    tc = [c for c in env.configs.values() if c.tc_compiler is not None]
    largest = max(c.bs[-1] for c in tc)
    args = env.args
    model = PiecewiseModel(
        env.model,
        compilers=sorted({c.tc_compiler for c in tc if c.tc_compiler is not None}),
        cache=env.cache,
        # Every batch the scheduler forms fits: prefill <= max_prefill_tokens, decode <= the
        # request count; padding goes up to the largest bucket.
        max_tokens=max(args.max_prefill_tokens, args.max_running_requests, largest, MIN_TOKENS),
        keep_shape_guards=args.keep_shape_guards,
        partition=args.inductor_graph_partition,
        passes=env.compile_passes,
    )
    # Trace with the largest bucket's size: Inductor tunes the general graph for its hint.
    width = env.req_to_token.shape[1]
    batch = upload_step(
        dummy_plan(ForwardMode.EXTEND, max(largest, MIN_TOKENS), width), env.req_to_token
    )
    with eager_forward_context(batch, env.attn_backend):
        model.trace(batch.input_ids, batch.positions)
    env.piecewise = model
    return model
