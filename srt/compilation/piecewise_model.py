"""A model forward traced once by Dynamo, split at the split ops, its pieces compiled up front;
saved, so that a warm start loads it instead of tracing.

    pm = PiecewiseModel(model, compilers=["inductor"], cache=cache, max_tokens=8192)
    with forward_context(dummy):             # builds the graph (no forward runs)
        pm.trace(dummy.input_ids, dummy.positions)
    with forward_context(batch):
        hidden = pm(batch.input_ids, batch.positions, dispatcher, bucket)

Tracing: Dynamo's ahead-of-time capture (`torch.compile(...).aot_compile`, fullgraph, no
dynamic shapes but the marked ones) of the model class's forward, with the token dimension of
`input_ids` and `positions` marked dynamic over [2, max_tokens] (one symbol: tracing proves
them equal; Dynamo specialises 0 and 1, so the symbol starts at 2, but the general graph also
runs one-token batches). A graph break, or a guard or a decision of the traced code that is
not the same for every count from 1 to max_tokens (a Python branch on the token count, even
`x.shape[0] == 1`, which Dynamo decides without a guard), fails the trace with a
`CompilationError` naming it. Every guard is dropped (`guard_filter_fn`; `keep_shape_guards`
keeps the shape guards, for debugging, and checks them on every call): what runs is Dynamo's
code for the forward (which reads the weights off the model and calls the split graph), as a
plain function, so no batch size can make Dynamo trace again.

Warm start: the capture (Dynamo's code for the forward, its guards, the split graph as FX code
and the piece signatures) is an artifact of the compile cache, checked as every artifact is
(bound to the entry, sha256); loading it and then each piece's artifact replaces the trace.
A damaged or stale one is logged, removed and traced again, as is a saved graph whose pieces
the cache lacks. Where every piece loads without the compiler (`eager`, `aot_inductor`), the
capture is saved without Dynamo instead (`bound_forward`: the split graph, its inputs bound by
name), and a warm start imports neither Dynamo nor Inductor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from srt.compilation.backend import MIN_TOKENS, PiecewiseBackend, recording_token_decisions
from srt.compilation.bound_forward import BoundForward, UnboundInput, bind_inputs
from srt.compilation.cache import CompileCache
from srt.compilation.compile_info import CompileInfo
from srt.compilation.dispatch import BucketDispatcher, PieceFn, Router
from srt.compilation.errors import CompilationError, GraphBreakError, ShapeSpecializationError
from srt.compilation.op_registry import inductor_trace, split_ops
from srt.compilation.piece_compiler import INDUCTOR_COMPILERS, require_cpp_compiler

if TYPE_CHECKING:  # imports Dynamo, which only tracing or loading needs
    from torch._dynamo.aot_compile import AOTCompiledFunction

logger = logging.getLogger(__name__)


def _guard_filter(keep_shape_guards: bool) -> Callable[[Sequence[Any]], list[bool]]:
    """Which of Dynamo's guards to keep: none, or only the shape guards (for debugging)."""
    if keep_shape_guards:
        return lambda entries: [e.guard_type == "SHAPE_ENV" for e in entries]
    return lambda entries: [False for _ in entries]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _load_capture(path: Path) -> AOTCompiledFunction:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AOTCompiledFunction.deserialize(path.read_bytes())


