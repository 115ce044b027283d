"""Which implementation each layer op runs: the `--custom-ops` grammar and its resolution.

Torch-free, so that the launcher checks the flag before it imports anything heavy; the layer
ops themselves are in `srt/layers/custom_op.py`, whose docstring gives the rules.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from srt.ipc.reports import OpImplInfo

OPS = ("fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul", "skinny_matmul")
# How the skinny matmul kernel launches (`--skinny-matmul-launch`), as `skinny_matmul_into`'s
# `pdl`: plainly, or as a programmatic dependent of the kernel before it (Hopper's
# griddepcontrol).
SKINNY_LAUNCHES = {"plain": 0, "pdl": 1}
PDL_MIN_CAPABILITY = (9, 0)
HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class OpImpl:
    """What one op runs: outside graphs Inductor compiles, and inside them; `why` says which
    entry of the selection (or which missing piece) decided it."""

    kernel: bool
    kernel_in_inductor: bool
    why: str

    def info(self) -> OpImplInfo:
        name = {True: "kernel", False: "reference"}
        return OpImplInfo(name[self.kernel], name[self.kernel_in_inductor], self.why)


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


def turned_off(entries: Sequence[str] | None) -> dict[str, str]:
    """The ops the flag makes run the reference everywhere, each with its entry (`none`,
    `-name`)."""
    return {
        name: entry
        for name, entry in parse_custom_ops(entries).items()
        if entry is not None and not _forces_kernel(entry)
    }


def asks_for_kernels(entries: Sequence[str] | None) -> bool:
    """Whether the flag forces a kernel on for some op (`all` or a `+name`)."""
    return any(_forces_kernel(entry) for entry in parse_custom_ops(entries).values())
