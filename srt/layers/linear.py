"""Linear layers that load Hugging Face weights: packed projections and tensor parallelism.

A packed layer (qkv, gate_up) holds several checkpoint tensors stacked on the output
dimension, so one matmul replaces several; its `weight_loader` puts each one's rows in place.
Under tensor parallelism (Megatron's layout) a column-parallel layer holds its rank's rows of
each (its heads, its part of the MLP), a row-parallel one its rank's columns, and sums its
partial outputs over the ranks. The loader reads only what the rank holds from the file.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import Shard, all_reduce, even_shard, tp_size


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


class Linear(nn.Module):
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
        return F.linear(x, self.weight, self.bias)


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
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