class PiecewiseModel:
    def __init__(
        self,
        model: nn.Module,
        *,
        compilers: Sequence[str],
        cache: CompileCache,
        max_tokens: int,
        keep_shape_guards: bool = False,
        partition: bool = False,
        passes: Sequence[str] = (),
    ) -> None:
        if max_tokens < MIN_TOKENS:
            raise ValueError(f"max_tokens must be at least {MIN_TOKENS}, got {max_tokens}")
        self.model = model
        self.compilers = list(compilers)
        self.cache = cache
        self.max_tokens = max_tokens
        self.keep_shape_guards = keep_shape_guards
        self.partition = partition
        self.router = Router()
        self.backend = PiecewiseBackend(
            self.compilers,
            cache,
            self.router,
            max_tokens,
            type(model).__name__,
            partition,
            passes,
            device=next(model.parameters()).device,
        )
        # The saved capture serves every trace with these compilers, this mode, these passes
        # and this token range.
        mode = "-partition" if partition else ""
        self.capture_name = (
            f"graph-{'-'.join(self.compilers)}{mode}-t{max_tokens}{self.backend.passes_tag}"
        )
        # Where every compiler loads without Dynamo, the capture saved without it.
        self.bound_name = f"bound-{self.capture_name}"
        self.forward: AOTCompiledFunction | BoundForward | None = None
        self.graph_source: str | None = None  # "traced" or "loaded" (from the cache)
        self.dynamo_s = 0.0
        self.graph_load_s = 0.0
        self.total_s = 0.0

    @property
    def traced(self) -> bool:
        return self.forward is not None

    def trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Build the general graph (inside the caller's forward context): load the saved
        capture and its pieces, or trace and compile, then save the capture."""
        if self.traced:
            raise CompilationError("the model is already traced; it is traced once")
        if "inductor" in self.compilers and input_ids.device.type == "cpu":
            require_cpp_compiler()  # before anything loads: a clear error, not one mid-load
        # Inductor's loads read its cache directory, so they run in the entry's session;
        # AOTInductor's packages hold all they need, so only their compiles do.
        loads_in_session = "inductor" in self.compilers
        compiles = any(c in INDUCTOR_COMPILERS for c in self.compilers)
        start = time.perf_counter()
        with torch.inference_mode():
            forward = None if loads_in_session else self._timed_load()
            if forward is None:
                with self.cache.inductor_session() if compiles else nullcontext():
                    if compiles:  # (again, in the entry's lock: another process may have
                        forward = self._timed_load()  # compiled it while this one waited)
                    if forward is None:
                        forward = self._trace_and_save(input_ids, positions)
        if self.graph_source is None:
            self.graph_source = "loaded"
            self.graph_load_s -= self.backend.compile_s  # the pieces' share
        if isinstance(forward, BoundForward):
            forward.bind(self.model)
        elif not self.keep_shape_guards:
            forward.disable_guard_check()  # no guards to check
        self.forward = forward
        self.total_s = time.perf_counter() - start
        logger.info(
            "Dynamo transform took %.2f s%s",
            self.dynamo_s,
            f" (skipped: graph loaded in {self.graph_load_s:.2f} s)"
            if self.graph_source == "loaded"
            else "",
        )
        logger.info(
            "torch.compile took %.2f s in total (pieces %.2f s; compile cache %s, %s; %s)",
            self.total_s,
            self.backend.compile_s,
            self.cache.dir,
            {True: "hit", False: "miss", None: "not used"}[self.backend.cache_hit],
            "the split graph runs without Dynamo"
            if isinstance(forward, BoundForward)
            else "Dynamo's code runs the split graph",
        )

    def _timed_load(self) -> AOTCompiledFunction | BoundForward | None:
        before = time.perf_counter()
        forward = self._load()
        self.graph_load_s += time.perf_counter() - before
        return forward

    def _trace_and_save(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> AOTCompiledFunction | BoundForward:
        """Trace and compile; save the capture: without Dynamo where its inputs bind
        (`bound_forward`), else Dynamo's."""
        traced_at = time.perf_counter()
        forward = self._trace(input_ids, positions)
        self.dynamo_s = time.perf_counter() - traced_at - self.backend.compile_s
        self.graph_source = "traced"
        bound = self._bound() if self.backend.dynamo_free and not self.keep_shape_guards else None
        if bound is None:
            self._save(self.capture_name, lambda path: forward.save_compiled_function(str(path)))
            return forward
        self._save(self.bound_name, bound.save)
        return bound

    def _bound(self) -> BoundForward | None:
        """The traced forward as a `BoundForward`, or None (logged) where an input of the
        graph does not bind."""
        compiled, split = self.backend.compiled, self.backend.split
        assert compiled is not None and split is not None, "the piecewise mode traced"
        try:
            if not self.backend.single_output:
                raise UnboundInput("the graph returns more than one value")
            slots = bind_inputs(self.model, self.backend.graph_inputs)
        except UnboundInput as e:
            logger.info("the split graph keeps Dynamo's code at every start: %s", e)
            return None
        return BoundForward(split, compiled.signatures, slots, compiled.saved)

    def _load(self) -> AOTCompiledFunction | BoundForward | None:
        """The saved capture with its pieces loaded, or None (nothing saved, or a piece
        missing from the cache: then it traces again); without Dynamo where it can."""
        if self.backend.dynamo_free and not self.keep_shape_guards:
            bound = self.cache.load_artifact(self.bound_name, BoundForward.load)
            if bound is not None:
                return bound if self.backend.restore_pieces(bound.split, bound.signatures) else None
        if not self.cache.artifact_path(self.capture_name).exists():
            return None  # (Dynamo is imported only to load a capture there is)
        saved = self.cache.load_artifact(self.capture_name, _load_capture)
        if saved is None:
            return None
        from srt.compilation.compiled_forward import CompiledForward, PartitionedForward

        # The deserialised backend output: the split graph, to route through loaded pieces
        # (or the whole graph's artifact name, in the partition mode).
        forward = saved._artifacts.compiled_fn
        if not isinstance(forward, CompiledForward | PartitionedForward):
            return None
        if not self.backend.restore(forward):
            return None
        return saved

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> AOTCompiledFunction:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        for t in (input_ids, positions):
            torch._dynamo.mark_dynamic(t, 0, min=MIN_TOKENS, max=self.max_tokens)
        # torch 2.11 attaches `aot_compile` to the compiled function only with this flag on.
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(
                type(self.model).forward,
                backend=self.backend,
                fullgraph=True,
                dynamic=False,
                options={"guard_filter_fn": _guard_filter(self.keep_shape_guards)},
            )
        try:
            with (
                recording_token_decisions() as self.backend.decisions,
                # One trace serves every compiler: with Inductor among them, the layer ops
                # left at their default trace their reference, for Inductor to fuse.
                inductor_trace("inductor" in self.compilers),
            ):
                # Attached to the compiled function at run time, unknown to its type.
                aot_compile = compiled.aot_compile  # type: ignore[attr-defined]
                forward = aot_compile(((self.model, input_ids, positions), {}))
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(
                f"the model forward does not trace as one graph (fullgraph=True): {_first_line(e)}"
            ) from e
        except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as e:
            raise ShapeSpecializationError(
                f"the model forward depends on the token count: {_first_line(e)}"
            ) from e
        assert isinstance(forward, AOTCompiledFunction)
        return forward

    def _save(self, name: str, save: Callable[[Path], object]) -> None:
        try:
            self.cache.save_artifact(name, save)
        except Exception as e:  # the server runs without it; only the next start traces
            logger.warning(
                "compile cache: cannot save the traced graph (%s: %s); a restart traces again",
                type(e).__name__,
                e,
            )

    def general(self, compiler: str) -> list[PieceFn]:
        """The general callable of each piece (each partition, in the partition mode) for
        `compiler` (one of those traced with)."""
        return self.backend.general[compiler]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        dispatcher: BucketDispatcher,
        bucket: int | None,
    ) -> torch.Tensor:
        assert self.forward is not None, "trace() first"
        with torch.inference_mode(), self.router.route(dispatcher, bucket):
            return self.forward(self.model, input_ids, positions)

    def info(self) -> CompileInfo:
        split = self.backend.split
        return CompileInfo(
            split_ops=tuple(split_ops()),
            mode="partition" if self.partition else "piecewise",
            passes=self.backend.passes,
            pass_matches=self.backend.pass_matches,
            num_pieces=len(split.pieces) if split else self.backend.num_partitions,
            num_split_regions=len(split.regions) if split else 0,
            num_unique_pieces=len(set(self.backend.signatures)),
            compilers=tuple(self.compilers),
            graph_source=self.graph_source,
            bound=isinstance(self.forward, BoundForward) if self.forward is not None else None,
            dynamo_s=round(self.dynamo_s, 3),
            graph_load_s=round(self.graph_load_s, 3),
            compile_s=round(self.backend.compile_s, 3),
            total_s=round(self.total_s, 3),
            cache_dir=str(self.cache.dir),
            cache_hit=self.backend.cache_hit,
            traces=self.backend.traces,
            pieces=tuple(self.backend.pieces_info),
        )
