"""Linear layers that load Hugging Face weights: packed projections and tensor parallelism.

A packed layer (qkv, gate_up) holds several checkpoint tensors stacked on the output
dimension, so one matmul replaces several; its `weight_loader` puts each one's rows in place.
Under tensor parallelism (Megatron's layout) a column-parallel layer holds its rank's rows of
each (its heads, its part of the MLP), a row-parallel one its rank's columns, and sums its
partial outputs over the ranks. The loader reads only what the rank holds from the file.

One op (see custom_op.py), `skinny_matmul`: the product by cuBLAS (the reference), or the ops
`srt::skinny_matmul` and `srt::skinny_matmul_silu_and_mul`, which run the skinny matmul
kernel where its tuning table (`skinny_matmul_table.py`) chose it for the weight's shape and
the batch's row count, and cuBLAS elsewhere. The choice is made inside the op, at run time:
one traced graph serves every row count.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from srt.compilation.op_registry import register_custom_op
from srt.distributed import Shard, all_reduce, even_shard, tp_size
from srt.layers.activation import SiluAndMul, silu_and_mul, silu_and_mul_kernel
from srt.layers.custom_op import CustomOp
from srt.layers.skinny_matmul_table import BUCKETS, SkinnyConfig, choose, table_fingerprint


class LinearShapeError(ValueError):
    pass


class CheckpointTensor(Protocol):
    """A checkpoint tensor not read yet: its full shape, and a copy of one region (all of it by
    default) into `dest`, a part of a parameter of the region's shape."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def copy_to(self, dest: torch.Tensor, index: tuple[slice, ...] = ()) -> None: ...


