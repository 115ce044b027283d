"""Split the traced graph at the split ops, and tell structurally identical pieces apart.

One linear scan gives every node a partition id and bumps it each time the scan crosses
between ordinary nodes and split-op nodes, so consecutive split ops (and `getitem`s of their
results) share one opaque region. A Llama with L layers gives L regions (its attentions) and
L + 1 compilable pieces: embedding + layer 0 up to attention, L - 1 middle pieces (o_proj,
MLP, next layer's norm and qkv), and the last layer's tail with the final norm.

`piece_signature` describes a piece by its code with every name replaced by its position, and
its inputs by dtype/shape/stride. Weights are graph inputs (Dynamo lifts parameters), so the
middle pieces of a model have one signature and share one compiled artifact.
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from srt.compilation.op_registry import is_split_op, op_qualname


@dataclass
class SplitGraph:
    module: fx.GraphModule  # calls its submodules in order
    submodules: list[str]  # every submodule, in execution order
    pieces: list[str]  # the compilable ones; piece i is pieces[i]
    regions: list[str]  # the opaque split-op regions
    region_ops: dict[str, list[str]] = field(default_factory=dict)  # region -> its split ops

    def submodule(self, name: str) -> fx.GraphModule:
        """A piece or region by name (split_module makes each a GraphModule)."""
        sub = self.module.get_submodule(name)
        assert isinstance(sub, fx.GraphModule), f"{name} is a {type(sub).__name__}"
        return sub


def split_graph(gm: fx.GraphModule) -> SplitGraph:
    partition: dict[fx.Node, int] = {}
    region_parts: set[int] = set()
    part, in_region = 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        is_region = node.op == "call_function" and (
            is_split_op(node.target)
            or (
                node.target is operator.getitem
                and isinstance(node.args[0], fx.Node)
                and partition.get(node.args[0]) in region_parts
            )
        )
        if in_region is not None and is_region != in_region:
            part += 1
        in_region = is_region
        partition[node] = part
        if is_region:
            region_parts.add(part)
    # split_module's root module argument is unused (its docstring says so).
    split = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    submodules = [node.target for node in split.graph.nodes if node.op == "call_module"]
    result = SplitGraph(split, submodules, [], [])
    for name in submodules:
        if int(name.removeprefix("submod_")) in region_parts:
            result.regions.append(name)
            result.region_ops[name] = [
                qualname
                for n in result.submodule(name).graph.nodes
                if n.op == "call_function"
                and is_split_op(n.target)
                and (qualname := op_qualname(n.target)) is not None
            ]
        else:
            result.pieces.append(name)
    return result


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(target)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (
            f"Tensor({value.dtype}, {tuple(value.shape)}, {value.stride()}, "
            f"{value.device.type}, grad={value.requires_grad})"
        )
    if isinstance(value, torch.SymInt):
        return f"SymInt({value})"
    return repr(value)


def _describe_constant(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        content = hashlib.sha256(value.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        return f"{_describe(value)}:{content.hexdigest()}"
    return repr(value)


def piece_signature(gm: fx.GraphModule, args: Sequence[Any]) -> str:
    """A hash equal for pieces that compute the same function of their inputs."""
    names: dict[fx.Node, str] = {}
    lines = []
    inputs = iter(args)
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"%{i}"
        if node.op == "placeholder":
            detail = _describe(next(inputs))
        elif node.op == "get_attr":
            detail = _describe_constant(getattr(gm, node.target))
        else:
            detail = repr(fx.node.map_arg((node.args, node.kwargs), lambda n: names[n]))
        target = "" if node.op in ("placeholder", "get_attr") else _target_name(node.target)
        lines.append(f"{node.op} {target} {detail}")
    text = "\n".join(lines)
    # Size symbols (s72, u3) are named per trace: number them by first use instead.
    symbols: dict[str, str] = {}
    text = re.sub(r"\b[su]\d+\b", lambda m: symbols.setdefault(m[0], f"sym{len(symbols)}"), text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def readable_graph(split: SplitGraph, title: str, signatures: Sequence[str]) -> str:
    """The split graph as Python: a header naming every submodule, then the code."""
    lines = [f'"""{title}: the traced forward split at the split ops.', ""]
    for name in split.submodules:
        if name in split.pieces:
            i = split.pieces.index(name)
            lines.append(f"{name}: piece {i} (compiled; signature {signatures[i]})")
        else:
            ops = ", ".join(split.region_ops[name])
            lines.append(f"{name}: split region {split.regions.index(name)} (eager: {ops})")
    lines += ['"""', "", split.module.print_readable(print_output=False)]
    return "\n".join(lines) + "\n"
