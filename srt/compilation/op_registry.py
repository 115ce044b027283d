"""Custom ops the compiler must not trace into, and the split set.

`register_custom_op` wraps `torch.library.custom_op` and registers the fake (meta)
implementation in the same call, so no op exists without one; `custom_ops()` lists every op
made this way (the tests check each with `opcheck`, torch's plus a stride check that torch
before 2.12 skips on the CPU). `register_split_op`, applied where an op is defined,
adds the op to the set of ops the piecewise compiler splits the graph at; `split_ops()` lists
that set, since decentralised registration leaves no file to read it. `inductor_trace()`
marks the calls of functions compiled for Inductor, so that layer ops with a kernel and a
reference trace the reference there by default (`srt/layers/custom_op.py`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._prims_common import check_significant_strides, compare_tensor_meta
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves, tree_map_only

LIBRARY = "srt"
_split_ops: set[str] = set()
_registered: dict[str, RegisteredOp] = {}


class RegisteredOp:
    """A custom op as the model calls it: inside a Dynamo trace or under a Python dispatch
    mode (fake tensors, a tracer, a recorder), the op, which they see as one opaque op (a split
    point where registered as one); otherwise the function itself, which is what the op would
    run. Under a torch function mode too: a mode that intercepts ops by their overload (the
    breakable capture ends a graph segment at each split op) must see the op. Why not the op
    everywhere: a custom op's dispatch imports Dynamo on its first call (torch wraps the
    implementation in `torch._disable_dynamo`), seconds of startup for a process that
    compiles nothing."""

    def __init__(self, op: torch.library.CustomOpDef, fn: Callable[..., Any]) -> None:
        self.op = op
        self.fn = fn
        self._qualname = op._qualname
        self.__doc__ = fn.__doc__
        # Named as the function is, so that FX can put it in a graph's code.
        self.__name__, self.__qualname__, self.__module__ = (
            fn.__name__,
            fn.__qualname__,
            fn.__module__,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            torch.compiler.is_compiling()
            or _get_current_dispatch_mode() is not None
            or torch._C._len_torch_function_stack() > 0
        ):
            return self.op(*args, **kwargs)
        return self.fn(*args, **kwargs)


def register_custom_op(
    name: str,
    *,
    mutates_args: Iterable[str],
    fake_impl: Callable[..., Any] | None = None,
    reference: Callable[..., Any] | None = None,
    namespace: str = LIBRARY,
) -> Callable[[Callable[..., Any]], RegisteredOp]:
    """Define `<namespace>::<name>` (default `srt::<name>`) from the decorated function, with
    `fake_impl` as its fake. An op that returns nothing (it only writes the arguments it
    mutates) has nothing to fake: its fake is made here, so its signature is written once.

    `reference` (a layer op's PyTorch reference, the op's signature): the op's CPU kernel.
    A graph that calls the op where the model traced the reference (a graph pass put it
    there) then runs on the CPU too, tests and CPU serving alike, and the reference stays the
    oracle the kernel is checked against; the decorated function (the Triton kernel) serves
    every other device."""

    def decorator(fn: Callable[..., Any]) -> RegisteredOp:
        qualname = f"{namespace}::{name}"
        fake = fake_impl
        if fake is None:
            if inspect.signature(fn).return_annotation not in (None, "None"):
                raise TypeError(f"{qualname} returns a value: give its fake_impl")
            fake = _returns_nothing
        op = torch.library.custom_op(qualname, mutates_args=tuple(mutates_args))(fn)
        op.register_fake(fake)
        if reference is not None:
            op.register_kernel("cpu", reference)
        _registered[qualname] = RegisteredOp(op, fn)
        return _registered[qualname]

    return decorator


def _returns_nothing(*args: Any, **kwargs: Any) -> None:
    """The fake of an op that only mutates its arguments."""
    return None


def register_split_op(op: RegisteredOp) -> RegisteredOp:
    """Mark `op` as a split point of the piecewise graph."""
    _split_ops.add(op._qualname)
    return op


def custom_ops() -> dict[str, torch.library.CustomOpDef]:
    """Every op made with `register_custom_op`, by qualified name."""
    return {qualname: registered.op for qualname, registered in _registered.items()}


def split_ops() -> list[str]:
    """Qualified names (`srt::attention`) of every registered split op."""
    return sorted(_split_ops)


def op_qualname(target: object) -> str | None:
    """`srt::attention` for an FX node target `torch.ops.srt.attention.default` (or the
    packet `torch.ops.srt.attention`); None for anything that is not a torch op."""
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else getattr(target, "_qualified_op_name", None)


def as_the_model_calls_it(target: object) -> RegisteredOp | None:
    """The `RegisteredOp` behind an FX node target `torch.ops.srt.<name>.default`, which a
    graph run outside a compile calls as the model would (no Dynamo import); None for any
    other target."""
    qualname = op_qualname(target)
    op = _registered.get(qualname) if qualname is not None else None
    return op if op is not None and target is op.op._opoverload else None


def is_split_op(target: object) -> bool:
    return op_qualname(target) in _split_ops


def check_fake_outputs(
    op: torch.library.CustomOpDef | RegisteredOp,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Raise if the fake implementation's outputs differ from the real ones in shape, dtype,
    device or (significant) strides. Compiled code is laid out by the fake's strides, so a
    wrong stride there means a kernel reading the real output wrongly."""
    if isinstance(op, RegisteredOp):
        op = op.op  # the op's dispatch, which picks the fake under FakeTensorMode
    kwargs = kwargs or {}
    real_args = tree_map_only(torch.Tensor, torch.clone, (args, kwargs))  # the op may mutate
    real = tree_leaves(op(*real_args[0], **real_args[1]))
    with FakeTensorMode() as mode:
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        fake = tree_leaves(op(*fake_args[0], **fake_args[1]))
    name = f"the fake implementation of {op._qualname}"
    if len(real) != len(fake):
        raise AssertionError(f"{name} returns {len(fake)} values, the op {len(real)}")
    for i, (r, f) in enumerate(zip(real, fake, strict=True)):
        if isinstance(r, torch.Tensor) != isinstance(f, torch.Tensor):
            raise AssertionError(f"{name}: output {i} is a tensor in one and not the other")
        if not isinstance(r, torch.Tensor):
            continue
        try:
            compare_tensor_meta(r, f, check_strides=False)
        except Exception as e:
            raise AssertionError(f"{name}: output {i}: {e}") from None
        # Our own call: torch's stride comparison skips CPU tensors by default (only_cuda).
        same, dim = check_significant_strides(r, f, only_cuda=False)
        if not same:
            raise AssertionError(
                f"{name}: output {i}: Stride mismatch! {r.stride()} (real) and {f.stride()} "
                f"(fake) differ at dimension {dim}"
            )


def opcheck(
    op: torch.library.CustomOpDef | RegisteredOp,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> None:
    """`torch.library.opcheck(op, args, kwargs)` after `check_fake_outputs`: the same check on
    every torch we support (torch 2.11's opcheck compares output strides for CUDA tensors
    only, so a CPU fake with the wrong layout passed it)."""
    if isinstance(op, RegisteredOp):
        op = op.op
    check_fake_outputs(op, args, kwargs)
    torch.library.opcheck(op, args, kwargs)


_inductor_trace = False


@contextmanager
def inductor_trace(active: bool = True) -> Iterator[None]:
    """Mark the calls inside as ones whose Dynamo trace Inductor compiles (layer ops with a
    kernel and a reference read it, through `in_inductor_trace`, to pick the reference by
    default there). Wrap every call of a function compiled for Inductor, not only the
    first: where Dynamo keeps its guards, it guards on this value."""
    global _inductor_trace
    before, _inductor_trace = _inductor_trace, active
    try:
        yield
    finally:
        _inductor_trace = before


def in_inductor_trace() -> bool:
    """True while Dynamo traces code inside `inductor_trace()`."""
    return _inductor_trace and torch.compiler.is_compiling()
