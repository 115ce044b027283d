"""The layer ops with a Triton kernel and a PyTorch reference (srt/layers/custom_op.py): the
`--custom-ops` grammar, the default rule per compiler, the call-time choice inside a Dynamo
trace, the fakes' layouts, and each kernel against its reference.

Kernel tests run on CUDA (gpu) and, on the CPU, in a process started with TRITON_INTERPRET=1
where triton is installed (skipped otherwise). The interpreter truncates float32 to bfloat16
where the GPU rounds to nearest, so bf16 is compared within a few bf16 ulps, not bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from compile_helpers import greedy_ids, tc_engine
from layer_op_cases import (
    INTERPRETED,
    KERNEL_DEVICES,
    LLAMA3_SCALING,
    op_cases,
    skinny_cases_table,
    skinny_entries,
    skinny_table_for,
)
from torch._prims_common import check_significant_strides
from torch._subclasses.fake_tensor import FakeTensorMode

from srt import Engine
from srt.compilation.op_registry import inductor_trace
from srt.layers.activation import SiluAndMul
from srt.layers.custom_op import apply_custom_ops
from srt.layers.layernorm import RMSNorm, fused_add_rms_norm_kernel, rms_norm_kernel
from srt.layers.linear import (
    Linear,
    skinny_config,
    skinny_matmul_kernel,
    skinny_matmul_silu_and_mul_kernel,
)
from srt.layers.rotary_embedding import RotaryEmbedding, rotary_kernel
from srt.model_executor.runner_setup import skinny_launch
from srt.op_selection import (
    OPS,
    PDL_MIN_CAPABILITY,
    SKINNY_LAUNCHES,
    OpImpl,
    asks_for_kernels,
    parse_custom_ops,
    resolve_custom_ops,
)
from srt.server_args import ServerArgs, ServerArgsError

# ---- the grammar ----


@pytest.mark.parametrize(
    ("entries", "forced"),
    [
        (None, dict.fromkeys(OPS)),
        (["all"], dict.fromkeys(OPS, "all")),
        (["none", "+rms_norm"], {**dict.fromkeys(OPS, "none"), "rms_norm": "+rms_norm"}),
        (
            ["-silu_and_mul,all", "-rotary_embedding"],
            {
                **dict.fromkeys(OPS, "all"),
                "silu_and_mul": "-silu_and_mul",
                "rotary_embedding": "-rotary_embedding",
            },
        ),
        (
            ["none", "+rms_norm", "+rms_norm"],
            {**dict.fromkeys(OPS, "none"), "rms_norm": "+rms_norm"},
        ),
    ],
)
def test_valid_lists(entries: list[str] | None, forced: dict[str, str | None]) -> None:
    assert parse_custom_ops(entries) == forced


@pytest.mark.parametrize(
    ("entries", "complaint"),
    [
        ([], "needs exactly one of 'all' or 'none'"),
        (["+rms_norm"], "needs exactly one of 'all' or 'none'"),
        (["all", "none"], "needs exactly one of 'all' or 'none'"),
        (["all", "all"], "needs exactly one of 'all' or 'none'"),
        (["all", "-rms"], "unknown op 'rms' in '-rms'; the ops are fused_add_rms_norm, "),
        (["none", "rms_norm"], "invalid entry 'rms_norm': expected all, none, \\+NAME or -NAME"),
        (["none", "+silu_and_mul", "-silu_and_mul"], "\\+silu_and_mul and -silu_and_mul contra"),
        ("all", "expected a list of entries"),
    ],
)
def test_invalid_lists_name_the_flag(entries: Any, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_custom_ops(entries)
    with pytest.raises(ServerArgsError, match=f"^argument --custom-ops: {complaint}"):
        ServerArgs(custom_ops=entries).check()


def test_engine_refuses_an_invalid_list_before_loading() -> None:
    with pytest.raises(ServerArgsError, match="argument --custom-ops: needs exactly one of"):
        Engine(model_path="/nonexistent", custom_ops=["all", "none"])


@pytest.mark.parametrize(
    ("argv", "entries"),
    [
        (["--custom-ops", "none", "+rms_norm"], ["none", "+rms_norm"]),
        (["--custom-ops", "all,-rotary_embedding"], ["all,-rotary_embedding"]),
        (["--custom-ops=-rotary_embedding,all"], ["-rotary_embedding,all"]),
        ([], None),
    ],
)
def test_cli_form(argv: list[str], entries: list[str] | None) -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    assert args.custom_ops == entries
    args.check()


def test_default_rule_per_compiler() -> None:
    """Unset: the kernel, except inside a graph Inductor compiles; a forced entry wins in
    both; with no kernels here, the reference everywhere."""
    default = resolve_custom_ops(None, None)
    assert {(i.kernel, i.kernel_in_inductor) for i in default.values()} == {(True, False)}
    forced = resolve_custom_ops(["none", "+silu_and_mul"], None)
    assert (forced["silu_and_mul"].kernel, forced["silu_and_mul"].kernel_in_inductor) == (
        True,
        True,
    )
    assert forced["silu_and_mul"].why == "--custom-ops +silu_and_mul"
    assert (forced["rms_norm"].kernel, forced["rms_norm"].kernel_in_inductor) == (False, False)
    off = resolve_custom_ops(["all"], "no kernels on cpu")
    assert all(not i.kernel and not i.kernel_in_inductor for i in off.values())
    assert {i.why for i in off.values()} == {"no kernels on cpu"}
    assert asks_for_kernels(["none", "+rms_norm"]) and asks_for_kernels(["all"])
    assert not asks_for_kernels(None) and not asks_for_kernels(["none", "-rms_norm"])


# ---- the choice at call time ----


def traced_ops(module: torch.nn.Module, inductor: bool, *args: torch.Tensor) -> set[str]:
    """The `srt::` ops in the graph Dynamo traces of `module(*args)` (meta tensors: a kernel
    op runs its fake there, so no kernel is needed)."""
    seen: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        seen.update(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("srt."))
        return gm.forward

    torch._dynamo.reset()
    with inductor_trace(inductor):
        torch.compile(module, backend=backend, fullgraph=True)(*args)
    return seen


class Block(torch.nn.Module):
    """The ops, as a decoder layer uses them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = Linear(16, [16])
        self.norm = RMSNorm(16)
        self.rotary = RotaryEmbedding(8, 32, 10000.0, LLAMA3_SCALING)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        normed = self.norm(self.proj(x))
        x, residual = self.norm(x, residual)
        q, k = self.rotary(pos, x, normed)
        return self.act(torch.cat([q, k], dim=-1)) + residual


