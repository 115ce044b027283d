"""Linear layers that load Hugging Face weights, including packed projections.

A packed layer (qkv, gate_up) holds several checkpoint tensors stacked on the output
dimension, so one matmul replaces several; its `weight_loader` puts each shard in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearShapeError(ValueError):
    pass


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise LinearShapeError(f"has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class Linear(nn.Module):
    """`y = x W^T (+ b)` whose output is `output_sizes` stacked (one entry: a plain linear)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size))
        self.bias = nn.Parameter(torch.empty(sum(output_sizes))) if bias else None
        for p in self.parameters():
            # The loader travels on the Parameter (vLLM's convention); model_loader reads it
            # back with getattr. Parameter declares no such attribute.
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        start = sum(self.output_sizes[:shard])
        _copy_checked(param.data.narrow(0, start, self.output_sizes[shard]), loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
