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
from srt.layers.layernorm import rms_norm
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


def normed(x: torch.Tensor, rms_eps: float | None) -> torch.Tensor:
    """x's rows RMS-normalised without a weight (the norm's weight folded into the product
    that reads them), by the norm kernel; x itself where `rms_eps` is None."""
    if rms_eps is None:
        return x
    from srt.layers.triton_ops.rms_norm import rms_norm_into

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_into(out, x, None, rms_eps)
    return out


def kernel_input(x: torch.Tensor, rms_eps: float | None) -> tuple[torch.Tensor, float | None]:
    """(x, rms_eps) as the skinny kernel takes them: one row's norm in the product's launch;
    more rows normalised by the norm kernel first (r40: the statistic in the tensor-core
    path's loop cost the 1B products 0.10 ms a step at 8 and 16 rows, more than the norm's
    launch)."""
    if rms_eps is not None and x.shape[0] > 1:
        return normed(x, rms_eps), None
    return x, rms_eps


def kernel_launch(x: torch.Tensor, launch: int) -> int:
    """The launch (`--skinny-matmul-launch`, op_selection.SKINNY_LAUNCHES) the kernel gets
    for x: a dependent launch at one row, plain at more (r40: dependent launches took 0.03-0.11
    ms off a step at one row, and nothing or up to 0.04 ms more at 8 and 16)."""
    return launch if x.shape[0] == 1 else 0


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
) -> torch.Tensor:
    """What a product computes: `F.linear` of x (RMS-normalised without a weight first, with
    `rms_eps`), plus `residual`. The PyTorch reference of every path."""
    if rms_eps is not None:
        x = rms_norm(x, None, rms_eps)
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def _skinny_matmul_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    launch: int = 0,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_custom_op("skinny_matmul", mutates_args=(), fake_impl=_skinny_matmul_fake)
def skinny_matmul_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    launch: int = 0,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
) -> torch.Tensor:
    """`linear_reference(x, weight, bias, residual, rms_eps)`, by the skinny kernel where the
    table chose it (the residual add, and one row's norm, in the product's launch), launched as
    `launch` says (op_selection.SKINNY_LAUNCHES); elsewhere the norm kernel, then cuBLAS
    with the residual add in its epilogue (one launch each, as the unfused layers make)."""
    config = skinny_config(x, weight, gated=False)
    if config is None:
        x = normed(x, rms_eps)
        if residual is not None and bias is None and x.dim() == 2:
            return torch.addmm(residual, x, weight.t())
        return linear_reference(x, weight, bias, residual)
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    out = x.new_empty((x.shape[0], weight.shape[0]))
    x, rms_eps = kernel_input(x, rms_eps)
    pdl = kernel_launch(x, launch)
    skinny_matmul_into(out, x, weight, bias, config, pdl=pdl, residual=residual, rms_eps=rms_eps)
    return out