@pytest.mark.parametrize(
    ("entries", "outside", "inside"),
    [
        (None, set(OPS), set()),
        (["all"], set(OPS), set(OPS)),
        (["none", "+rms_norm"], {"rms_norm"}, {"rms_norm"}),
        (
            ["all", "-fused_add_rms_norm"],
            set(OPS) - {"fused_add_rms_norm"},
            set(OPS) - {"fused_add_rms_norm"},
        ),
    ],
)
def test_dynamo_traces_the_selected_impl(
    entries: list[str] | None, outside: set[str], inside: set[str]
) -> None:
    block = Block().to("meta")
    apply_custom_ops(block, resolve_custom_ops(entries, None))
    args = (torch.empty(3, 16, device="meta"),) * 2 + (
        torch.zeros(3, dtype=torch.long, device="meta"),
    )
    assert traced_ops(block, False, *args) == {f"srt.{op}.default" for op in outside}
    assert traced_ops(block, True, *args) == {f"srt.{op}.default" for op in inside}


@pytest.mark.skipif(not INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    ("compiler", "entries", "kernels_traced"),
    [
        ("eager", None, True),
        ("eager", ["none"], False),
        ("inductor", None, False),
        ("inductor", ["all"], True),
    ],
)
def test_tc_piecewise_traces_the_selected_impl(
    compiler: str,
    entries: list[str] | None,
    kernels_traced: bool,
    tiny_llama: Path,
    tmp_path: Path,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One trace for the eager pieces keeps the kernels in it as opaque ops (their CPU
    kernel, the reference, runs them here); a trace for Inductor holds the reference by
    default."""
    monkeypatch.setattr("srt.model_executor.runner_setup.kernels_missing", lambda device: None)
    with tc_engine(tiny_llama, tmp_path, compiler, custom_ops=entries) as eng:
        info = eng.get_server_info()
        graph = (Path(info["compile"]["cache_dir"]) / "computation_graph.py").read_text()
        traced = set(re.findall(r"torch\.ops\.srt\.(\w+)\.default", graph))
        # With the skinny kernel selected, the MLP's SiLU-and-mul is fused into its product.
        if "skinny_matmul_silu_and_mul" in traced:
            traced |= {"skinny_matmul", "silu_and_mul"}
        # The rotary kernel runs inside the attention op, with the KV write, where the graph
        # hands the op the rotary tables.
        if re.search(r"srt\.attention\.default\([^)]*cos_cache", graph):
            traced.add("rotary_embedding")
        for op in OPS:
            assert (op in traced) == kernels_traced, op
        assert greedy_ids(eng) == reference


def test_a_layer_without_a_selection_runs_the_reference() -> None:
    norm = RMSNorm(16)
    assert norm.op_impls == {} and not norm.uses_kernel("rms_norm")
    norm.op_impls = {"rms_norm": OpImpl(True, False, "test")}
    with inductor_trace():  # not tracing: the eager choice
        assert norm.uses_kernel("rms_norm")


# ---- the fakes ----


def _leaves(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def test_fakes_match_the_reference_layout() -> None:
    for op, reference, args in op_cases(torch.bfloat16, "cpu"):
        expected = _leaves(reference(*args))
        with FakeTensorMode() as mode:
            fake_args = tuple(
                mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
            )
            fake = _leaves(op(*fake_args))
        assert len(fake) == len(expected), op
        for f, e in zip(fake, expected, strict=True):
            assert (f.shape, f.dtype) == (e.shape, e.dtype), op
            assert check_significant_strides(f, e, only_cuda=False)[0], op


# ---- kernels against the reference ----


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}


def poisoned_run(op: Callable, args: tuple) -> list[torch.Tensor]:
    """Run the kernel behind `op` into NaN-filled outputs (through its Triton launcher), so
    that an element it leaves unwritten fails the comparison."""
    from srt.layers.triton_ops.rms_norm import rms_norm_into
    from srt.layers.triton_ops.rotary import rotary_into
    from srt.layers.triton_ops.silu_and_mul import silu_and_mul_into
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    outs = [torch.full_like(t, float("nan")) for t in _leaves(op(*args))]
    if op in (skinny_matmul_kernel, skinny_matmul_silu_and_mul_kernel):
        x, weight, third = args
        gated = op is skinny_matmul_silu_and_mul_kernel
        config = skinny_config(x, weight, gated)
        if config is None:  # cuBLAS's rows: nothing of ours to poison
            return [op(*args)]
        skinny_matmul_into(outs[0], x, weight, None if gated else third, config, gated)
    elif op is rms_norm_kernel:
        rms_norm_into(outs[0], *args)
    elif op is fused_add_rms_norm_kernel:
        x, residual, weight, eps = args
        rms_norm_into(outs[0], x, weight, eps, residual, outs[1])
    elif op is rotary_kernel:
        rotary_into(outs[0], outs[1], *args)
    else:
        silu_and_mul_into(outs[0], *args)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernels_match_the_reference(device: str, dtype: torch.dtype) -> None:
    cases = op_cases(dtype, device)
    with skinny_cases_table(device):
        ran = [
            skinny_config(args[0], args[1], op is skinny_matmul_silu_and_mul_kernel)
            for op, _, args in cases
            if op in (skinny_matmul_kernel, skinny_matmul_silu_and_mul_kernel)
        ]
        assert sum(c is not None for c in ran) == 5, ran  # all but the 20 rows ran the kernel
        _check_cases(cases, dtype)


def _check_cases(cases: list, dtype: torch.dtype) -> None:
    for op, reference, args in cases:
        for out, expected in zip(poisoned_run(op, args), _leaves(reference(*args)), strict=True):
            torch.testing.assert_close(
                out, expected, **tolerance(dtype), msg=lambda m, op=op: f"{op}: {m}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kv_write_kernel_matches_indexed_assignment(device: str, dtype: torch.dtype) -> None:
    """The attention backends' one KV write: K and V as the model passes them (views of the
    fused qkv projection), an odd head size, padded tokens all on the dummy slot 0."""
    from srt.layers.attention.triton_ops.kv_write import write_kv

    gen = torch.Generator().manual_seed(0)
    tokens, heads, head_dim, slots = 7, 3, 72, 40
    qkv = torch.randn(tokens, (4 + 2) * heads * head_dim, generator=gen).to(device, dtype)
    k, v = qkv[:, 4 * heads * head_dim :].split(heads * head_dim, dim=-1)
    k, v = k.view(tokens, heads, head_dim), v.view(tokens, heads, head_dim)
    loc = torch.tensor([5, 39, 1, 12, 0, 0, 0], dtype=torch.int32, device=device)
    poison = torch.full((slots, heads, head_dim), float("nan"), dtype=dtype, device=device)
    caches = [poison.clone(), poison.clone()]
    write_kv(*caches, loc, k, v)
    want = [poison.clone(), poison.clone()]
    want[0][loc[:4].long()], want[1][loc[:4].long()] = k[:4], v[:4]
    for got, expected, src in zip(caches, want, (k, v), strict=True):
        # Every slot but 0 is the reference's exactly. Slot 0 took the three padded tokens,
        # racing (on the GPU the last store of each element wins): each of its elements is
        # that element of one of them.
        assert torch.equal(got[1:].nan_to_num(7.0), expected[1:].nan_to_num(7.0))
        assert (got[0][None] == src[4:]).any(dim=0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rotary_kv_write_kernel_gives_the_rotary_kernel_and_the_kv_write(
    device: str, dtype: torch.dtype
) -> None:
    """The rotary embedding fused with the KV write: q and k (views of the packed qkv, an odd
    head count) rotated as the rotary kernel rotates them, bit for bit, and the rotated k and
    v written where `write_kv` writes them; the reference rotation within bf16 tolerance."""
    from srt.layers.attention.triton_ops.kv_write import rotary_write_kv, write_kv
    from srt.layers.rotary_embedding import rotary

    gen = torch.Generator().manual_seed(0)
    tokens, q_heads, kv_heads, head_dim, slots = 6, 6, 3, 24, 40
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rope = RotaryEmbedding(head_dim, 300, 500000.0, LLAMA3_SCALING).to(device)
    positions = torch.tensor([0, 299, 3, 31, 32, 100], device=device)
    loc = torch.tensor([5, 39, 1, 12, 7, 30], dtype=torch.int32, device=device)
    poison = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    fused = [poison.clone(), poison.clone()]
    q_rot, k_rot = rotary_write_kv(*fused, loc, positions, q, k, v, rope.cos_cache, rope.sin_cache)
    want_q, want_k = rotary_kernel(positions, q, k, rope.cos_cache, rope.sin_cache)
    unfused = [poison.clone(), poison.clone()]
    write_kv(*unfused, loc, want_k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, -1))
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    for got, expected in zip(fused, unfused, strict=True):
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    ref_q, ref_k = rotary(positions, q, k, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q_rot, ref_q, **tolerance(dtype))
    torch.testing.assert_close(k_rot, ref_k, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_argmax_kernel_gives_torch_argmax(device: str, dtype: torch.dtype) -> None:
    """The greedy ids of the sampler and of full graphs: torch's argmax exactly, the first
    index of the maximum, with ties inside a chunk and across chunks (2048 wide)."""
    from srt.layers.triton_ops.argmax import argmax_rows

    gen = torch.Generator().manual_seed(0)
    vocab = 5000  # three chunks, the last one partial
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    logits[1, [10, 900, 4999]] = 9.0  # a tie inside the first chunk and with the last
    logits[2, [2047, 2048]] = 9.0  # across a chunk boundary
    logits[3] = float("-inf")  # nothing but -inf: index 0
    logits[4, 3000] = float("inf")
    logits[5, [7, 4000]] = float("nan")  # NaN is the maximum, the first one wins
    logits[6] = 0.0  # all equal
    logits = logits.to(device)
    out = torch.full((7,), -1, dtype=torch.int64, device=device)
    assert argmax_rows(logits, out) is out
    assert out.tolist() == torch.argmax(logits.cpu(), dim=-1).tolist()
    assert out.tolist()[1:7] == [10, 2047, 0, 3000, 7, 0]
    small = torch.randn(3, 17, generator=gen).to(device, dtype)  # one partial chunk
    assert argmax_rows(small).tolist() == torch.argmax(small.cpu(), dim=-1).tolist()


ARCHS = [("llama", {"rope_scaling": "llama3"}), ("qwen3", {})]  # rope scaling; q/k norm


def model_products(path: Path) -> list[tuple[int, int, bool]]:
    """The decode step's products of the checkpoint at `path`: (weight rows, inputs, gated)."""
    config = json.loads((path / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return [
        (heads * head_dim + 2 * kv, hidden, False),
        (hidden, heads * head_dim, False),
        (2 * inter, hidden, True),
        (hidden, inter, False),
        (config["vocab_size"], hidden, False),
    ]


def greedy_ids_under_a_skinny_table(
    path: Path, device: str, entries: list[str], **options: Any
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Greedy ids of the model with `--custom-ops entries`, the skinny matmul kernel chosen for
    every product of up to 8 rows (a table that says so), and the kernel's launches as (rows,
    pdl)."""
    name = torch.cuda.get_device_name() if device == "cuda" else device
    launches: list[tuple[int, int]] = []
    import srt.layers.triton_ops.skinny_matmul as skinny

    def counted(*args: Any, **kwargs: Any) -> None:
        launches.append((args[1].shape[0], kwargs.get("pdl", 0)))
        original(*args, **kwargs)

    original = skinny.skinny_matmul_into
    with (
        skinny_table_for(name, skinny_entries(model_products(path), ["float32"])),
        mock.patch.object(skinny, "skinny_matmul_into", counted),
        Engine(
            model_path=str(path), device=device, dtype="float32", custom_ops=entries, **options
        ) as eng,
    ):
        if device == "cpu":  # the runner never picks kernels without CUDA: force them
            apply_custom_ops(eng.runner.model, resolve_custom_ops(entries, None))
        norm = eng.runner.model.model.norm
        assert norm.uses_kernel("fused_add_rms_norm") == (entries == ["all"])
        return greedy_ids(eng), launches


def greedy_ids_kernels_on_and_off(path: Path, device: str, **options: Any) -> dict[str, Any]:
    """Greedy ids of the model with every kernel off (`none`) and every one on (`all`), the
    skinny matmul kernel running every product of up to 8 rows."""
    ids = {}
    for entries in (["none"], ["all"]):
        ids[entries[0]], launches = greedy_ids_under_a_skinny_table(
            path, device, entries, **options
        )
        assert bool(launches) == (entries == ["all"]), launches
    return ids


@pytest.mark.skipif(not INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize(("arch", "kwargs"), ARCHS, ids=[a for a, _ in ARCHS])
def test_kernels_on_give_the_greedy_ids_of_the_reference(
    arch: str, kwargs: dict[str, Any], tiny_model_factory: Callable[..., Path]
) -> None:
    ids = greedy_ids_kernels_on_and_off(tiny_model_factory(arch, **kwargs), "cpu")
    assert ids["all"] == ids["none"]


GPU_GRAPHS = {
    "default": {},  # decode full (kernels captured), prefill eager
    "breakable": {
        "cuda_graph_backend_decode": "breakable",
        "cuda_graph_backend_prefill": "breakable",
    },
    "tc_piecewise-eager": {
        "cuda_graph_backend_decode": "tc_piecewise",
        "cuda_graph_backend_prefill": "tc_piecewise",
        "cuda_graph_tc_compiler": "eager",
    },
    "tc_piecewise-inductor": {
        "cuda_graph_backend_decode": "tc_piecewise",
        "cuda_graph_backend_prefill": "tc_piecewise",
        "cuda_graph_tc_compiler": "inductor",
    },
    "full-torch-compile": {
        "cuda_graph_backend_decode": "full",
        "enable_torch_compile": True,
        "torch_compile_max_bs": 4,
    },
}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", list(GPU_GRAPHS))
@pytest.mark.parametrize(("arch", "kwargs"), ARCHS, ids=[a for a, _ in ARCHS])
def test_kernels_on_give_the_greedy_ids_of_the_reference_on_the_gpu(
    arch: str,
    kwargs: dict[str, Any],
    graphs: str,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """The kernels inside CUDA graphs, the eager pieces and Inductor's graphs (as opaque ops)."""
    path = tiny_model_factory(arch, **kwargs)
    options = {"compile_cache_dir": str(tmp_path), **GPU_GRAPHS[graphs]}
    ids = greedy_ids_kernels_on_and_off(path, "cuda", **options)
    assert ids["all"] == ids["none"]


@pytest.mark.gpu
def test_the_skinny_kernel_launched_as_a_dependent_gives_the_plain_launches_ids(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """`--skinny-matmul-launch pdl` inside the decode step's CUDA graphs, after RMSNorm and
    attention kernels that release their dependents as they start: every launch of the kernel
    is a dependent one, and the ids are the plain launches' (each waits for the kernel before
    it, then reads its input, so the bits are the same)."""
    launch = "pdl"
    if torch.cuda.get_device_capability() < PDL_MIN_CAPABILITY:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    path = tiny_model_factory("llama", rope_scaling="llama3")
    ids = {}
    for mode in ("plain", launch):
        ids[mode], launches = greedy_ids_under_a_skinny_table(
            path, "cuda", ["all"], skinny_matmul_launch=mode, compile_cache_dir=str(tmp_path)
        )
        assert launches and {pdl for _, pdl in launches} == {SKINNY_LAUNCHES[mode]}, launches
    assert ids[launch] == ids["plain"]


def test_a_dependent_launch_reaches_the_skinny_kernel_from_the_layer() -> None:
    """The launch the runner gives the layers is what each product passes to the kernel, plain
    and gated (the kernel itself is mocked: a dependent launch needs CUDA)."""
    import srt.layers.triton_ops.skinny_matmul as skinny

    layer = Linear(32, [48, 48])
    layer.weight.data.normal_()
    apply_custom_ops(layer, resolve_custom_ops(["all"], None), skinny_launch=1)
    shapes = skinny_entries([(96, 32, False), (96, 32, True)], ["float32"])
    calls: list[int] = []
    with (
        skinny_table_for("cpu", shapes),
        mock.patch.object(skinny, "skinny_matmul_into", lambda *a, **k: calls.append(k["pdl"])),
    ):
        layer(torch.randn(3, 32))
        layer.silu_and_mul_of(torch.randn(1, 32), SiluAndMul())
    assert calls == [1, 1]


def test_a_dependent_launch_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ServerArgsError, match="--skinny-matmul-launch: pdl needs CUDA"):
        ServerArgs(device="cpu", skinny_matmul_launch="pdl").check()
    with pytest.raises(ServerArgsError, match="invalid choice: 'fast'"):
        ServerArgs(skinny_matmul_launch="fast").check()
    with pytest.raises(ServerArgsError, match="compute capability 9.0 or newer, not cpu"):
        skinny_launch("pdl", torch.device("cpu"))
    assert skinny_launch("plain", torch.device("cpu")) == 0


# ---- the runner ----


def test_runner_reports_and_logs_the_selection(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="srt.model_executor.runner_setup"),
        Engine(model_path=str(tiny_llama), device="cpu", custom_ops=["none", "+rms_norm"]) as eng,
    ):
        info = eng.get_server_info()["runner"]["custom_ops"]
    assert info["rms_norm"] == {
        "impl": "reference",
        "in_inductor_graph": "reference",
        "why": "no kernels on cpu",
    }
    assert set(info) == set(OPS)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["--custom-ops asks for kernels, but no kernels on cpu: the reference runs"]
    assert any(
        r.getMessage().startswith("custom ops: fused_add_rms_norm: reference")
        for r in caplog.records
    )
