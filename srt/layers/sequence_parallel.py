"""The sequence-parallel graph pass (`--compile-passes sequence_parallel`, partition mode only).

Under tensor parallelism every row-parallel linear (o_proj, down_proj) ends in an all-reduce,
and what follows it is the residual add and RMSNorm of `RMSNorm.forward(x, residual)`: every
rank adds and normalises all T rows, the same work n times. The pass rewrites each such site

    h = all_reduce(x); s = h + residual; y = rms_norm(s)

into the sequence-parallel form

    h' = reduce_scatter(x); s' = h' + residual'; y' = rms_norm(s'); y = all_gather(y')

where a primed tensor holds this rank's ceil(T/n) rows (`srt.distributed`'s row ops, which pad
T to a multiple of n). The next matmul reads the gathered `y`; the summed residual `s'` stays
sharded and is what the next site adds to: only the first site takes its rows of a full
residual (the embedding's output), and `s` is gathered only where something else reads it
whole. So the residual has ceil(T/n) rows from one site to the next, past the attention split
op in between: the pass needs the whole graph (`whole_graph=True`).

It matches the reference the traced RMSNorm leaves after Inductor's decompositions (fp32, or
bf16/fp16 with its casts to fp32 and back) by walking the graph; a site it does not recognise
keeps its all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map_only

from srt.compilation.graph_passes import register_graph_pass
from srt.distributed import tp_size

aten = torch.ops.aten
_CAST = torch.ops.prims.convert_element_type.default


@dataclass
class _Site:
    reduce: fx.Node  # srt::tp_all_reduce(x)
    summed: fx.Node  # reduce + residual
    norm: list[fx.Node]  # the RMSNorm's nodes after `summed`, its output last


def _is(node: Any, target: Any, *args: Any) -> bool:
    """`node` calls `target`, with `args` as its leading arguments."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not target:
        return False
    return tuple(node.args[: len(args)]) == args


def _sole_user(node: fx.Node, target: Any, *args: Any) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and _is(users[0], target, *args) else None


def _operand(binary: fx.Node, other: fx.Node) -> Any:
    """The argument of the binary op `binary` that is not `other` (None if neither is)."""
    a, b = binary.args[:2]
    return b if a is other else a if b is other else None


def _rms_norm_after(summed: fx.Node) -> list[fx.Node] | None:
    """The nodes of `rms_norm(summed)` as the reference decomposes, from the upcast (if any)
    to the weight's product; None unless every node is there and used only by the next."""
    x32, nodes = summed, []
    casts = [u for u in summed.users if _is(u, _CAST, summed, torch.float32)]
    if casts:
        x32 = casts[0]
        nodes.append(x32)
    squares = [u for u in x32.users if _is(u, aten.pow.Tensor_Scalar, x32, 2)]
    if len(squares) != 1:
        return None
    mean = _sole_user(squares[0], aten.mean.dim, squares[0])
    if mean is None or mean.args[1:] not in (([-1], True), ([x32.meta["val"].dim() - 1], True)):
        return None
    eps = _sole_user(mean, aten.add.Tensor, mean)
    if eps is None or not isinstance(eps.args[1], float):
        return None
    rsqrt = _sole_user(eps, aten.rsqrt.default, eps)
    if rsqrt is None:
        return None
    scaled = _sole_user(rsqrt, aten.mul.Tensor)
    if scaled is None or _operand(scaled, rsqrt) is not x32:
        return None
    if casts and set(x32.users) != {squares[0], scaled}:
        return None
    nodes += [squares[0], mean, eps, rsqrt, scaled]
    down = _sole_user(scaled, _CAST, scaled)
    if down is not None:
        nodes.append(down)
    weighted = _sole_user(nodes[-1], aten.mul.Tensor)
    if weighted is None:
        return None
    weight = _operand(weighted, nodes[-1])
    if not isinstance(weight, fx.Node) or weight.meta["val"].dim() != 1:
        return None
    return [*nodes, weighted]


def _site(node: fx.Node) -> _Site | None:
    """The sequence-parallel site at the all-reduce `node`, if it is one: its only user adds a
    residual of its shape, and that sum goes through the RMSNorm reference."""
    if not _is(node, torch.ops.srt.tp_all_reduce.default) or len(node.users) != 1:
        return None
    summed = next(iter(node.users))
    if not _is(summed, aten.add.Tensor) or summed.kwargs:
        return None
    residual = _operand(summed, node)
    if not isinstance(residual, fx.Node) or residual is node:
        return None
    if residual.meta["val"].shape != node.meta["val"].shape:
        return None
    norm = _rms_norm_after(summed)
    return _Site(node, summed, norm) if norm is not None else None


def _faked(node: fx.Node) -> fx.Node:
    """`node` with its `val` (the fake value Inductor lowers from) computed from its inputs'."""
    args, kwargs = tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
    mode = torch._guards.detect_fake_mode((args, kwargs))
    assert mode is not None, "a graph pass runs on a graph with fake values"
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
    return node


def _call(graph: fx.Graph, target: Callable[..., Any], *args: Any) -> fx.Node:
    return _faked(graph.call_function(target, args))


def _gathered(
    graph: fx.Graph, shard: fx.Node, total: fx.Node, world_size: int, inside: set[fx.Node]
) -> fx.Node:
    """The all-gather of `shard` (`total` rows), read now by every reader of `shard` except
    those `inside` the site."""
    with graph.inserting_after(shard):
        whole = _call(graph, torch.ops.srt.tp_all_gather_rows.default, shard, total, world_size)
    shard.replace_all_uses_with(whole, lambda user: user is not whole and user not in inside)
    return whole


def shard_residual_stream(graph: fx.Graph, world_size: int) -> int:
    """Rewrite every site of `graph` into its sequence-parallel form over `world_size` ranks
    (see the module docstring); the number of sites rewritten."""
    srt = torch.ops.srt
    sites = [site for node in graph.nodes if (site := _site(node)) is not None]
    # A tensor a site adds to -> this rank's rows of it: a full residual's `tp_row_shard`, or
    # for the gather of an earlier site's sum, the sum's shard itself.
    shards: dict[fx.Node, fx.Node] = {}
    for site in sites:
        summed, x = site.summed, site.reduce.args[0]
        residual = _operand(summed, site.reduce)
        with graph.inserting_before(site.reduce):
            total = _call(graph, aten.sym_size.int, x, 0)
            scattered = _call(graph, srt.tp_reduce_scatter_rows.default, x, world_size)
        if residual not in shards:
            with graph.inserting_before(summed):
                shards[residual] = _call(graph, srt.tp_row_shard.default, residual, world_size)
        summed.args = (scattered, shards[residual])
        graph.erase_node(site.reduce)
        for node in (summed, *site.norm):
            _faked(node)
        # The norm's output is read whole (by the next matmul), so is the sum outside the norm.
        for shard, inside in ((site.norm[-1], set()), (summed, set(site.norm))):
            shards[_gathered(graph, shard, total, world_size, inside)] = shard
    for node in list(shards):
        if _is(node, srt.tp_all_gather_rows.default) and not node.users:
            graph.erase_node(node)  # a sum that only the next site read
    return len(sites)


@register_graph_pass("sequence_parallel", whole_graph=True)
def sequence_parallel(graph: fx.Graph) -> int:
    """Each all-reduce into a residual add + RMSNorm made reduce-scatter, the add and norm on
    this rank's rows and an all-gather of the normed rows (the residual kept sharded)."""
    size = tp_size()
    return shard_residual_stream(graph, size) if size > 1 else 0
