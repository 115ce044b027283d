"""The `compile` section of the server info, without importing the compile machinery.

`piecewise_model` imports Dynamo's and sympy's machinery (a quarter of a second and more): a
runner whose phases compile nothing reports zeros from here without paying for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.compilation.op_registry import split_ops

if TYPE_CHECKING:
    from srt.compilation.piecewise_model import PiecewiseModel


def compile_info(model: PiecewiseModel | None) -> dict[str, Any]:
    """The `compile` section of the server info (zeros when no phase compiles)."""
    if model is not None:
        return model.info()
    return {
        "split_ops": split_ops(),
        "num_pieces": 0,
        "num_split_regions": 0,
        "graph_source": None,
        "dynamo_s": 0.0,
        "graph_load_s": 0.0,
        "compile_s": 0.0,
        "total_s": 0.0,
        "cache_dir": None,
        "cache_hit": None,
    }
