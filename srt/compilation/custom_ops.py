"""Custom ops the compiler must not trace into, and the split set.

`register_custom_op` wraps `torch.library.custom_op` and registers the fake (meta)
implementation in the same call, so no op exists without one; `custom_ops()` lists every op
made this way (the tests opcheck each). `register_split_op`, applied where an op is defined,
adds the op to the set of ops the piecewise compiler splits the graph at; `split_ops()` lists
that set, since decentralised registration leaves no file to read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LIBRARY = "srt"
_custom_ops: dict[str, torch.library.CustomOpDef] = {}
_split_ops: set[str] = set()


def register_custom_op(
    name: str,
    *,
    mutates_args: Iterable[str],
    fake_impl: Callable[..., Any],
    namespace: str = LIBRARY,
) -> Callable[[Callable[..., Any]], torch.library.CustomOpDef]:
    """Define `<namespace>::<name>` (default `srt::<name>`) from the decorated function, with
    `fake_impl` as its fake."""

    def decorator(fn: Callable[..., Any]) -> torch.library.CustomOpDef:
        qualname = f"{namespace}::{name}"
        op = torch.library.custom_op(qualname, mutates_args=tuple(mutates_args))(fn)
        op.register_fake(fake_impl)
        _custom_ops[qualname] = op
        return op

    return decorator


def register_split_op(op: torch.library.CustomOpDef) -> torch.library.CustomOpDef:
    """Mark `op` as a split point of the piecewise graph."""
    _split_ops.add(op._qualname)
    return op


def custom_ops() -> dict[str, torch.library.CustomOpDef]:
    """Every op made with `register_custom_op`, by qualified name."""
    return dict(_custom_ops)


def split_ops() -> list[str]:
    """Qualified names (`srt::attention`) of every registered split op."""
    return sorted(_split_ops)


def op_qualname(target: object) -> str | None:
    """`srt::attention` for an FX node target `torch.ops.srt.attention.default` (or the
    packet `torch.ops.srt.attention`); None for anything that is not a torch op."""
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else getattr(target, "_qualified_op_name", None)


def is_split_op(target: object) -> bool:
    return op_qualname(target) in _split_ops
