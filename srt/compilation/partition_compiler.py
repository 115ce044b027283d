"""The partition mode (`--inductor-graph-partition`): one Inductor compile of the whole traced
graph, the split ops as partition boundaries, instead of one compile per FX piece.

Inductor sees every node, so it fuses across what would have been a piece boundary, and a
graph pass (`graph_passes`) may change a tensor's shape between two split ops. The
CUDA-graph partitions are cut at code generation, after every pass has run: with
`graph_partition` on and the split ops in `custom_should_partition_ops`, Inductor's output
code calls each split op from its top-level `call` and everything between two of them as
`partition_<i>(args)`. A partition wrapper (Inductor's `set_customized_partition_wrappers`,
applied whenever a compiled graph is made ready to run: after the compile and after a load)
receives each partition; ours keeps it as the partition's general callable and puts a
`Router` slot in its place, so the capture kinds serve partitions exactly as they serve FX
pieces: the dispatcher warms, captures (tc_piecewise's CUDA graph per partition and bucket,
on its second hit) and replays them, and a `full` capture records the whole forward.

Inductor partitions only the nodes a CUDA graph can hold: on the CPU every kernel is a CPU op,
so the compiled graph has no partition and runs as one function (the split ops inline), which
is what a CPU forward needs anyway.

The compiled graph is a `CompiledArtifact` saved in the compile cache like a piece (bound to
the entry, sha256-checked, a damaged one removed and recompiled); a warm start loads it, under
the same wrapper, and compiles nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from srt.compilation.cache import CompileCache
from srt.compilation.dispatch import PieceFn
from srt.compilation.op_registry import split_ops


@dataclass
class CompiledWhole:
    fn: Callable[..., Any]  # the whole graph: Dynamo's graph inputs -> its outputs
    partitions: list[PieceFn]  # each partition's general callable, called like a piece
    source: str  # "compiled" or "loaded" (from the cache)
    seconds: float


def _piece_convention(partition: Callable[[list[Any]], Any]) -> PieceFn:
    """A partition as a piece is called: positional arguments (Inductor's take one list,
    which they empty)."""

    def run(*args: Any) -> Any:
        return partition(list(args))

    return run


@contextmanager
def routed_partitions(slots: Callable[[int], PieceFn]) -> Iterator[list[PieceFn]]:
    """Inside: every graph Inductor compiles or loads is partitioned at the split ops, partition
    i replaced by `slots(i)` (called like a piece); the list fills with the partitions' own
    callables, in order, as a graph is made ready."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import set_customized_partition_wrappers

    partitions: list[PieceFn] = []

    def wrap(partition: Callable[[list[Any]], Any], meta: Any) -> Callable[[list[Any]], Any]:
        assert meta.partition_index == len(partitions), "Inductor wraps partitions in order"
        partitions.append(_piece_convention(partition))
        slot = slots(meta.partition_index)
        return lambda args: slot(*args)

    set_customized_partition_wrappers(wrap)
    try:
        with inductor_config.patch(graph_partition=True, custom_should_partition_ops=split_ops()):
            yield partitions
    finally:
        set_customized_partition_wrappers(None)  # type: ignore[arg-type]


def _load(path: Any) -> Any:
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")


def load_whole(
    cache: CompileCache, name: str, slots: Callable[[int], PieceFn]
) -> CompiledWhole | None:
    """The whole graph's artifact `name` from `cache`, its partitions routed to `slots`; None
    when the cache has no usable one."""
    start = time.perf_counter()
    with routed_partitions(slots) as partitions:
        artifact = cache.load_artifact(name, _load)
    if artifact is None:
        return None
    return CompiledWhole(artifact, partitions, "loaded", time.perf_counter() - start)


def compile_whole(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    cache: CompileCache,
    name: str,
    slots: Callable[[int], PieceFn],
) -> CompiledWhole:
    """The whole traced graph `gm` compiled by Inductor with partitions at the split ops
    (loaded instead when the cache has artifact `name`), saved as `name`."""
    loaded = load_whole(cache, name, slots)
    if loaded is not None:
        return loaded
    start = time.perf_counter()
    with routed_partitions(slots) as partitions:
        artifact = torch._inductor.standalone_compile(
            gm, list(example_inputs), dynamic_shapes="from_graph"
        )
    cache.save_artifact(name, lambda path: artifact.save(path=str(path), format="binary"))
    return CompiledWhole(artifact, partitions, "compiled", time.perf_counter() - start)
