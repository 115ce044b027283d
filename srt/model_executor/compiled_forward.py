"""How a phase computes its forward: the compile axis, independent of how it is captured.

Every forward here is called with a batch whose attention metadata is set and returns the
logits [B, V] of each request's last token; `bucket` is the bucket the batch is padded to
(None: no bucket, the general path). `general(batch)` is the same forward through the path
that serves any shape, moving no bucket state or counter (the warm-up before ready runs it).

- `EagerForward`: the model's forward as plain PyTorch, each layer op running its kernel or
  its reference as `--custom-ops` chose;
- `GeneralGraphForward`: the model traced once, split at the split ops, its pieces compiled
  once for every token count (`tc_compiler` eager or inductor) and cached, attention ops
  between them. Both phases share the one `PiecewiseModel`. With a per-piece specializer
  (tc_piecewise's CUDA graph per piece) a bucket's calls are routed to it; without one every
  call runs the general pieces (a whole-forward capture records those);
- `PerBucketCompiledForward`: SGLang's `--enable-torch-compile`: the forward compiled by
  Inductor for each bucket's static shape up to `--torch-compile-max-bs`, on its first hit.

`make_forward` picks one from the phase's config; the capture kind (graph_runner.py) runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.batch_layout import ForwardMode
from srt.compilation.custom_ops import inductor_trace
from srt.compilation.dispatch import BucketDispatcher, Specializer, run_general
from srt.model_executor.forward_batch import ForwardBatch, forward_context
from srt.model_executor.graph_config import Backend, PhaseConfig
from srt.model_executor.static_batch import dummy_batch

if TYPE_CHECKING:  # the compiler is imported only when a phase compiles
    from srt.compilation.piecewise_model import PiecewiseModel
    from srt.model_executor.graph_runner import RunnerEnv
    from srt.models.llama import LlamaForCausalLM

# Every compiled bucket is one Dynamo cache entry of the same code; the default limit (8)
# would fall back to eager after the 8th bucket.
RECOMPILE_LIMIT = 1024


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

    def info(self) -> dict[str, Any]: ...


class EagerForward:
    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def __call__(self, batch: ForwardBatch, bucket: int | None) -> torch.Tensor:
        with forward_context(batch):
            return logits_of(self.model, *forward_inputs(batch))

    def general(self, batch: ForwardBatch) -> torch.Tensor:
        return self(batch, None)

    def info(self) -> dict[str, Any]:
        return {}


class GeneralGraphForward:
    def __init__(self, env: RunnerEnv, compiler: str, per_piece: Specializer | None = None) -> None:
        self.env = env
        self.compiler = compiler
        self.model = shared_piecewise_model(env)
        general = self.model.general(compiler)
        self.per_piece = per_piece is not None
        self.dispatcher = BucketDispatcher(general, per_piece or run_general)

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
        with forward_context(batch):
            hidden = self.model(batch.input_ids, batch.positions, dispatcher, bucket)
        return last_token_logits(self.env.model, hidden, batch.extend_start_loc, batch.extend_lens)

    def info(self) -> dict[str, Any]:
        return {"tc_compiler": self.compiler, "general_runs": self.dispatcher.general_runs}


class PerBucketCompiledForward:
    def __init__(self, env: RunnerEnv) -> None:
        self.model = env.model
        self.max_bs = env.args.torch_compile_max_bs
        self.compiled = torch.compile(logits_of, dynamic=False)
        self.eager = EagerForward(env.model)

    def __call__(self, batch: ForwardBatch, bucket: int | None) -> torch.Tensor:
        if bucket is None or bucket > self.max_bs:
            return self.eager(batch, bucket)
        with (
            forward_context(batch),
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
            inductor_trace(True),
        ):
            return self.compiled(self.model, *forward_inputs(batch))

    def general(self, batch: ForwardBatch) -> torch.Tensor:
        return self.eager(batch, None)

    def info(self) -> dict[str, Any]:
        return {"torch_compile_max_bs": self.max_bs}


def make_forward(
    config: PhaseConfig, env: RunnerEnv, per_piece: Specializer | None = None
) -> ModelForward:
    """The phase's forward: the compiled general graph with a tc compiler, SGLang's
    per-bucket compile for a `full` phase under `--enable-torch-compile`, else eager.
    `per_piece`: the specializer a bucket's piece calls go to (tc_piecewise)."""
    if config.tc_compiler is not None:
        return GeneralGraphForward(env, config.tc_compiler, per_piece)
    if env.args.enable_torch_compile and config.backend is Backend.FULL:
        return PerBucketCompiledForward(env)
    return EagerForward(env.model)


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
