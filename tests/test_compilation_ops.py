"""Every custom op passes `opcheck` (torch.library.opcheck plus our fake-vs-real stride check),
and the same check rejects a fake (meta) implementation whose output has the wrong stride or
shape, on the CPU, on every supported torch (2.11's opcheck skips CPU strides). The layer ops'
Triton kernels are checked where they can run: on CUDA, or on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from layer_op_cases import kernel_device, op_cases, skinny_cases_table

import srt.layers.attention.layer  # noqa: F401 (defines srt::attention)
from srt.batch_layout import ForwardMode
from srt.compilation.op_registry import custom_ops, opcheck, register_custom_op, split_ops
from srt.distributed import destroy_tp, init_tp
from srt.layers.attention.layer import forward_context
from srt.layers.attention.registry import create_attention_backend
from srt.model_executor.graphs.static_batch import dummy_plan
from srt.model_executor.step_inputs import upload_step
from srt.op_selection import OPS
from srt.tp_rank import TPRank, free_port

Sample = tuple[tuple, AbstractContextManager]


def attention_sample() -> Sample:
    heads, kv_heads, head_dim, tokens = 4, 2, 8, 6
    backend = create_attention_backend("torch_native", heads, kv_heads, head_dim)
    table = torch.arange(16, dtype=torch.int32).repeat(2, 1)  # row 0 reads slots 0..15
    batch = upload_step(dummy_plan(ForwardMode.EXTEND, tokens, 16), table)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads * head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads * head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads * head_dim, generator=gen)
    k_cache = torch.randn(16, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(16, kv_heads, head_dim, generator=gen)
    return (q, k, v, torch.empty_like(q), k_cache, v_cache, head_dim**-0.5), forward_context(
        batch, backend
    )


def layer_op_sample(qualname: str) -> Callable[[], Sample]:
    """The first of the layer op cases for the op (run where its kernel can run)."""

    def sample() -> Sample:
        device = kernel_device()
        cases = op_cases(torch.bfloat16, device)
        args = next(args for op, _, args in cases if op._qualname == qualname)
        return args, skinny_cases_table(device)

    return sample


@contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone, for the tensor-parallel collectives."""
    init_tp(TPRank(0, 1, f"tcp://127.0.0.1:{free_port()}"), torch.device("cpu"))
    try:
        yield
    finally:
        destroy_tp()


def all_reduce_sample() -> Sample:
    return (torch.randn(3, 8),), one_rank_group()


def all_gather_sample() -> Sample:
    return (torch.randn(3, 8), 1), one_rank_group()


def rows_sample(*extra: int) -> Callable[[], Sample]:
    """The sequence-parallel row collectives, on 5 rows (`extra`: their int arguments)."""

    def sample() -> Sample:
        return (torch.randn(5, 8), *extra), one_rank_group()

    return sample


# One sample per op: an op registered without a sample here fails the coverage test.
SAMPLES: dict[str, Callable[[], Sample]] = {
    "srt::attention": attention_sample,
    "srt::tp_all_reduce": all_reduce_sample,
    "srt::tp_all_gather": all_gather_sample,
    "srt::tp_reduce_scatter_rows": rows_sample(1),
    "srt::tp_row_shard": rows_sample(1),
    "srt::tp_all_gather_rows": rows_sample(5, 1),
    **{f"srt::{op}": layer_op_sample(f"srt::{op}") for op in OPS},
    "srt::skinny_matmul_silu_and_mul": layer_op_sample("srt::skinny_matmul_silu_and_mul"),
}


def test_every_srt_op_has_a_sample() -> None:
    ours = {name for name in custom_ops() if name.startswith("srt::")}
    assert ours == set(SAMPLES)
    assert set(split_ops()) <= ours


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name: str) -> None:
    args, context = SAMPLES[name]()
    with context:
        opcheck(custom_ops()[name], args)


def _transposed_like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1], x.shape[0]).t()  # right shape, column-major strides


def _one_row_too_many(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0] + 1, x.shape[1])


@pytest.mark.parametrize(
    ("fake", "complaint"),
    [
        (_transposed_like, "Stride mismatch"),
        (_one_row_too_many, "Shapes .* are not equal"),
    ],
)
def test_opcheck_rejects_a_wrong_fake(fake: Callable, complaint: str) -> None:
    @register_custom_op(
        fake.__name__.strip("_"), mutates_args=(), fake_impl=fake, namespace="srt_test"
    )
    def copy(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    with pytest.raises(AssertionError, match=f"fake implementation of srt_test::.*{complaint}"):
        opcheck(copy, (torch.randn(3, 5),))
