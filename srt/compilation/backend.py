"""The torch.compile backend: Dynamo hands it the traced forward once; it checks that the graph
is general in the token count, splits it, compiles each distinct piece once per compiler, and
returns the split graph with its pieces replaced by `Router` slots, as a `CompiledForward`
that can be saved and, on a warm start, restored (its pieces loaded) without Dynamo. In the
partition mode (`partition=True`, Inductor only) it compiles the whole graph instead, Inductor
cutting it at the split ops, and routes the partitions through the same slots
(`partition_compiler`), as a `PartitionedForward`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._logging import trace_structured
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from srt.compilation.cache import CompileCache
from srt.compilation.dispatch import PieceFn, Router
from srt.compilation.errors import ShapeSpecializationError
from srt.compilation.graph_passes import applying, passes_tag, whole_graph_passes
from srt.compilation.op_registry import split_ops
from srt.compilation.piece_compiler import (
    DYNAMO_FREE_COMPILERS,
    INDUCTOR_COMPILERS,
    CompiledPiece,
    compile_piece,
    load_piece,
)
from srt.compilation.split import SplitGraph, piece_signature, readable_graph, split_graph

if TYPE_CHECKING:
    from srt.compilation.compiled_forward import CompiledForward, PartitionedForward
    from srt.compilation.partition_compiler import CompiledWhole

logger = logging.getLogger(__name__)

_HOW = {"eager": "the FX piece as is", "compiled": "compiled", "loaded": "loaded from the cache"}
MIN_TOKENS = 2  # Dynamo specialises sizes 0 and 1, so the symbolic range starts at 2 ...
SERVED_MIN_TOKENS = 1  # ... but with the guards dropped the general graph runs 1 token too


@dataclass(frozen=True)
class GraphInput:
    """One input of the traced graph: Dynamo's name for it (after its source: `L_self_modules_
    layers_modules_0_..._parameters_weight_`, `L_input_ids_`), its fake example, and whether
    the graph reads it."""

    name: str
    example: Any
    read: bool


@dataclass
class TokenDecision:
    """A value Dynamo computed from the token count for the Python code it traced."""

    expr: sympy.Basic
    value: object
    where: str


@contextmanager
def recording_token_decisions() -> Iterator[list[TokenDecision]]:
    """Record every value Dynamo computes from a size expression for the traced Python code
    (`if x.shape[0] == 1:`, `int(n)`, `range(n)`): the list fills while the trace runs.

    Why not the guards alone: Dynamo's range for the token symbol starts at 2, so it decides
    `x.shape[0] == 1` statically, adding no guard, and the one-token branch silently vanishes
    from the graph that then serves one-token batches (a decode of one request). Dynamo's own
    size checks inside operators do not come through here, only the traced code's."""
    from torch._dynamo.variables.tensor import SymNodeVariable

    real = SymNodeVariable.evaluate_expr
    decisions: list[TokenDecision] = []

    def evaluate_expr(self: SymNodeVariable, output_graph: Any = None) -> Any:
        value = real(self, output_graph)
        sym = self.sym_num
        if isinstance(sym, torch.SymInt | torch.SymBool | torch.SymFloat):
            node = sym.node
            if node.expr.free_symbols:
                where = str(node.shape_env._get_sloc()).strip() or "unknown location"
                decisions.append(TokenDecision(node.expr, value, where))
        return value

    # A deliberate patch of Dynamo's method: it has no hook for the decisions it makes.
    SymNodeVariable.evaluate_expr = evaluate_expr  # type: ignore[method-assign]
    try:
        yield decisions
    finally:
        SymNodeVariable.evaluate_expr = real  # type: ignore[method-assign]


def check_token_guards(
    shape_env: ShapeEnv, max_tokens: int, decisions: Sequence[TokenDecision] = ()
) -> None:
    """Raise if tracing made the graph depend on the token count: a shape guard, or a value
    the traced code computed from the count (`decisions`), that is not the same for every
    count the general graph serves, [SERVED_MIN_TOKENS, max_tokens]. Two inputs' token
    counts being equal is fine (they are one symbol)."""
    served = ValueRanges(SERVED_MIN_TOKENS, max_tokens)

    def fixed(expr: sympy.Basic) -> bool:
        return bound_sympy(expr, {s: served for s in expr.free_symbols}).is_singleton()

    problems: dict[str, str] = {}
    for guard in shape_env.guards:
        expr = guard.expr
        if isinstance(expr, sympy.Eq) and all(isinstance(a, sympy.Symbol) for a in expr.args):
            continue
        if not fixed(expr):
            where = str(guard.sloc).strip() or "unknown location"
            problems.setdefault(str(expr), f"`{expr}` ({where})")
    for d in decisions:
        if not fixed(d.expr):
            problems.setdefault(str(d.expr), f"`{d.expr}`, {d.value} when traced ({d.where})")
    if problems:
        raise ShapeSpecializationError(
            "the model forward depends on the token count, so one graph cannot serve every "
            f"batch size from {SERVED_MIN_TOKENS} to {max_tokens} tokens: tracing depended on "
            f"{'; '.join(problems.values())}. Remove the Python branch on a tensor size (or "
            "the size used as a constant) in the forward."
        )


# Operators that decide by themselves whether a dimension is 1: squeeze with no dimension
# drops every size-1 dimension, and with one it drops it only if its size is 1.
SQUEEZES = {"squeeze", "squeeze_", torch.squeeze, torch.Tensor.squeeze, torch.Tensor.squeeze_}


def _squeezed_dims(node: fx.Node, ndim: int) -> list[int]:
    """The dimensions a squeeze node may drop (every one when it names none)."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None:
        return list(range(ndim))
    dims = dim if isinstance(dim, tuple | list) else [dim]
    return [d % ndim for d in dims if isinstance(d, int)]


def _symbolic(size: int | torch.SymInt) -> bool:
    """Whether a size is the token count (an expression of it), not a constant."""
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


def _source_line(node: fx.Node) -> str:
    """Where the traced code called `node`: the last frame of its stack trace."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    lines = [line for line in lines if line]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return "unknown location"
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) else ""
    return f"{lines[last]}: `{code}`" if code else lines[last]


def check_size_one_ops(gm: fx.GraphModule) -> None:
    """Raise for an operator whose result depends on whether a token-count dimension is 1
    (`x.squeeze()` on a [T, 1, H] tensor gives [T, H], and [H] for one token). Dynamo's token
    symbol starts at 2, so such an operator is traced for the general count, guard-free, and
    the general graph then serves one token with the other shape: Inductor compiles it the
    general way, and eager PyTorch, for one token, the other."""
    problems = []
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function") or node.target not in SQUEEZES:
            continue
        arg = node.args[0] if node.args else None
        value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        token_dims = [d for d in _squeezed_dims(node, value.dim()) if _symbolic(value.shape[d])]
        if token_dims:
            name = getattr(node.target, "__name__", node.target)
            problems.append(
                f"`{name}` may drop dimension {token_dims[0]} of a {tuple(value.shape)} tensor, "
                f"the token count ({_source_line(node)})"
            )
    if problems:
        raise ShapeSpecializationError(
            "the model forward has an operator that decides by itself whether the token count "
            "is 1, so one graph cannot serve every batch size: "
            f"{'; '.join(problems)}. Name the dimensions it may drop (squeeze(dim) on a "
            "dimension whose size is fixed), or reshape to the shape meant."
        )


def _piece_args(
    split: SplitGraph, example_inputs: Sequence[Any], fake_mode: FakeTensorMode
) -> dict[str, tuple[Any, ...]]:
    """Each submodule's fake arguments, by running the split graph on fake inputs."""
    fake_inputs = [
        fake_mode.from_tensor(a)
        if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor)
        else a
        for a in example_inputs
    ]
    recorded: dict[str, tuple[Any, ...]] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target: fx.node.Target, args: tuple, kwargs: dict) -> Any:
            assert isinstance(target, str), "a call_module target is the submodule's name"
            recorded[target] = args
            return super().call_module(target, args, kwargs)

    with fake_mode, enable_python_dispatcher():
        Recorder(split.module).run(*fake_inputs)
    return recorded


class PiecewiseBackend:
    def __init__(
        self,
        compilers: Sequence[str],
        cache: CompileCache,
        router: Router,
        max_tokens: int,
        title: str,
        partition: bool = False,
        passes: Sequence[str] = (),
        device: torch.device | None = None,
    ) -> None:
        if partition and list(compilers) != ["inductor"]:
            raise ValueError(f"the partition mode compiles with Inductor alone, not {compilers}")
        if passes and "inductor" not in compilers:
            raise ValueError(f"graph passes run inside Inductor, not {compilers}")
        whole = whole_graph_passes(passes)
        if whole and not partition:
            raise ValueError(f"graph passes {whole} see across the split ops: partition mode only")
        self.partition = partition
        self.passes = tuple(passes)
        # Every artifact's name ends with it: one compiled with other passes is another.
        self.passes_tag = passes_tag(passes)
        self.pass_matches: dict[str, int] | None = None  # per pass, when compiled here
        self.compilers = list(compilers)
        self.device = device or torch.device("cpu")  # where the pieces run (AOTInductor's)
        self.cache = cache
        self.router = router
        self.max_tokens = max_tokens
        self.title = title
        self.split: SplitGraph | None = None  # the piecewise mode's
        self.num_partitions = 0  # the partition mode's
        self.signatures: list[str] = []
        self.general: dict[str, list[PieceFn]] = {}
        self.pieces_info: list[dict[str, Any]] = []
        self.compile_s = 0.0
        self.traces = 0
        self.decisions: list[TokenDecision] = []  # filled while tracing (PiecewiseModel.trace)
        # The traced graph's inputs, in order: each placeholder's name, its fake example and
        # whether a node reads it (what `bound_forward` binds a warm start's call to); and
        # whether the graph returns one value.
        self.graph_inputs: list[GraphInput] = []
        self.single_output = False
        self.compiled: CompiledForward | None = None  # the piecewise mode's, when traced here

    @property
    def dynamo_free(self) -> bool:
        """Whether a warm start can run the saved split graph without Dynamo: every piece
        loads without the compiler (`eager`, `aot_inductor`)."""
        return not self.partition and all(c in DYNAMO_FREE_COMPILERS for c in self.compilers)

    @property
    def cache_hit(self) -> bool | None:
        """Whether every Inductor piece came from the cache; None without Inductor."""
        sources = [
            p[c]["source"]
            for p in self.pieces_info
            for c in self.compilers
            if c in INDUCTOR_COMPILERS and p[c]["source"] != "shared"
        ]
        return all(s == "loaded" for s in sources) if sources else None

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list[Any]
    ) -> CompiledForward | PartitionedForward:
        start = time.perf_counter()
        self.traces += 1
        fake_mode = detect_fake_mode(example_inputs)
        assert fake_mode is not None and fake_mode.shape_env is not None, (
            "Dynamo calls its backend with fake inputs of a dynamic-shape trace"
        )
        check_token_guards(fake_mode.shape_env, self.max_tokens, self.decisions)
        check_size_one_ops(gm)
        with applying(self.passes) as log:
            forward = self._compile(gm, example_inputs, fake_mode)
        # Passes run only in the compiles that did not load (a loaded artifact has them).
        ran = any(log.matches.values())
        self.pass_matches = log.totals() if ran else None
        self.compile_s = time.perf_counter() - start
        return forward

    def _compile(
        self, gm: fx.GraphModule, example_inputs: list[Any], fake_mode: Any
    ) -> CompiledForward | PartitionedForward:
        if self.partition:
            return self._compile_whole(gm, example_inputs)
        # Dynamo's example of each (fake, with the token count's symbol; the call's own
        # example inputs are the real tensors).
        self.graph_inputs = [
            GraphInput(str(node.target), node.meta.get("example_value", example), bool(node.users))
            for node, example in zip(
                (n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs, strict=True
            )
        ]
        output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
        self.single_output = isinstance(output.args[0], tuple | list) and len(output.args[0]) == 1
        split = split_graph(gm)
        logger.info(
            "split at %s: %d compilable pieces, %d split regions",
            split_ops(),
            len(split.pieces),
            len(split.regions),
        )
        from srt.compilation.compiled_forward import CompiledForward  # Dynamo, loaded by now

        args = _piece_args(split, example_inputs, fake_mode)
        signatures = [piece_signature(split.submodule(name), args[name]) for name in split.pieces]
        forward = CompiledForward(split, signatures)
        self.compiled = forward
        self._set_pieces(
            split,
            signatures,
            lambda compiler, name, artifact: compile_piece(
                compiler, split.submodule(name), args[name], self.cache, artifact, self.device
            ),
        )
        return forward

    def restore(self, forward: CompiledForward | PartitionedForward) -> bool:
        """Route a saved forward's pieces (or partitions), each loaded from the cache (nothing
        traced or compiled); False, routing nothing, when the cache lacks one of them."""
        from srt.compilation.compiled_forward import PartitionedForward
        from srt.compilation.partition_compiler import load_whole

        start = time.perf_counter()
        if isinstance(forward, PartitionedForward) != self.partition:
            return False  # a capture of the other mode (the cache key tells them apart)
        if isinstance(forward, PartitionedForward):
            whole = load_whole(self.cache, forward.artifact, self.router.slot)
            if whole is None:
                logger.info("compile cache: no usable %s; tracing again", forward.artifact)
                return False
            self._set_whole(forward, whole)
            self.compile_s = time.perf_counter() - start
            return True
        return self.restore_pieces(forward.split, forward.signatures)

    def restore_pieces(self, split: SplitGraph, signatures: list[str]) -> bool:
        """Route a saved split graph's pieces, each loaded from the cache; False, routing
        nothing, when the cache lacks one of them."""
        start = time.perf_counter()
        missing: list[str] = []

        def load(compiler: str, name: str, artifact: str) -> CompiledPiece | None:
            piece = load_piece(compiler, split.submodule(name), self.cache, artifact, self.device)
            if piece is None:
                missing.append(artifact)
            return piece

        if not self._set_pieces(split, signatures, load):
            logger.info("compile cache: no usable artifact %s; tracing again", missing[0])
            self.pieces_info, self.signatures = [], []
            return False
        self.compile_s = time.perf_counter() - start
        return True

    def _compile_whole(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> PartitionedForward:
        """The partition mode: `gm` compiled whole by Inductor, cut at the split ops."""
        from srt.compilation.compiled_forward import PartitionedForward
        from srt.compilation.partition_compiler import compile_whole

        signature = piece_signature(gm, example_inputs)
        name = f"inductor-partition-{signature}-t{self.max_tokens}{self.passes_tag}"
        forward = PartitionedForward(name, signature)
        whole = compile_whole(gm, example_inputs, self.cache, name, self.router.slot)
        self._set_whole(forward, whole)
        text = "\n".join(
            [
                f'"""{self.title}: the traced forward, compiled whole by Inductor with '
                f"partitions at {', '.join(split_ops())} ({len(whole.partitions)} partitions; "
                f'signature {signature})."""',
                "",
                gm.print_readable(print_output=False),
            ]
        )
        self._write_graph(text)
        return forward

    def _set_whole(self, forward: PartitionedForward, whole: CompiledWhole) -> None:
        forward.fn = whole.fn
        signature = forward.signature
        self.signatures = [signature]
        self.num_partitions = len(whole.partitions)
        self.pieces_info = [
            {
                "piece": "whole graph",
                "partitions": self.num_partitions,
                "signature": signature,
                "inductor": {"source": whole.source, "s": round(whole.seconds, 3)},
            }
        ]
        self.general = {"inductor": whole.partitions}
        self.router.fallback = whole.partitions
        logger.info(
            "whole graph, inductor: %s in %.2f s, %d partitions at %s",
            _HOW[whole.source],
            whole.seconds,
            self.num_partitions,
            split_ops(),
        )

    def _set_pieces(
        self,
        split: SplitGraph,
        signatures: list[str],
        build: Callable[[str, str, str], CompiledPiece | None],
    ) -> bool:
        """Build (`build(compiler, submodule, artifact name)`) each distinct piece per compiler
        and route the split graph through them; False, routing nothing, if one gives None."""
        self.signatures = signatures
        self.pieces_info = [
            {"piece": i, "submodule": name, "signature": sig}
            for i, (name, sig) in enumerate(zip(split.pieces, signatures, strict=True))
        ]
        general = {}
        for compiler in self.compilers:
            fns = self._pieces(compiler, split, build)
            if fns is None:
                return False
            general[compiler] = fns
        self.general = general
        for i, name in enumerate(split.pieces):
            # The instance attribute shadows the submodule: the split graph's code calls
            # `self.submod_N(...)`, which now goes through the router.
            split.module.__dict__[name] = self.router.slot(i)
        self.router.fallback = self.general[self.compilers[0]]
        self.split = split
        self._write_graph(readable_graph(split, self.title, self.signatures))
        return True

    def _write_graph(self, text: str) -> None:
        """The graph as compiled, readable, in the entry and in the structured trace."""
        path = self.cache.write_text("computation_graph.py", text)
        logger.info("the graph as compiled written to %s", path)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "srt_computation_graph", "encoding": "string"},
            payload_fn=lambda: text,
            # Outside a compile there is no trace id; expecting one, torch would record the
            # caller's stack, which imports Dynamo (seconds) on a warm start that needs none.
            expect_trace_id=False,
        )

    def _pieces(
        self,
        compiler: str,
        split: SplitGraph,
        build: Callable[[str, str, str], CompiledPiece | None],
    ) -> list[PieceFn] | None:
        first_with: dict[str, int] = {}  # signature -> first piece that has it
        fns: list[PieceFn] = []
        for i, name in enumerate(split.pieces):
            sig = self.signatures[i]
            if sig in first_with:
                fns.append(fns[first_with[sig]])
                self.pieces_info[i][compiler] = {
                    "source": "shared",
                    "s": 0.0,
                    "shares": first_with[sig],
                }
                logger.info(
                    "piece %d (%s), %s: shares the artifact of piece %d",
                    i,
                    name,
                    compiler,
                    first_with[sig],
                )
                continue
            first_with[sig] = i
            # The token range shapes codegen, so it is part of the name.
            tag = self.passes_tag if compiler in INDUCTOR_COMPILERS else ""
            piece = build(compiler, name, f"{compiler}-{sig}-t{self.max_tokens}{tag}")
            if piece is None:
                return None
            fns.append(piece.fn)
            self.pieces_info[i][compiler] = {"source": piece.source, "s": round(piece.seconds, 3)}
            logger.info(
                "piece %d (%s), %s: %s in %.2f s",
                i,
                name,
                compiler,
                _HOW[piece.source],
                piece.seconds,
            )
        return fns
