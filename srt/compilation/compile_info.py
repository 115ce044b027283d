"""The `compile` section of the server info, as a typed record, without importing the compile
machinery (nor torch).

`piecewise_model` imports Dynamo's and sympy's machinery (a quarter of a second and more): a
runner whose phases compile nothing reports `CompileInfo.none(split_ops())` without paying for
it. The split ops come from the caller, since their registry imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompileInfo:
    """How the general graph was built: split, traced or loaded, compiled, and cached."""

    split_ops: tuple[str, ...]
    # "piecewise": the FX graph split at the split ops, each piece compiled; "partition": the
    # whole graph compiled by Inductor, cut at them (num_pieces counts its partitions).
    mode: str | None
    passes: tuple[str, ...]  # the graph passes the compiles ran with (`--compile-passes`)
    # What each matched over this start's compiles; None when nothing was compiled here (the
    # artifacts, loaded, were rewritten by them when compiled).
    pass_matches: Mapping[str, int] | None
    num_pieces: int
    num_split_regions: int
    num_unique_pieces: int
    compilers: tuple[str, ...]
    graph_source: str | None  # "traced", or "loaded" from the cache; None: nothing compiled
    # True: the split graph runs without Dynamo (`bound_forward`); False: Dynamo's code runs it
    bound: bool | None
    dynamo_s: float  # the Dynamo trace (0 when loaded)
    graph_load_s: float  # loading the saved trace
    compile_s: float  # the split, and compiling or loading the pieces
    total_s: float
    cache_dir: str | None
    cache_hit: bool | None  # True: every Inductor piece loaded; None: nothing to cache
    traces: int  # 1 when traced, 0 when loaded
    # Per piece: `piece`, `submodule`, `signature`, and under each compiler's name its
    # `source` (compiled, loaded, shared, eager) and seconds `s` (`shares`: the piece shared).
    # In the partition mode one entry, the whole graph, with its `partitions`.
    pieces: tuple[Mapping[str, Any], ...]

    @classmethod
    def none(cls, split_ops: Iterable[str]) -> CompileInfo:
        """The section of a runner that compiles nothing: the split ops, zeros and empties."""
        return cls(
            split_ops=tuple(split_ops),
            mode=None,
            passes=(),
            pass_matches=None,
            num_pieces=0,
            num_split_regions=0,
            num_unique_pieces=0,
            compilers=(),
            graph_source=None,
            bound=None,
            dynamo_s=0.0,
            graph_load_s=0.0,
            compile_s=0.0,
            total_s=0.0,
            cache_dir=None,
            cache_hit=None,
            traces=0,
            pieces=(),
        )
