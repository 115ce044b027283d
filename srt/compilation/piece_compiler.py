"""Compile one piece for the general (symbolic) token count: `eager`, `aot_eager`, `inductor`
or `aot_inductor`.

`eager` runs the FX piece as it is. `aot_eager` (a debugging compiler, for
`srt.tools.compile_bisect`; not served) runs it through AOTAutograd's tracing without
Inductor: a piece that differs only there points at the trace, not the code generation.
`inductor` goes through `torch._inductor.standalone_compile`
with the piece's symbolic shapes (`dynamic_shapes="from_graph"`), and the result is saved as a
`CompiledArtifact` in the compile cache; a warm start loads it back without compiling (`load_piece`,
which a warm start that skips the trace calls alone). Run both
inside `CompileCache.inductor_session()`, so that the C++ / Triton builds an artifact refers to
are in the entry (checked) on the next start too.

`aot_inductor` compiles the piece ahead of time with AOTInductor into a package (a shared
library with its kernels, `.pt2`), saved as the artifact; a warm start loads it with torch's
own C++ loader (`torch._C._aoti`), which imports neither Inductor nor Dynamo: `import
torch._inductor` alone imports Dynamo and the compiler, 1.2-2.1 s on a 2-core CPU, where the
package loads in milliseconds. Its compile is slower (a C++ wrapper built per piece).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from srt.compilation.cache import CompileCache
from srt.compilation.dispatch import PieceFn
from srt.compilation.errors import CompilationError, CompilerMissingError

COMPILERS = ("eager", "inductor", "aot_inductor")  # what a phase can be compiled with
DEBUG_COMPILERS = ("aot_eager",)
INDUCTOR_COMPILERS = ("inductor", "aot_inductor")  # Inductor compiles: its session, its key
# What a warm start loads without importing Dynamo or Inductor (`bound_forward`).
DYNAMO_FREE_COMPILERS = ("eager", "aot_inductor")


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


def tensor_inputs_only(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """`gm` taking only its tensor inputs: each size symbol it reads becomes the size of the
    first tensor input with that dimension, and one it does not read is dropped (AOTInductor
    runs a graph of tensor inputs: its package takes tensors only)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    dims: dict[str, tuple[fx.Node, int]] = {}  # size symbol -> (tensor input, dimension)
    for node, arg in zip(placeholders, args, strict=True):
        if isinstance(arg, torch.Tensor):
            shape: tuple[Any, ...] = tuple(arg.shape)  # SymInts where the size is symbolic
            for d, size in enumerate(shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(str(size.node.expr), (node, d))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    sizes: list[tuple[fx.Node, str]] = []
    for node, arg in zip(placeholders, args, strict=True):
        if isinstance(arg, torch.Tensor):
            env[node] = graph.node_copy(node, lambda n: env[n])
        elif node.users:
            sizes.append((node, str(arg.node.expr) if isinstance(arg, torch.SymInt) else str(arg)))
    for node, expr in sizes:
        if expr not in dims:
            raise CompilationError(
                f"aot_inductor: piece input {node.name} ({expr}) is an integer that no tensor "
                "input's size gives; the package takes tensors only"
            )
        tensor, d = dims[expr]
        env[node] = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], d))
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def _aot_inductor_package(gm: fx.GraphModule, args: Sequence[Any], path: Path) -> None:
    """Compile `gm` (its fake example inputs `args`) with AOTInductor into a package at
    `path` (a `.pt2`: the packager insists on the suffix)."""
    from torch._inductor.package import package_aoti

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    files = torch._inductor.aot_compile(
        with_tuple_output(tensor_inputs_only(gm, args)),
        tuple(tensors),
        # A metadata dict of its own: AOTInductor fills the one it is given in place, and
        # filling Inductor's default would change its settings, so the cache key, of every
        # later Inductor compile in this process.
        options={"aot_inductor.package": True, "aot_inductor.metadata": {}},
    )
    assert isinstance(files, list), "with aot_inductor.package, the compile gives its files"
    package_aoti(str(path), files)


# What a child process runs to load a package (argv: the package, the device index, -1 for
# the CPU): CUDA made ready first, as in the server.
LOAD_CHECK = """
import sys, torch
if int(sys.argv[2]) >= 0:
    torch.zeros(1, device=f"cuda:{sys.argv[2]}")
torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], "model", True, 1, int(sys.argv[2]))
"""
_loader_checked: set[str] = set()  # the device types whose loader a child process survived


def _device_index(device: torch.device) -> int:
    return (device.index if device.index is not None else 0) if device.type == "cuda" else -1


