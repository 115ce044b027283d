"""Layer ops with two implementations: a Triton kernel (CUDA) and the pure-PyTorch reference.

Which one runs is chosen per op by `--custom-ops`, a list with exactly one of `all` / `none`
and `+name` / `-name` overrides (`--custom-ops none +rms_norm`; entries may also be joined
by commas, `all,-rotary_embedding`, since argparse reads a lone `-name` as a flag):

- flag unset: every op is `default`: the kernel, except while Dynamo traces a graph that
  Inductor compiles, where the reference runs so that Inductor fuses it with its neighbours;
- `all` / `+name`: the kernel everywhere (an opaque custom op inside a traced graph);
- `none` / `-name`: the reference everywhere.

Without CUDA or without triton the reference always runs. The model runner resolves the
selection once (`resolve_custom_ops`) and hands it to every `CustomOp` layer
(`apply_custom_ops`); a layer decides at call time (`CustomOp.uses_kernel`), because one
model object serves phases whose compilers differ. A layer that was never given a selection
runs the reference.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from srt.compilation.custom_ops import in_inductor_trace

OPS = ("fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul")
HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class OpImpl:
    """What one op runs: outside graphs Inductor compiles, and inside them; `why` says which
    entry of the selection (or which missing piece) decided it."""

    kernel: bool
    kernel_in_inductor: bool
    why: str

    def info(self) -> dict[str, str]:
        name = {True: "kernel", False: "reference"}
        return {
            "impl": name[self.kernel],
            "in_inductor_graph": name[self.kernel_in_inductor],
            "why": self.why,
        }


def parse_custom_ops(entries: Sequence[str] | None) -> dict[str, str | None]:
    """Op name -> the entry that forces it (`all`, `-rms_norm`, ...), None where the flag
    leaves it at its default. ValueError (the message without the flag's name) for a list
    without exactly one of all/none, an unknown entry or op, or `+x` with `-x`."""
    if entries is None:
        return dict.fromkeys(OPS)
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise ValueError(
            f"expected a list of entries such as ['none', '+rms_norm'], got {entries!r}"
        )
    items = [part.strip() for entry in entries for part in entry.split(",") if part.strip()]
    bases = [item for item in items if item in ("all", "none")]
    if len(bases) != 1:
        raise ValueError(
            f"needs exactly one of 'all' or 'none' (then +NAME / -NAME overrides), got {items}"
        )
    chosen: dict[str, str | None] = dict.fromkeys(OPS, bases[0])
    seen: dict[str, str] = {}
    for item in items:
        if item in bases:
            continue
        sign, name = item[:1], item[1:]
        if sign not in ("+", "-"):
            raise ValueError(f"invalid entry {item!r}: expected all, none, +NAME or -NAME")
        if name not in OPS:
            raise ValueError(f"unknown op {name!r} in {item!r}; the ops are {', '.join(OPS)}")
        if seen.get(name, sign) != sign:
            raise ValueError(f"+{name} and -{name} contradict each other")
        seen[name] = sign
        chosen[name] = item
    return chosen


def _forces_kernel(entry: str | None) -> bool:
    return entry is not None and (entry == "all" or entry.startswith("+"))


def resolve_custom_ops(entries: Sequence[str] | None, missing: str | None) -> dict[str, OpImpl]:
    """The implementation of every op for `--custom-ops entries`; `missing` is why no kernel
    can run here (`kernels_missing`), or None when they can."""
    impls = {}
    for name, entry in parse_custom_ops(entries).items():
        if missing is not None:
            impls[name] = OpImpl(False, False, missing)
        elif entry is None:
            impls[name] = OpImpl(True, False, "default: the reference only where Inductor compiles")
        else:
            kernel = _forces_kernel(entry)
            impls[name] = OpImpl(kernel, kernel, f"--custom-ops {entry}")
    return impls


def kernels_missing(device_type: str) -> str | None:
    """Why the kernels cannot run on this device, or None."""
    if device_type != "cuda":
        return f"no kernels on {device_type}"
    if not HAS_TRITON:
        return "triton is not installed"
    return None


def asks_for_kernels(entries: Sequence[str] | None) -> bool:
    """Whether the flag forces a kernel on for some op (`all` or a `+name`)."""
    return any(_forces_kernel(entry) for entry in parse_custom_ops(entries).values())


class CustomOp(nn.Module):
    """A layer whose ops each have a kernel and a reference (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.op_impls: dict[str, OpImpl] = {}

    def uses_kernel(self, op: str) -> bool:
        impl = self.op_impls.get(op)
        if impl is None:
            return False
        return impl.kernel_in_inductor if in_inductor_trace() else impl.kernel


def apply_custom_ops(model: nn.Module, impls: dict[str, OpImpl]) -> None:
    """Give every `CustomOp` layer of `model` the resolved selection."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.op_impls = dict(impls)


def custom_ops_info(impls: dict[str, OpImpl]) -> dict[str, Any]:
    return {name: impl.info() for name, impl in sorted(impls.items())}


def describe_custom_ops(impls: dict[str, OpImpl]) -> Iterable[str]:
    """One line per op for the startup log."""
    for name, impl in sorted(impls.items()):
        info = impl.info()
        yield f"{name}: {info['impl']} ({info['in_inductor_graph']} in Inductor graphs; {impl.why})"
