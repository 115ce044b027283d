"""Custom ops the compiler must not trace into, and the split set.

`register_custom_op` wraps `torch.library.custom_op` and registers the fake (meta)
implementation in the same call, so no op exists without one. `register_split_op`, applied
where an op is defined, adds the op to the set of ops the piecewise compiler splits the graph
at; `split_ops()` lists that set, since decentralised registration leaves no file to read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LIBRARY = "srt"
_split_ops: set[str] = set()


def register_custom_op(
    name: str, *, mutates_args: Iterable[str], fake_impl: Callable[..., Any]
) -> Callable[[Callable[..., Any]], torch.library.CustomOpDef]:
    """Define `srt::<name>` from the decorated function, with `fake_impl` as its fake."""

    def decorator(fn: Callable[..., Any]) -> torch.library.CustomOpDef:
        op = torch.library.custom_op(f"{LIBRARY}::{name}", mutates_args=tuple(mutates_args))(fn)
        op.register_fake(fake_impl)
        return op

    return decorator


def register_split_op(op: torch.library.CustomOpDef) -> torch.library.CustomOpDef:
    """Mark `op` as a split point of the piecewise graph."""
    _split_ops.add(op._qualname)
    return op


def split_ops() -> list[str]:
    """Qualified names (`srt::attention`) of every registered split op."""
    return sorted(_split_ops)