def check_the_loader(package: Path, device: torch.device) -> None:
    """Load `package` in a child process, once per process and device type, before this one
    loads any: AOTInductor's loader can kill the process that calls it (a segfault, beyond any
    except clause: torch 2.11.0+cu130 under driver 580.159 on an H100 did, for every package,
    torch's own `load_package` too), and a crash there is the child's, raised here as a clear
    error. A warm start does not check again: its packages passed in a start of the same
    cache key (torch, the CUDA driver and the GPU are in it)."""
    if device.type in _loader_checked:
        return
    done = subprocess.run(
        [sys.executable, "-c", LOAD_CHECK, str(package), str(_device_index(device))],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        how = (
            f"killed by {signal.Signals(-done.returncode).name}"
            if done.returncode < 0
            else f"exit status {done.returncode}: {done.stderr.strip()[-300:]}"
        )
        raise CompilationError(
            f"aot_inductor: a process loading a package on {device.type} failed ({how}): "
            f"AOTInductor's loader does not run with torch {torch.__version__} on this "
            "machine; compile with --cuda-graph-tc-compiler inductor (or eager) instead"
        )
    _loader_checked.add(device.type)


def _load_aot_inductor(device: torch.device) -> Callable[[Path], PieceFn]:
    """A loader of a package into a piece: torch's C++ loader, single-threaded (its pool's
    event record and wait would break a CUDA graph capture); it takes the tensor inputs."""

    def load(path: Path) -> PieceFn:
        package = torch._C._aoti.AOTIModelPackageLoader(
            str(path), "model", True, 1, _device_index(device)
        )

        def run(*args: Any) -> list[torch.Tensor]:
            return package.run([a for a in args if isinstance(a, torch.Tensor)])

        return run

    return load


def load_piece(
    compiler: str, gm: fx.GraphModule, cache: CompileCache, name: str, device: torch.device
) -> CompiledPiece | None:
    """The general callable of piece `gm` without compiling: the FX piece (`eager`) or its
    artifact `name` in `cache` (`inductor`, `aot_inductor`, for `device`); None when the
    cache has no usable artifact."""
    start = time.perf_counter()
    if compiler == "eager":
        return CompiledPiece(gm, "eager", 0.0)
    if compiler == "aot_eager":  # nothing saved: a debugging compiler always traces anew
        return None
    if compiler not in INDUCTOR_COMPILERS:
        known = COMPILERS + DEBUG_COMPILERS
        raise ValueError(f"unknown piece compiler {compiler!r}; choose one of {known}")
    load = _load_inductor if compiler == "inductor" else _load_aot_inductor(device)
    artifact = cache.load_artifact(name, load)
    if artifact is None:
        return None
    fn = _with_piece_convention(artifact, _returns_tuple(gm))
    return CompiledPiece(fn, "loaded", time.perf_counter() - start)


def compile_piece(
    compiler: str,
    gm: fx.GraphModule,
    args: Sequence[Any],
    cache: CompileCache,
    name: str,
    device: torch.device,
) -> CompiledPiece:
    """The general callable of piece `gm` (`args`: its fake example inputs), loaded when the
    cache has it, else compiled and saved; `name` keys its artifact in `cache`."""
    start = time.perf_counter()
    piece = load_piece(compiler, gm, cache, name, device)
    if piece is not None:
        return piece
    if compiler == "aot_eager":
        fn = _with_piece_convention(aot_eager(gm, args), _returns_tuple(gm))
        return CompiledPiece(fn, "compiled", time.perf_counter() - start)
    if compiler == "aot_inductor":
        # Loaded from where it was built, so that a root that saves nothing serves it too.
        if device.type == "cpu":
            require_cpp_compiler()
        with tempfile.TemporaryDirectory() as tmp:
            built = Path(tmp) / "piece.pt2"
            _aot_inductor_package(gm, args, built)
            check_the_loader(built, device)
            package = _load_aot_inductor(device)(built)
            cache.save_artifact(name, lambda path: shutil.copyfile(built, path))
        fn = _with_piece_convention(package, _returns_tuple(gm))
        return CompiledPiece(fn, "compiled", time.perf_counter() - start)
    artifact = torch._inductor.standalone_compile(gm, list(args), dynamic_shapes="from_graph")
    cache.save_artifact(name, lambda path: artifact.save(path=str(path), format="binary"))
    fn = _with_piece_convention(artifact, _returns_tuple(gm))
    return CompiledPiece(fn, "compiled", time.perf_counter() - start)
