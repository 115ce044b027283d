"""A model forward traced once by Dynamo, split at the split ops, its pieces compiled up front.

    pm = PiecewiseModel(model, compilers=["inductor"], cache=cache, max_tokens=8192)
    with forward_context(dummy):             # the trace runs the forward once
        pm.trace(dummy.input_ids, dummy.positions)
    with forward_context(batch):
        hidden = pm(batch.input_ids, batch.positions, dispatcher, bucket)

Tracing: `torch.compile(fullgraph=True, dynamic=False)` with the token dimension of
`input_ids` and `positions` marked dynamic over [2, max_tokens] (one symbol: tracing proves
them equal; Dynamo specialises 0 and 1, so the symbol starts at 2, but the general graph also
runs one-token batches). A graph break, or a guard or a decision of the traced code that is
not the same for every count from 1 to max_tokens (a Python branch on the token count, even
`x.shape[0] == 1`, which Dynamo decides without a guard), fails the trace with a
`CompilationError` naming it. Then every guard is dropped
(`guard_filter_fn`; `keep_shape_guards` keeps the shape guards, for debugging), and each later
call runs under `set_stance("fail_on_recompile")`: no batch size can make Dynamo trace again,
and an attempt is an error rather than a silent recompile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from srt.compilation.backend import MIN_TOKENS, PiecewiseBackend, recording_token_decisions
from srt.compilation.cache import CompileCache
from srt.compilation.custom_ops import inductor_trace, split_ops
from srt.compilation.dispatch import BucketDispatcher, PieceFn, Router
from srt.compilation.errors import CompilationError, GraphBreakError, ShapeSpecializationError

logger = logging.getLogger(__name__)

# Dynamo keeps its compiled entries on the code object of the model class's forward; every
# PiecewiseModel of one class adds one (told apart by backend), so allow many of them.
RECOMPILE_LIMIT = 1024


def _guard_filter(keep_shape_guards: bool) -> Callable[[Sequence[Any]], list[bool]]:
    """Which of Dynamo's guards to keep: none, or only the shape guards (for debugging)."""
    if keep_shape_guards:
        return lambda entries: [e.guard_type == "SHAPE_ENV" for e in entries]
    return lambda entries: [False for _ in entries]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class PiecewiseModel:
    def __init__(
        self,
        model: nn.Module,
        *,
        compilers: Sequence[str],
        cache: CompileCache,
        max_tokens: int,
        keep_shape_guards: bool = False,
    ) -> None:
        if max_tokens < MIN_TOKENS:
            raise ValueError(f"max_tokens must be at least {MIN_TOKENS}, got {max_tokens}")
        self.compilers = list(compilers)
        self.cache = cache
        self.max_tokens = max_tokens
        self.router = Router()
        self.backend = PiecewiseBackend(
            self.compilers, cache, self.router, max_tokens, type(model).__name__
        )
        self.compiled = torch.compile(
            model,
            backend=self.backend,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": _guard_filter(keep_shape_guards)},
        )
        self.dynamo_s = 0.0
        self.total_s = 0.0

    @property
    def traced(self) -> bool:
        return self.backend.split is not None

    def trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Trace and compile, running the forward once (inside the caller's forward context)."""
        if self.traced:
            raise CompilationError("the model is already traced; it is traced once")
        for t in (input_ids, positions):
            torch._dynamo.mark_dynamic(t, 0, min=MIN_TOKENS, max=self.max_tokens)
        inductor = self.cache.inductor_session() if "inductor" in self.compilers else nullcontext()
        start = time.perf_counter()
        try:
            with (
                torch.inference_mode(),
                recording_token_decisions() as self.backend.decisions,
                inductor,
                # One trace serves every compiler: with Inductor among them, the layer ops
                # left at their default trace their reference, for Inductor to fuse.
                inductor_trace("inductor" in self.compilers),
                torch._dynamo.config.patch(
                    recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT
                ),
            ):
                self.compiled(input_ids, positions)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, CompilationError):
                raise e.inner_exception from None
            raise
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(
                f"the model forward does not trace as one graph (fullgraph=True): {_first_line(e)}"
            ) from e
        except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
            raise ShapeSpecializationError(
                f"the model forward depends on the token count: {_first_line(e)}"
            ) from e
        self.total_s = time.perf_counter() - start
        self.dynamo_s = self.total_s - self.backend.compile_s
        logger.info("Dynamo transform took %.2f s", self.dynamo_s)
        logger.info(
            "torch.compile took %.2f s in total (pieces %.2f s; compile cache %s, %s)",
            self.total_s,
            self.backend.compile_s,
            self.cache.dir,
            {True: "hit", False: "miss", None: "not used"}[self.backend.cache_hit],
        )

    def general(self, compiler: str) -> list[PieceFn]:
        """The general callable of each piece for `compiler` (one of those traced with)."""
        return self.backend.general[compiler]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        dispatcher: BucketDispatcher,
        bucket: int | None,
    ) -> torch.Tensor:
        with (
            torch.inference_mode(),
            torch.compiler.set_stance("fail_on_recompile"),
            self.router.route(dispatcher, bucket),
        ):
            return self.compiled(input_ids, positions)

    def info(self) -> dict[str, Any]:
        split = self.backend.split
        return {
            "split_ops": split_ops(),
            "num_pieces": len(split.pieces) if split else 0,
            "num_split_regions": len(split.regions) if split else 0,
            "num_unique_pieces": len(set(self.backend.signatures)),
            "compilers": self.compilers,
            "dynamo_s": round(self.dynamo_s, 3),
            "compile_s": round(self.backend.compile_s, 3),
            "total_s": round(self.total_s, 3),
            "cache_dir": str(self.cache.dir),
            "cache_hit": self.backend.cache_hit,
            "traces": self.backend.traces,
            "pieces": self.backend.pieces_info,
        }
