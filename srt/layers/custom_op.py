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
runs the reference. With the selection comes how the skinny matmul kernel launches
(`--skinny-matmul-launch`), which its products pass to the op.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from srt.compilation.op_registry import in_inductor_trace
from srt.ipc.reports import OpImplInfo
from srt.op_selection import OpImpl


class CustomOp(nn.Module):
    """A layer whose ops each have a kernel and a reference (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.op_impls: dict[str, OpImpl] = {}
        # The skinny matmul kernel's `pdl` (op_selection.SKINNY_LAUNCHES): a constant of the
        # traced graph, like the selection.
        self.skinny_launch = 0

    def uses_kernel(self, op: str) -> bool:
        impl = self.op_impls.get(op)
        if impl is None:
            return False
        return impl.kernel_in_inductor if in_inductor_trace() else impl.kernel


def apply_custom_ops(model: nn.Module, impls: dict[str, OpImpl], skinny_launch: int = 0) -> None:
    """Give every `CustomOp` layer of `model` the resolved selection and the skinny matmul
    kernel's launch."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.op_impls = dict(impls)
            module.skinny_launch = skinny_launch


def custom_ops_info(impls: dict[str, OpImpl]) -> dict[str, OpImplInfo]:
    return {name: impl.info() for name, impl in sorted(impls.items())}


def describe_custom_ops(impls: dict[str, OpImpl]) -> Iterable[str]:
    """One line per op for the startup log."""
    for name, impl in sorted(impls.items()):
        info = impl.info()
        yield f"{name}: {info.impl} ({info.in_inductor_graph} in Inductor graphs; {info.why})"
