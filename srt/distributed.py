"""The tensor-parallel group of a model runner: its rank and size, the collectives the model
and the runner call, and the arithmetic of which shard of a tensor a rank holds.

One process per rank. Every rank joins a `torch.distributed` process group (NCCL on CUDA, gloo
on the CPU) for the model's collectives, and a gloo group for the host-side messages that rank 0
passes on (`broadcast_object`). With one rank there is no group and no collective is called.

The model's two collectives are registered ops (`srt::tp_all_reduce`, `srt::tp_all_gather`):
they return a new tensor and mutate nothing, so Dynamo keeps them opaque inside a compiled
piece, Inductor calls them as they are, and a CUDA graph captures the NCCL kernels. The
sequence-parallel pass's ops over the token rows (`srt::tp_reduce_scatter_rows`,
`srt::tp_row_shard`, `srt::tp_all_gather_rows`) are registered the same way; the model never
calls them, only the graphs that pass rewrote do.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from srt.compilation.op_registry import register_custom_op
from srt.tp_rank import TPRank

# Followers wait on the message group between steps, for as long as the server is idle: its
# collectives must not time out (a rank that dies closes its connections, which fails them).
_MESSAGE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Shard:
    """`size` entries from `start` of one dimension of a checkpoint tensor."""

    start: int
    size: int

    @property
    def slice(self) -> slice:
        return slice(self.start, self.start + self.size)


@dataclass
class _Group:
    rank: int
    size: int
    device_group: Any  # the model's collectives (a dist.ProcessGroup)
    message_group: Any  # gloo, for broadcast_object


_group: _Group | None = None


def init_tp(tp: TPRank, device: torch.device) -> None:
    """Join the group of `tp` (a no-op with one rank and no init method). On CUDA NVLink
    multicast (NVLS) stays off unless the user set NCCL_NVLS_ENABLE."""
    global _group
    if tp.init_method is None:
        assert tp.size == 1, "a group of several ranks needs an init method"
        return
    if device.type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=tp.init_method, rank=tp.rank, world_size=tp.size, **kwargs
    )
    messages = dist.new_group(backend="gloo", timeout=_MESSAGE_TIMEOUT)
    _group = _Group(tp.rank, tp.size, dist.group.WORLD, messages)


def destroy_tp() -> None:
    global _group
    if _group is not None:
        _group = None
        dist.destroy_process_group()


def tp_rank() -> int:
    return _group.rank if _group is not None else 0


def tp_size() -> int:
    return _group.size if _group is not None else 1


def even_shard(total: int) -> Shard:
    """This rank's equal part of `total` (divisible by the size: checked at startup)."""
    size = tp_size()
    assert total % size == 0, f"{total} does not split over {size} ranks"
    return Shard(tp_rank() * (total // size), total // size)


def padded_shard(total: int) -> Shard:
    """This rank's part of `total` rounded up to a multiple of the size (the vocabulary: the
    last rank's part may run past the end, its rows there are padding)."""
    size = -(-total // tp_size())
    return Shard(tp_rank() * size, size)


def kv_head_shard(num_kv_heads: int) -> Shard:
    """This rank's KV heads: an equal part, or with fewer heads than ranks one head shared by
    `size // num_kv_heads` consecutive ranks (a multiple: checked at startup)."""
    size = tp_size()
    if num_kv_heads >= size:
        return even_shard(num_kv_heads)
    return Shard(tp_rank() * num_kv_heads // size, 1)


def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@register_custom_op("tp_all_reduce", mutates_args=(), fake_impl=_all_reduce_fake)
def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    assert _group is not None, "srt::tp_all_reduce outside a tensor-parallel group"
    out = x.clone()
    dist.all_reduce(out, group=_group.device_group)
    return out


def _all_gather_fake(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * world_size)


@register_custom_op("tp_all_gather", mutates_args=(), fake_impl=_all_gather_fake)
def _tp_all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    # `world_size` is an argument so that the fake knows the output's shape.
    assert _group is not None and _group.size == world_size
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=_group.device_group)
    return torch.cat(parts, dim=-1)


# The sequence-parallel collectives (`srt.layers.sequence_parallel` puts them in the graph): a
# [T, ...] tensor split over the ranks by rows, rank r holding rows r*c .. (r+1)*c - 1 of it
# padded with zero rows to n*c, c = ceil(T / n) or 2 if more (the token count is any number).
# The padding rows are reduced, normed and gathered like the others, then cut off by the
# gather.


def _rows_per_rank(total: int, world_size: int) -> int:
    """ceil(total / world_size), at least 2. A symbolic `total` gives a symbolic expression
    (no guard), the same for every shard. A row count that may be 1 would be guarded on
    (broadcasting asks whether it is 1; the compiled graph's token range starts at 2), so a
    shard has 2 rows even when the ranks hold fewer real ones."""
    return torch.sym_max((total + world_size - 1) // world_size, 2)


def _padded(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """`x` with zero rows appended up to a multiple of `world_size` (`x` itself if it is one)."""
    pad = _rows_per_rank(x.shape[0], world_size) * world_size - x.shape[0]
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x.contiguous()


def _new_shard(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """An empty shard of `x` (the ops' fake, and their output before it is written)."""
    return x.new_empty(_rows_per_rank(x.shape[0], world_size), *x.shape[1:])


# torch 2.11 has only the `_tensor` / `_into_tensor` names, which later versions deprecate.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_gather_rows_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@register_custom_op("tp_reduce_scatter_rows", mutates_args=(), fake_impl=_new_shard)
def _tp_reduce_scatter_rows(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """This rank's rows of the sum of `x` over the ranks (a [ceil(T/n), ...] shard)."""
    assert _group is not None and _group.size == world_size
    out = _new_shard(x, world_size)
    _reduce_scatter(out, _padded(x, world_size), group=_group.device_group)
    return out


@register_custom_op("tp_row_shard", mutates_args=(), fake_impl=_new_shard)
def _tp_row_shard(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """This rank's rows of `x` (the same on every rank: no communication), as a new tensor."""
    assert _group is not None and _group.size == world_size
    rows = _rows_per_rank(x.shape[0], world_size)
    return _padded(x, world_size)[_group.rank * rows : (_group.rank + 1) * rows].clone()


def _gather_rows_fake(x: torch.Tensor, total: int, world_size: int) -> torch.Tensor:
    return x.new_empty(total, *x.shape[1:])


@register_custom_op("tp_all_gather_rows", mutates_args=(), fake_impl=_gather_rows_fake)
def _tp_all_gather_rows(x: torch.Tensor, total: int, world_size: int) -> torch.Tensor:
    """Every rank's shard `x` stacked in rank order, the padding cut off: [total, ...]. `total`
    is an argument so that the fake knows the output's rows."""
    assert _group is not None and _group.size == world_size
    out = x.new_empty(x.shape[0] * world_size, *x.shape[1:])
    _gather_rows_into(out, x.contiguous(), group=_group.device_group)
    return out[:total]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (`x` itself with one rank)."""
    return x if tp_size() == 1 else torch.ops.srt.tp_all_reduce(x)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` concatenated on the last dimension, in rank order."""
    return x if tp_size() == 1 else torch.ops.srt.tp_all_gather(x, tp_size())


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass nothing), over the gloo group: one
    length, then the pickled bytes."""
    assert _group is not None
    group = _group.message_group
    if _group.rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(length, src=0, group=group)
        dist.broadcast(data, src=0, group=group)
        return obj
    length = torch.empty(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (`value` itself with one rank)."""
    if _group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group.message_group)
    return int(t.item())


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (`[obj]` with one rank)."""
    if _group is None:
        return [obj]
    out: list[Any] = [None] * _group.size
    dist.all_gather_object(out, obj, group=_group.message_group)
    return out
