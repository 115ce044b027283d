"""Errors of the compilation layer: each names what in the model stops the trace-once contract."""

from __future__ import annotations


class CompilationError(RuntimeError):
    """The model cannot be compiled piecewise."""


class GraphBreakError(CompilationError):
    """Dynamo could not trace the forward as one graph (a graph break under fullgraph=True)."""


class ShapeSpecializationError(CompilationError):
    """The forward depends on the token count (a Python branch on a shape, a size baked in as
    a constant), so one general graph cannot serve every batch size."""


class CompileCacheError(CompilationError):
    """The compile cache root cannot be used as given; the message names `--compile-cache-dir`
    or the file."""


class CompilerMissingError(CompilationError):
    """Inductor needs a tool this machine lacks (a C++ compiler on the CPU)."""
