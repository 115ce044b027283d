"""The layer ops with a Triton kernel and a PyTorch reference (srt/layers/custom_op.py): the
`--custom-ops` grammar, the default rule per compiler, the call-time choice inside a Dynamo
trace, the fakes' layouts, and each kernel against its reference.

Kernel tests run on CUDA (gpu) and, on the CPU, in a process started with TRITON_INTERPRET=1
where triton is installed (skipped otherwise). The interpreter truncates float32 to bfloat16
where the GPU rounds to nearest, so bf16 is compared within a few bf16 ulps, not bit for bit.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from compile_helpers import PROMPTS, greedy_ids, tc_engine
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

import srt.model_executor.runner_setup as runner_setup
from srt import Engine
from srt.compilation.op_registry import inductor_trace
from srt.layers.activation import SiluAndMul
from srt.layers.custom_op import apply_custom_ops
from srt.layers.layernorm import RMSNorm, fused_add_rms_norm_kernel, rms_norm_kernel
from srt.layers.linear import (
    Linear,
    kernel_input,
    skinny_config,
    skinny_matmul_kernel,
    skinny_matmul_silu_and_mul_kernel,
)
from srt.layers.rotary_embedding import RotaryEmbedding, rotary_kernel
from srt.model_executor.runner_setup import skinny_launch
from srt.op_selection import (
    OPS,
    PDL_MIN_CAPABILITY,
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
        # Where the norms are in the skinny products (and the trace runs the kernel), the
        # residual add and the norm are in theirs.
        if eng.runner.model.model.layers[0].norms_in_products and "skinny_matmul" in traced:
            traced.add("fused_add_rms_norm")
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
        call = inspect.signature(op.fn).bind(*args)
        call.apply_defaults()
        a = call.arguments
        gated = op is skinny_matmul_silu_and_mul_kernel
        config = skinny_config(a["x"], a["weight"], gated)
        if config is None:  # cuBLAS's rows: nothing of ours to poison
            return [op(*args)]
        x, rms_eps = kernel_input(a["x"], a["rms_eps"])
        skinny_matmul_into(
            outs[0], x, a["weight"], a.get("bias"), config, gated, 0, a.get("residual"), rms_eps
        )
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
        assert sum(c is not None for c in ran) == 9, ran  # all but the 20 rows ran the kernel
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


def with_random_norm_weights(path: Path, dest: Path) -> Path:
    """A copy at `dest` of the one-file checkpoint at `path`, its RMSNorm weights drawn
    around one: a trained model's are not ones, as a freshly initialised one's are, and a
    norm's weight folded into the product after it changes that product's weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    weights = dest / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest


def greedy_ids_counting_norms(
    path: Path, entries: list[str], checkpoint: dict[str, torch.Tensor]
) -> tuple[list[list[int]], list[int], list[int]]:
    """Greedy ids of the model at `path` with `--custom-ops entries` where the runner is told
    kernels can run on the CPU (under the interpreter), the skinny kernel chosen for every
    product of up to 8 rows; with the rows of each norm kernel launch and of each forward (its
    final norm's input). With the kernels on, the first layer's weights are checked folded."""
    import srt.layers.triton_ops.rms_norm as norm_kernel

    norms: list[int] = []
    forwards: list[int] = []
    launch_norm = norm_kernel.rms_norm_into

    def counted_norm(*args: Any, **kwargs: Any) -> None:
        norms.append(args[1].shape[0])
        launch_norm(*args, **kwargs)

    with (
        mock.patch.object(runner_setup, "kernels_missing", lambda device_type: None),
        mock.patch.object(norm_kernel, "rms_norm_into", counted_norm),
        skinny_table_for("cpu", skinny_entries(model_products(path), ["float32"])),
        Engine(model_path=str(path), device="cpu", dtype="float32", custom_ops=entries) as eng,
    ):
        layer = eng.runner.model.model.layers[0]
        assert layer.norms_in_products == (entries == ["all"])
        if layer.norms_in_products:
            g = checkpoint["model.layers.0.input_layernorm.weight"]
            q = checkpoint["model.layers.0.self_attn.q_proj.weight"]
            assert torch.equal(layer.input_layernorm.weight, torch.ones_like(g))
            torch.testing.assert_close(layer.self_attn.qkv_proj.weight[: q.shape[0]], q * g)
        final = eng.runner.model.model.norm
        final_forward = final.forward

        def counted_forward(x: torch.Tensor, *args: Any) -> Any:
            forwards.append(x.shape[0])
            return final_forward(x, *args)

        norms.clear()
        with mock.patch.object(final, "forward", counted_forward):
            # the prompts together, then the first alone (its decodes one row each)
            ids = greedy_ids(eng) + greedy_ids(eng, PROMPTS[:1])
        return ids, norms, forwards


