"""Compile one piece for the general (symbolic) token count: `eager` or `inductor`.

`eager` runs the FX piece as it is. `inductor` goes through `torch._inductor.standalone_compile`
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

COMPILERS = ("eager", "inductor")


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
    if compiler != "inductor":
        raise ValueError(f"unknown piece compiler {compiler!r}; choose one of {COMPILERS}")
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
    artifact = torch._inductor.standalone_compile(gm, list(args), dynamic_shapes="from_graph")
    cache.save_artifact(name, lambda path: artifact.save(path=str(path), format="binary"))
    fn = _with_piece_convention(artifact, _returns_tuple(gm))
    return CompiledPiece(fn, "compiled", time.perf_counter() - start)