def check_shape(source: CheckpointTensor, expected: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise LinearShapeError(f"has shape {tuple(source.shape)}, expected {tuple(expected)}")


@functools.cache
def _device_name(device: torch.device) -> str:
    # CPU tensors reach the kernel only under Triton's interpreter (the tests' table).
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def skinny_table_fingerprint(device: torch.device) -> str | None:
    """The hash of the skinny matmul table `device` reads (None: it has none)."""
    return table_fingerprint(_device_name(device))


def skinny_config(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> SkinnyConfig | None:
    """The skinny kernel's tile for `x @ weight^T` (gated: with the SiLU-and-mul after), or
    None where cuBLAS runs it."""
    if x.dim() != 2 or x.shape[0] == 0 or x.dtype != weight.dtype or not weight.is_contiguous():
        return None
    dtype = str(x.dtype).removeprefix("torch.")
    return choose(_device_name(x.device), dtype, *weight.shape, x.shape[0], gated)


def _skinny_matmul_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: int = 0
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_custom_op("skinny_matmul", mutates_args=(), fake_impl=_skinny_matmul_fake)
def skinny_matmul_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: int = 0
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the skinny kernel where the table chose it, launched as
    `launch` says (op_selection.SKINNY_LAUNCHES)."""
    config = skinny_config(x, weight, gated=False)
    if config is None:
        return F.linear(x, weight, bias)
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    out = x.new_empty((x.shape[0], weight.shape[0]))
    skinny_matmul_into(out, x, weight, bias, config, pdl=launch)
    return out


def _skinny_matmul_silu_and_mul_fake(
    x: torch.Tensor, weight: torch.Tensor, silu_kernel: bool, launch: int = 0
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@register_custom_op(
    "skinny_matmul_silu_and_mul", mutates_args=(), fake_impl=_skinny_matmul_silu_and_mul_fake
)
def skinny_matmul_silu_and_mul_kernel(
    x: torch.Tensor, weight: torch.Tensor, silu_kernel: bool, launch: int = 0
) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight))` for the packed [gate; up] weight, in one launch of
    the skinny kernel where the table chose it; elsewhere cuBLAS, then the SiLU-and-mul kernel
    (`silu_kernel`) or its reference."""
    config = skinny_config(x, weight, gated=True)
    if config is None:
        gate_up = F.linear(x, weight)
        return silu_and_mul_kernel(gate_up) if silu_kernel else silu_and_mul(gate_up)
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    out = x.new_empty((x.shape[0], weight.shape[0] // 2))
    skinny_matmul_into(out, x, weight, None, config, gated=True, pdl=launch)
    return out


def linear(
    layer: CustomOp, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear`, or the skinny op where `layer` runs the `skinny_matmul` kernel."""
    if layer.uses_kernel("skinny_matmul"):
        return skinny_matmul_kernel(x, weight, bias, layer.skinny_launch)
    return F.linear(x, weight, bias)


def warm_skinny_matmuls(model: nn.Module) -> int:
    """Run once, on zeros, each skinny kernel launch the table chose for the products of
    `model`'s layers, at every row bucket, so that their compiles happen now (before ready)
    and not in the first step of a bucket; the number of distinct launches."""
    done: set[tuple[object, ...]] = set()
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, CustomOp) or not layer.uses_kernel("skinny_matmul"):
            continue
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        for gated in (False, True):
            for rows in BUCKETS:
                x = weight.new_zeros((rows, weight.shape[1]))
                config = skinny_config(x, weight, gated)
                key = (tuple(weight.shape), weight.dtype, weight.device, gated, rows, config)
                if config is None or key in done:
                    continue
                done.add(key)
                if gated:
                    skinny_matmul_silu_and_mul_kernel(x, weight, True, layer.skinny_launch)
                else:
                    skinny_matmul_kernel(x, weight, None, layer.skinny_launch)
    return len(done)


class Linear(CustomOp):
    """`y = x W^T (+ b)` whose output is the checkpoint's `output_sizes` stacked (one entry:
    a plain linear). Of each it holds the rows `out_shards` names (default: what
    `default_out_shard` gives, all of them here), of the input the columns `in_shard` names
    (default: all)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        out_shards: list[Shard] | None = None,
        in_shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.out_shards = out_shards or [self.default_out_shard(size) for size in output_sizes]
        self.in_shard = in_shard or Shard(0, input_size)
        rows = sum(s.size for s in self.out_shards)
        self.weight = nn.Parameter(torch.empty(rows, self.in_shard.size))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        for p in self.parameters():
            # The loader travels on the Parameter (vLLM's convention); model_loader reads it
            # back with getattr. Parameter declares no such attribute.
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @staticmethod
    def default_out_shard(size: int) -> Shard:
        return Shard(0, size)

    def weight_loader(self, param: nn.Parameter, source: CheckpointTensor, shard: int = 0) -> None:
        out = self.out_shards[shard]
        if param.dim() == 1:  # the bias: its rows only
            check_shape(source, (self.output_sizes[shard],))
            index: tuple[slice, ...] = (out.slice,)
        else:
            check_shape(source, (self.output_sizes[shard], self.input_size))
            index = (out.slice, self.in_shard.slice)
        start = sum(s.size for s in self.out_shards[:shard])
        source.copy_to(param.data.narrow(0, start, out.size), index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x, self.weight, self.bias)

    def silu_and_mul_of(self, x: torch.Tensor, act: SiluAndMul) -> torch.Tensor:
        """`act(self(x))` for a packed [gate; up] layer: the activation fused into the
        product where the skinny kernel runs it."""
        if self.bias is None and self.uses_kernel("skinny_matmul"):
            return skinny_matmul_silu_and_mul_kernel(
                x, self.weight, act.uses_kernel("silu_and_mul"), self.skinny_launch
            )
        return act(self(x))


class ColumnParallelLinear(Linear):
    """Each rank holds an equal part of every output (or the parts `out_shards` names)."""

    @staticmethod
    def default_out_shard(size: int) -> Shard:
        return even_shard(size)


class RowParallelLinear(Linear):
    """Each rank holds an equal part of the input columns; the partial outputs are summed
    over the ranks, then the bias added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, [output_size], bias, in_shard=even_shard(input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return linear(self, x, self.weight, self.bias)
        y = all_reduce(linear(self, x, self.weight, None))
        return y if self.bias is None else y + self.bias