@pytest.mark.skipif(not INTERPRETED, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: QKV with a bias
def test_the_norms_in_the_products_give_the_greedy_ids_of_the_layers(
    arch: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Where the skinny kernel runs, the decoder layers' norms go into the products after
    them: the norms' weights folded into QKV's and gate/up's (the norms' then ones), the
    residual added in o_proj's and down_proj's launch; at one row no norm kernel launches
    but the final one's. The greedy ids are those of the layers with every kernel off."""
    from safetensors.torch import load_file

    path = with_random_norm_weights(tiny_model_factory(arch), tmp_path / "ckpt")
    checkpoint = load_file(path / "model.safetensors")
    reference, _, _ = greedy_ids_counting_norms(path, ["none"], checkpoint)
    ids, norms, forwards = greedy_ids_counting_norms(path, ["all"], checkpoint)
    assert ids == reference
    # A forward of one row launches the final norm alone; one of more (the tensor cores'
    # rows, cuBLAS's) the norm before each product too.
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    per_forward = {True: 1, False: 2 * layers + 1}
    expected = [rows for rows in forwards for _ in range(per_forward[rows == 1])]
    assert sorted(norms) == sorted(expected), (norms, forwards)
    assert min(forwards) == 1 < max(forwards), forwards  # both kinds ran


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
    """The kernels inside CUDA graphs, the eager pieces and Inductor's graphs (as opaque ops),
    the norms in the skinny products (with weights that are not ones: folded in)."""
    path = with_random_norm_weights(tiny_model_factory(arch, **kwargs), tmp_path / "ckpt")
    options = {"compile_cache_dir": str(tmp_path / "cache"), **GPU_GRAPHS[graphs]}
    ids = greedy_ids_kernels_on_and_off(path, "cuda", **options)
    assert ids["all"] == ids["none"]


@pytest.mark.gpu
def test_the_skinny_kernel_launched_as_a_dependent_gives_the_plain_launches_ids(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """`--skinny-matmul-launch pdl` inside the decode step's CUDA graphs, after RMSNorm and
    attention kernels that release their dependents as they start: every one-row launch of
    the kernel is a dependent one (more rows launch plainly), and the ids are the plain
    launches' (each waits for the kernel before it, then reads its input, so the bits are the
    same). The default, `auto`, is `pdl` on this GPU."""
    if torch.cuda.get_device_capability() < PDL_MIN_CAPABILITY:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    path = tiny_model_factory("llama", rope_scaling="llama3")
    ids = {}
    for mode, pdl in (("plain", 0), ("pdl", 1), ("auto", 1)):
        ids[mode], launches = greedy_ids_under_a_skinny_table(
            path, "cuda", ["all"], skinny_matmul_launch=mode, compile_cache_dir=str(tmp_path)
        )
        assert {pdl for rows, pdl in launches if rows == 1} == {pdl}, (mode, launches)
        assert {pdl for rows, pdl in launches if rows > 1} == {0}, (mode, launches)
    assert ids["pdl"] == ids["plain"] == ids["auto"]


def test_a_dependent_launch_reaches_the_skinny_kernel_from_the_layer() -> None:
    """The launch the runner gives the layers is what each product passes to the kernel at
    one row, plain and gated; at more rows a plain launch (the kernel itself is mocked: a
    dependent launch needs CUDA)."""
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
        layer(torch.randn(1, 32))
        layer.silu_and_mul_of(torch.randn(1, 32), SiluAndMul())
        layer.silu_and_mul_of(torch.randn(2, 32), SiluAndMul())
    assert calls == [0, 1, 1, 0]


def test_a_dependent_launch_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ServerArgsError, match="--skinny-matmul-launch: pdl needs CUDA"):
        ServerArgs(device="cpu", skinny_matmul_launch="pdl").check()
    with pytest.raises(ServerArgsError, match="invalid choice: 'fast'"):
        ServerArgs(skinny_matmul_launch="fast").check()
    with pytest.raises(ServerArgsError, match="compute capability 9.0 or newer, not cpu"):
        skinny_launch("pdl", torch.device("cpu"))
    assert skinny_launch("plain", torch.device("cpu")) == "plain"
    # The default: a dependent launch where the GPU can make one, plain elsewhere.
    assert ServerArgs().skinny_matmul_launch == "auto"
    ServerArgs(device="cpu").check()
    assert skinny_launch("auto", torch.device("cpu")) == "plain"


# ---- the runner ----


def test_runner_reports_and_logs_the_selection(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="srt.model_executor.runner_setup"),
        Engine(model_path=str(tiny_llama), device="cpu", custom_ops=["none", "+rms_norm"]) as eng,
    ):
        runner = eng.get_server_info()["runner"]
        info = runner["custom_ops"]
    assert runner["skinny_matmul_launch"] == "plain"  # auto, resolved on the CPU
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
