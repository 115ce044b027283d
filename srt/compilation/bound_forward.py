"""The traced forward as a plain function: the saved split graph called with the inputs Dynamo's
code for the forward would pass it, so that a warm start whose pieces load without the
compiler (`eager`, `aot_inductor`) imports neither Dynamo nor Inductor.

Dynamo's code for a fullgraph forward reads each graph input off the forward's arguments and
calls the graph; with every guard dropped (`PiecewiseModel`) that is all it does. It names
each graph input after where it read it (`L['self']._modules['layers']._modules['0']...
._parameters['weight']` becomes the placeholder `L_self_modules_layers_modules_0_..._parameters_
weight_`), so the binding is found by naming every parameter and buffer of the model, and
every argument of the forward, the same way, and checked against the trace: each input found
once (a name two different tensors would share is not bound), a weight with its example's
dtype and shape, an integer either a dimension of an argument or read by no node. An input it
cannot bind (a global, an attribute that is neither a parameter nor a buffer, a name Dynamo
made unique with a suffix) leaves Dynamo's capture in use, logged: nothing is guessed.

The weights are read off the model once per model, not on every call as Dynamo's code does:
srt never replaces a parameter after the trace (weights load before it).
"""

from __future__ import annotations

import functools
import inspect
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from srt.compilation.op_registry import as_the_model_calls_it

if TYPE_CHECKING:
    from srt.compilation.backend import GraphInput
    from srt.compilation.split import SplitGraph

_FORMAT = 1  # the saved layout's version: another one is not loaded


def dynamo_input_name(source: str) -> str:
    """The placeholder name Dynamo gives a graph input read from `source`."""
    return re.sub(r"[^a-zA-Z0-9]+", "_", source)


@dataclass(frozen=True)
class Slot:
    """Where one graph input comes from on a call."""

    kind: str  # "weight" (`name`), "arg" (`index`), "size" (`index`, `dim`), "constant"
    name: str = ""  # a weight's name in the model (`layers.0.mlp.down_proj.weight`)
    index: int = 0  # which argument of the forward, after the model
    dim: int = 0
    value: int = 0  # a constant: an integer no node of the graph reads


class UnboundInput(ValueError):
    """A graph input that the binding cannot find (Dynamo's capture stays in use)."""


