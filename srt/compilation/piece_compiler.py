"""Compile one piece for the general (symbolic) token count: `eager`, `aot_eager` or `inductor`.

`eager` runs the FX piece as it is. `aot_eager` (a debugging compiler, for
`srt.tools.compile_bisect`; not served) runs it through AOTAutograd's tracing without
Inductor: a piece that differs only there points at the trace, not the code generation.
`inductor` goes through `torch._inductor.standalone_compile`
with the piece's symbolic shapes (`dynamic_shapes="from_graph"`), and the result is saved as a
`CompiledArtifact` in the compile cache; a warm start loads it back without compiling (`load_piece`,
which a warm start that skips the trace calls alone). Run both
inside `CompileCache.inductor_session()`, so that the C++ / Triton builds an artifact refers to
are in the entry (checked) on the next start too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from srt.compilation.cache import CompileCache
from srt.compilation.dispatch import PieceFn
from srt.compilation.errors import CompilerMissingError

COMPILERS = ("eager", "inductor")  # what a phase can be compiled with
DEBUG_COMPILERS = ("aot_eager",)


@dataclass
class CompiledPiece:
    fn: PieceFn
    source: str  # "eager" (nothing to compile), "compiled", or "loaded" (from the cache)
    seconds: float


def _returns_tuple(gm: fx.GraphModule) -> bool:
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    return isinstance(output.args[0], tuple | list)


def _with_piece_convention(artifact: Any, returns_tuple: bool) -> PieceFn:
    """Inductor returns a list of outputs where the piece returns one value; undo that."""
    if returns_tuple:
        return artifact

    def run(*args: Any) -> Any:
        out = artifact(*args)
        return out[0] if isinstance(out, list | tuple) else out

    return run


def with_tuple_output(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` returning a tuple (AOTAutograd takes no other output)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            out = fx.node.map_arg(node.args[0], lambda n: env[n])
            graph.output(tuple(out) if isinstance(out, tuple | list) else (out,))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def aot_eager(gm: fx.GraphModule, args: Sequence[Any]) -> PieceFn:
    """`gm` through AOTAutograd's trace, run eagerly; returns a tuple."""
    from torch._dynamo.backends.debugging import aot_eager as backend

    # No AOTAutograd cache entry: under `aot_compile` (torch 2.11) it would insist that the
    # compiled forward be Inductor's output code, which an eager run is not.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return backend(with_tuple_output(gm), list(args))


def require_cpp_compiler() -> None:
    """Raise unless Inductor finds its C++ compiler. Inductor on the CPU needs it at every
    start, a warm one too, though it then compiles nothing: to find a kernel it has built it
    keys the build by the compiler's version and command line, asked of the compiler, and it
    probes the CPU's vector ISA by compiling small programs; none of this can be answered for
    it from the cache without replacing parts of Inductor that are not public."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as e:
        raise CompilerMissingError(
            "Inductor on the CPU needs a C++ compiler at every start, a warm one too (it asks "
            "the compiler for its version to find each kernel it built, and compiles probes of "
            f"the CPU's vector ISA): {e}. Install g++ or point CXX at one, or compile the "
            "pieces with --cuda-graph-tc-compiler eager"
        ) from None


def _load_inductor(path: Path) -> Any:
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")


def load_piece(
    compiler: str, gm: fx.GraphModule, cache: CompileCache, name: str
) -> CompiledPiece | None:
    """The general callable of piece `gm` without compiling: the FX piece (`eager`) or its
    artifact `name` in `cache` (`inductor`); None when the cache has no usable artifact."""
    start = time.perf_counter()
    if compiler == "eager":
        return CompiledPiece(gm, "eager", 0.0)
    if compiler == "aot_eager":  # nothing saved: a debugging compiler always traces anew
        return None
    if compiler != "inductor":
        known = COMPILERS + DEBUG_COMPILERS
        raise ValueError(f"unknown piece compiler {compiler!r}; choose one of {known}")
    artifact = cache.load_artifact(name, _load_inductor)
    if artifact is None:
        return None
    fn = _with_piece_convention(artifact, _returns_tuple(gm))
    return CompiledPiece(fn, "loaded", time.perf_counter() - start)


def compile_piece(
    compiler: str, gm: fx.GraphModule, args: Sequence[Any], cache: CompileCache, name: str
) -> CompiledPiece:
    """The general callable of piece `gm` (`args`: its fake example inputs), loaded when the
    cache has it, else compiled and saved; `name` keys its artifact in `cache`."""
    start = time.perf_counter()
    piece = load_piece(compiler, gm, cache, name)
    if piece is not None:
        return piece
    if compiler == "aot_eager":
        fn = _with_piece_convention(aot_eager(gm, args), _returns_tuple(gm))
        return CompiledPiece(fn, "compiled", time.perf_counter() - start)
    artifact = torch._inductor.standalone_compile(gm, list(args), dynamic_shapes="from_graph")
    cache.save_artifact(name, lambda path: artifact.save(path=str(path), format="binary"))
    fn = _with_piece_convention(artifact, _returns_tuple(gm))
    return CompiledPiece(fn, "compiled", time.perf_counter() - start)
