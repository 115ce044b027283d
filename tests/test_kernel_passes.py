"""The kernel passes (`--compile-passes`): each layer op's decomposed reference, as Inductor's
graph shows it, replaced by the op's custom op (CPU: the op's CPU kernel, the reference).

Per pass on a small compiled function in the forms the models produce: the op is in the
code Inductor generates, the matches are counted, the output is the reference's (float32 and
bfloat16). Through the Engine on the tiny 2-layer Llama, in the piecewise and the partition
mode: every pass on, and each one off, gives the eager greedy ids and the per-model counts
(and Qwen3's per-head norms and rotary, matched too); `--custom-ops` turning a pass's kernel
off refuses the pass (CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from compile_helpers import (
    KERNEL_PASS_MATCHES,
    KERNEL_PASSES,
    greedy_ids,
    max_logit_error,
    tc_engine,
)
from torch._inductor.utils import run_and_get_code

from srt import Engine
from srt.compilation.graph_passes import applying, graph_passes, resolve_passes
from srt.layers.activation import silu_and_mul
from srt.layers.layernorm import fused_add_rms_norm, rms_norm
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.model_executor.graphs.config import (
    GraphConfigError,
    resolve_compile_passes,
    resolve_graph_config,
)
from srt.server_args import ServerArgs

PASSES, COUNTS = KERNEL_PASSES, KERNEL_PASS_MATCHES
EPS = 1e-5
T, HEADS, KV_HEADS, D = 7, 4, 2, 16  # odd token count: no size coincides with another


def expected_counts(passes: list[str]) -> dict[str, int]:
    counts = {name: COUNTS[name] for name in passes}
    if "rms_norm_kernel" in passes and "fused_add_rms_norm_kernel" not in passes:
        counts["rms_norm_kernel"] += COUNTS["fused_add_rms_norm_kernel"]  # their norms alone
    return counts


# ---- each pass on a small function ----


def residual_blocks(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor, nw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fused norms as the decoder's: the sum's x a plain product (Inductor folds the add
    into it: addmm) and a product with a bias."""
    h, s = fused_add_rms_norm(F.linear(x, w), r, nw, EPS)
    return fused_add_rms_norm(F.linear(h, w, b), s, nw, EPS)


def norms(x: torch.Tensor, qkv: torch.Tensor, nw: torch.Tensor, hw: torch.Tensor) -> Any:
    """A norm of the hidden state and Qwen3's per-head norm of q, a [T, H, D] view of the
    packed qkv."""
    q = qkv[:, : HEADS * D].reshape(qkv.shape[0], HEADS, D)
    return rms_norm(x, nw, EPS), rms_norm(q, hw, EPS)


ROTARY = RotaryEmbedding(D, 64, 10000.0, None)