def _weight_names(model: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Dynamo's placeholder name of every parameter and buffer -> (name in the model, tensor);
    a tensor reachable under two module paths (a tied weight) has both names."""
    names: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        parts = path.split(".") if path else []
        source = "L['self']" + "".join(f"._modules['{p}']" for p in parts)
        for store in ("_parameters", "_buffers"):
            for leaf, tensor in getattr(module, store).items():
                if tensor is not None:
                    name = dynamo_input_name(f"{source}.{store}['{leaf}']")
                    names.setdefault(name, []).append((".".join([*parts, leaf]), tensor))
    return names


def _size_dims(args: Sequence[GraphInput], arg_slots: dict[str, int]) -> dict[str, Slot]:
    """Each size symbol of an argument's dimension -> the slot that reads it on a call."""
    dims: dict[str, Slot] = {}
    for graph_input in args:
        if graph_input.name not in arg_slots or not isinstance(graph_input.example, torch.Tensor):
            continue
        shape: tuple[Any, ...] = tuple(graph_input.example.shape)  # SymInts where symbolic
        for d, size in enumerate(shape):
            if isinstance(size, torch.SymInt):
                slot = Slot("size", index=arg_slots[graph_input.name], dim=d)
                dims.setdefault(str(size.node.expr), slot)
    return dims


def bind_inputs(model: nn.Module, inputs: Sequence[GraphInput]) -> list[Slot]:
    """The slot of each graph input of the traced `type(model).forward`; raises `UnboundInput`
    naming the first input it cannot bind."""
    params = list(inspect.signature(type(model).forward).parameters)
    if not params or params[0] != "self":
        raise UnboundInput(f"the forward's first parameter is {params[:1]}, not self")
    arg_slots = {dynamo_input_name(f"L['{p}']"): i for i, p in enumerate(params[1:])}
    weights = _weight_names(model)
    sizes = _size_dims(inputs, arg_slots)
    slots = []
    for graph_input in inputs:
        name, example = graph_input.name, graph_input.example
        if name in arg_slots:
            if not isinstance(example, torch.Tensor):
                raise UnboundInput(f"argument {name} is not a tensor")
            slots.append(Slot("arg", index=arg_slots[name]))
        elif name in weights:
            found = {id(t): (n, t) for n, t in weights[name]}
            if len(found) != 1:
                raise UnboundInput(f"{name} names {len(found)} tensors of the model")
            weight_name, tensor = next(iter(found.values()))
            if not isinstance(example, torch.Tensor) or (
                (tensor.dtype, tuple(tensor.shape)) != (example.dtype, tuple(example.shape))
            ):
                raise UnboundInput(f"{name}: the model's {weight_name} is not what was traced")
            slots.append(Slot("weight", name=weight_name))
        elif isinstance(example, torch.SymInt):
            expr = str(example.node.expr)
            if expr in sizes:
                slots.append(sizes[expr])
            elif not graph_input.read:
                slots.append(Slot("constant", value=int(example.node.hint)))
            else:
                raise UnboundInput(f"integer input {name} ({expr}) is no argument's dimension")
        else:
            raise UnboundInput(f"input {name} is neither an argument nor a weight of the model")
    return slots


def _call_ops_as_the_model_does(module: fx.GraphModule) -> None:
    """Each srt op in the split graph and its submodules called as the model calls it outside
    a compile (`RegisteredOp`), not through the op's dispatch: torch wraps a custom op's
    implementation in `torch._disable_dynamo`, whose first call imports Dynamo."""
    for graph_module in module.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        changed = False
        for node in graph_module.graph.nodes:
            op = as_the_model_calls_it(node.target) if node.op == "call_function" else None
            if op is not None:
                node.target, changed = op, True
        if changed:
            graph_module.recompile()


class BoundForward:
    """The split graph (its pieces routed by `PiecewiseBackend`) called like the traced
    forward: `forward(model, *args)` returns the graph's one output."""

    def __init__(
        self, split: SplitGraph, signatures: list[str], slots: list[Slot], saved_split: bytes
    ) -> None:
        _call_ops_as_the_model_does(split.module)
        self.split = split
        self.signatures = signatures
        self.slots = slots
        self.saved_split = saved_split  # pickled before routing (`CompiledForward.saved`)
        self._model: nn.Module | None = None
        self._values: list[Any] = []
        self._args = [(i, s.index) for i, s in enumerate(slots) if s.kind == "arg"]
        self._sizes = [(i, s.index, s.dim) for i, s in enumerate(slots) if s.kind == "size"]

    def bind(self, model: nn.Module) -> None:
        """Read the model's weights for the graph now (a later call with the same model object
        reuses them). Bound where it is traced or loaded: the compile-ahead block's forwards
        run with the decoder layers cut to the first (`first_layer_only`), where the later
        layers' names do not resolve."""

        def weight(name: str) -> Any:
            return functools.reduce(getattr, name.split("."), model)

        self._values = [
            weight(s.name) if s.kind == "weight" else s.value if s.kind == "constant" else None
            for s in self.slots
        ]
        self._model = model

    def __call__(self, model: nn.Module, *args: torch.Tensor) -> Any:
        if model is not self._model:
            self.bind(model)
        values = list(self._values)
        for i, index in self._args:
            values[i] = args[index]
        for i, index, dim in self._sizes:
            values[i] = args[index].shape[dim]
        return self.split.module(*values)[0]

    def save(self, path: Path) -> None:
        path.write_bytes(pickle.dumps((_FORMAT, self.saved_split, self.slots)))

    @classmethod
    def load(cls, path: Path) -> BoundForward:
        version, saved_split, slots = pickle.loads(path.read_bytes())
        if version != _FORMAT:
            raise ValueError(f"a bound forward of format {version}, not {_FORMAT}")
        split, signatures = pickle.loads(saved_split)
        return cls(split, signatures, slots, saved_split)