def _skinny_matmul_silu_and_mul_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    silu_kernel: bool,
    launch: int = 0,
    rms_eps: float | None = None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@register_custom_op(
    "skinny_matmul_silu_and_mul", mutates_args=(), fake_impl=_skinny_matmul_silu_and_mul_fake
)
def skinny_matmul_silu_and_mul_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    silu_kernel: bool,
    launch: int = 0,
    rms_eps: float | None = None,
) -> torch.Tensor:
    """`silu_and_mul(linear_reference(x, weight, None, rms_eps=rms_eps))` for the packed
    [gate; up] weight, in one launch of the skinny kernel where the table chose it; elsewhere
    the norm kernel (with `rms_eps`), cuBLAS, then the SiLU-and-mul kernel (`silu_kernel`)
    or its reference."""
    config = skinny_config(x, weight, gated=True)
    if config is None:
        gate_up = F.linear(normed(x, rms_eps), weight)
        return silu_and_mul_kernel(gate_up) if silu_kernel else silu_and_mul(gate_up)
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    out = x.new_empty((x.shape[0], weight.shape[0] // 2))
    x, rms_eps = kernel_input(x, rms_eps)
    pdl = kernel_launch(x, launch)
    skinny_matmul_into(out, x, weight, None, config, gated=True, pdl=pdl, rms_eps=rms_eps)
    return out


def linear(
    layer: CustomOp,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
) -> torch.Tensor:
    """`linear_reference`, or the skinny op where `layer` runs the `skinny_matmul` kernel."""
    if layer.uses_kernel("skinny_matmul"):
        return skinny_matmul_kernel(x, weight, bias, layer.skinny_launch, residual, rms_eps)
    return linear_reference(x, weight, bias, residual, rms_eps)


def warm_skinny_matmuls(model: nn.Module) -> int:
    """Run once, on zeros, each skinny kernel launch the table chose for the products of
    `model`'s layers, in the form the model calls each (with its bias, its folded norm, its
    residual add), at every row bucket, so that their compiles happen now (before ready)
    and not in the first step of a bucket; the number of distinct launches."""
    done: set[tuple[object, ...]] = set()
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, CustomOp) or not layer.uses_kernel("skinny_matmul"):
            continue
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        bias = getattr(layer, "bias", None)
        rms_eps = getattr(layer, "folded_norm_eps", None)
        adds_residual = getattr(layer, "adds_residual", False)
        for gated in (False, True):
            for rows in BUCKETS:
                x = weight.new_zeros((rows, weight.shape[1]))
                config = skinny_config(x, weight, gated)
                form = (bias is not None, rms_eps is not None, adds_residual)
                key = (tuple(weight.shape), weight.dtype, weight.device, gated, rows, config, form)
                if config is None or key in done:
                    continue
                done.add(key)
                if gated:
                    skinny_matmul_silu_and_mul_kernel(x, weight, True, layer.skinny_launch, rms_eps)
                else:
                    residual = weight.new_zeros((rows, weight.shape[0])) if adds_residual else None
                    skinny_matmul_kernel(x, weight, bias, layer.skinny_launch, residual, rms_eps)
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
        # Where the model puts its norms in its products (`LlamaForCausalLM`'s
        # `put_norms_in_products`): the eps of the RMSNorm whose weight is folded into this
        # product's (its input is normalised in the product), and whether the product adds
        # the residual stream to its output. The skinny kernel's warm-up compiles these forms.
        self.folded_norm_eps: float | None = None
        self.adds_residual = False
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

    def fused_args(
        self, residual: torch.Tensor | None, normalise: bool
    ) -> tuple[torch.Tensor | None, float | None]:
        """(residual, rms_eps) for a call in one of this layer's declared forms; an error
        for another (the warm-up would not have compiled it)."""
        if residual is not None and not self.adds_residual:
            raise ValueError("this product was not declared to add the residual stream")
        if normalise and self.folded_norm_eps is None:
            raise ValueError("this product has no norm folded into its weight")
        return residual, self.folded_norm_eps if normalise else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, normalise: bool = False
    ) -> torch.Tensor:
        """`x W^T (+ b)`; with `normalise`, of x RMS-normalised by the norm folded into the
        weight; with `residual`, plus it."""
        residual, rms_eps = self.fused_args(residual, normalise)
        return linear(self, x, self.weight, self.bias, residual, rms_eps)

    def silu_and_mul_of(
        self, x: torch.Tensor, act: SiluAndMul, normalise: bool = False
    ) -> torch.Tensor:
        """`act(self(x, normalise=normalise))` for a packed [gate; up] layer: the activation
        fused into the product where the skinny kernel runs it."""
        if self.bias is None and self.uses_kernel("skinny_matmul"):
            _, rms_eps = self.fused_args(None, normalise)
            return skinny_matmul_silu_and_mul_kernel(
                x, self.weight, act.uses_kernel("silu_and_mul"), self.skinny_launch, rms_eps
            )
        return act(self(x, normalise=normalise))


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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, normalise: bool = False
    ) -> torch.Tensor:
        residual, rms_eps = self.fused_args(residual, normalise)
        if tp_size() == 1:
            return linear(self, x, self.weight, self.bias, residual, rms_eps)
        # Each rank normalises its columns of x by its own statistic: wrong, so never asked.
        assert rms_eps is None, "a row-parallel product holds part of each row"
        y = all_reduce(linear(self, x, self.weight, None))
        y = y if self.bias is None else y + self.bias
        return y if residual is None else y + residual