def rotations(
    positions: torch.Tensor, qkv: torch.Tensor, hw: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Rotary on q and k split from the packed qkv (Llama), and on q and k normed per head
    first (Qwen3: heads already)."""
    t = qkv.shape[0]
    q, k, _ = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1)
    plain = ROTARY(positions, q, k)
    qn = rms_norm(q.reshape(t, -1, D), hw, EPS).reshape(t, -1)
    kn = rms_norm(k.reshape(t, -1, D), hw, EPS).reshape(t, -1)
    return *plain, *ROTARY(positions, qn, kn)


def gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of its packed [gate; up] product."""
    return silu_and_mul(F.linear(x, w))


def case(name: str, dtype: torch.dtype) -> tuple[Callable[..., Any], tuple[Any, ...], int, str]:
    """(function, arguments, matches, the op) of the pass `name`."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    hidden, qkv = 32, (HEADS + 2 * KV_HEADS) * D
    if name == "fused_add_rms_norm_kernel":
        args = (randn(T, hidden), randn(T, hidden), randn(hidden, hidden) / 6, randn(hidden))
        return residual_blocks, (*args, randn(hidden)), 2, "fused_add_rms_norm"
    if name == "rms_norm_kernel":
        return norms, (randn(T, hidden), randn(T, qkv), randn(hidden), randn(D)), 2, "rms_norm"
    if name == "rotary_kernel":
        positions = torch.tensor([0, 63, 3, 3, 31, 32, 10])
        return rotations, (positions, randn(T, qkv), randn(D)), 2, "rotary_embedding"
    return gated, (randn(T, hidden), randn(2 * 48, hidden) / 6), 1, "silu_and_mul"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", PASSES)
def test_a_pass_puts_the_op_in_inductors_graph(name: str, dtype: torch.dtype) -> None:
    fn, args, matches, op = case(name, dtype)
    for a in args:
        if a.dim() == 2 and a.shape[0] == T:
            torch._dynamo.mark_dynamic(a, 0)  # the token dimension, as the runner traces it
    positions = args[0] if name == "rotary_kernel" else None
    if positions is not None:
        torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.reset()
    # Inductor's graph cache off: a graph compiled by an earlier run would be loaded, and
    # the pass not run.
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)
    with no_cache, applying([name]) as log, torch.no_grad():
        out, [code] = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    assert log.matches == {name: [matches]}
    assert code.count(f" = torch.ops.srt.{op}.default(") == matches  # its calls
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, fn(*args), **tolerance)


def test_the_kernel_passes_run_in_their_order_and_name_their_ops() -> None:
    known = graph_passes()
    names = resolve_passes(["all"])
    assert names.index("fused_add_rms_norm_kernel") < names.index("rms_norm_kernel")
    assert {known[name].op for name in PASSES} == {
        "fused_add_rms_norm",
        "rms_norm",
        "rotary_embedding",
        "silu_and_mul",
    }


def test_a_pass_whose_kernel_is_off_or_missing_is_refused(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--custom-ops` asking for the reference of a pass's op refuses the pass (neither wins
    silently); a device without the kernels too, but the CPU (the op's reference)."""
    for custom_ops, message in [
        (["none"], r"rms_norm_kernel \(--custom-ops none\)"),
        (["all,-rms_norm"], r"rms_norm_kernel \(--custom-ops -rms_norm\)"),
    ]:
        with pytest.raises(GraphConfigError, match=message):
            tc_engine(
                tiny_llama,
                tmp_path,
                "inductor",
                compile_passes=["rms_norm_kernel"],
                custom_ops=custom_ops,
            )
    args = ServerArgs(
        cuda_graph_backend_decode="tc_piecewise",
        cuda_graph_tc_compiler="inductor",
        compile_passes=["silu_and_mul_kernel"],
        custom_ops=["none", "+silu_and_mul"],  # the kernel forced on: no contradiction
    )
    configs = resolve_graph_config(args, "cuda")
    assert resolve_compile_passes(args, configs, "cuda") == ("silu_and_mul_kernel",)
    monkeypatch.setattr("srt.op_selection.HAS_TRITON", False)
    with pytest.raises(GraphConfigError, match="triton is not installed"):
        resolve_compile_passes(args, configs, "cuda")
    assert resolve_compile_passes(args, configs, "cpu") == ("silu_and_mul_kernel",)


# ---- through the Engine (the partition mode's tests last: its fixture stays on) ----


def check_engine(
    model: Path, cache: Path, reference: list[list[int]], passes: list[str], **options: Any
) -> None:
    with tc_engine(model, cache, "inductor", compile_passes=passes, **options) as eng:
        assert greedy_ids(eng) == reference  # a prefill, then decode steps
        info = eng.get_server_info()["compile"]
        if passes == PASSES:  # every bucket kind, the general graph too
            assert max_logit_error(eng.runner) <= 1e-4
    assert info["passes"] == passes
    assert info["pass_matches"] == expected_counts(passes)


OFF = [None, *PASSES]


def passes_without(off: str | None) -> list[str]:
    return [name for name in PASSES if name != off]


@pytest.mark.parametrize("off", OFF, ids=[f"without-{o}" if o else "all" for o in OFF])
def test_the_passes_give_eager_ids_in_the_pieces(
    off: str | None, tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    check_engine(tiny_llama, tmp_path, reference, passes_without(off))


def test_qwen3s_heads_are_matched(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """Qwen3: its per-head q and k norms too (two per layer), and the rotary of heads that
    the norm gave (no view to match)."""
    model = tiny_model_factory("qwen3")
    with Engine(model_path=str(model), device="cpu", dtype="float32") as eager:
        expected = greedy_ids(eager)
    layers = 2
    counts = {**COUNTS, "rms_norm_kernel": COUNTS["rms_norm_kernel"] + 2 * layers}
    with tc_engine(model, tmp_path, "inductor", compile_passes=PASSES) as eng:
        assert greedy_ids(eng) == expected
        assert eng.get_server_info()["compile"]["pass_matches"] == counts


@pytest.mark.parametrize("off", OFF, ids=[f"without-{o}" if o else "all" for o in OFF])
def test_the_passes_give_eager_ids_in_the_partition_mode(
    off: str | None,
    tiny_llama: Path,
    tmp_path: Path,
    reference: list[list[int]],
    partitions_on_the_cpu: None,
) -> None:
    passes = passes_without(off)
    check_engine(tiny_llama, tmp_path, reference, passes, inductor_graph_partition=True)
