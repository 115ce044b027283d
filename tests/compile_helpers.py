"""Shared by the tc_piecewise tests: engines with small ladders, hand-made batches, and the
comparison of a compiled phase runner against the uncompiled forward on the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import fx

from srt import Engine
from srt.batch_layout import ForwardMode
from srt.ipc.messages import BatchPlan
from srt.model_executor.graphs.phase_forward import EagerForward
from srt.model_executor.model_runner import ModelRunner

LADDERS = {"cuda_graph_bs_prefill": [8, 16], "cuda_graph_bs_decode": [1, 2, 4]}
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9], [10, 20, 30]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SLOTS_PER_REQUEST = 64  # request i owns KV slots 1 + 64 i ...
# The passes that put a layer op's kernel in Inductor's graph, and what they match in the tiny
# Llama (2 layers): the fused norm after each attention, before layer 1 and the final one;
# layer 0's input norm (no residual yet); each layer's rotary and MLP.
KERNEL_PASSES = [
    "fused_add_rms_norm_kernel",
    "rms_norm_kernel",
    "rotary_kernel",
    "silu_and_mul_kernel",
]
KERNEL_PASS_MATCHES = {
    "fused_add_rms_norm_kernel": 4,
    "rms_norm_kernel": 1,
    "rotary_kernel": 2,
    "silu_and_mul_kernel": 2,
}


def tc_engine(model: Path, cache: Path, compiler: str, **kwargs: Any) -> Engine:
    """Both phases tc_piecewise with `compiler`, on the CPU (float32 unless told)."""
    options = {"dtype": "float32", **LADDERS, **kwargs}
    return Engine(
        model_path=str(model),
        device="cpu",
        compile_cache_dir=str(cache),
        cuda_graph_backend_prefill="tc_piecewise",
        cuda_graph_backend_decode="tc_piecewise",
        cuda_graph_tc_compiler=compiler,
        **options,
    )


def count_inductor_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per Inductor compile from now on (a warm start makes none)."""
    calls: list[int] = []
    real = torch._inductor.standalone_compile

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "standalone_compile", counted)
    return calls


def no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a Dynamo trace fail the test."""
    from srt.compilation.piecewise_model import PiecewiseModel

    def traced(*args: object) -> None:
        raise AssertionError("traced with Dynamo")

    monkeypatch.setattr(PiecewiseModel, "_trace", traced)


def count_rsqrt(graph: fx.Graph) -> int:
    """A graph pass that counts the rsqrt nodes (one per RMSNorm) and changes nothing."""
    return sum(n.target is torch.ops.aten.rsqrt.default for n in graph.nodes)


def greedy_ids(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def make_plan(mode: ForwardMode, tokens: list[list[int]], prefix_lens: list[int]) -> BatchPlan:
    """Request i (table row i + 1) computes `tokens[i]` at positions prefix_lens[i]...; its
    earlier tokens must be in the KV cache from an earlier batch."""
    ids, pos, slots, rows = [], [], [], []
    for i, (toks, prefix) in enumerate(zip(tokens, prefix_lens, strict=True)):
        for j, token in enumerate(toks):
            ids.append(token)
            pos.append(prefix + j)
            slots.append(1 + i * SLOTS_PER_REQUEST + prefix + j)
            rows.append(i + 1)
    b = len(tokens)

    def i32(values: Any) -> np.ndarray:
        return np.asarray(list(values), dtype=np.int32)

    return BatchPlan.greedy(
        mode,
        input_ids=i32(ids),
        positions=i32(pos),
        out_cache_loc=i32(slots),
        req_pool_indices=i32(range(1, b + 1)),
        prefix_lens=i32(prefix_lens),
        extend_lens=i32(len(t) for t in tokens),
        table=(i32(rows), i32(pos), i32(slots)),
    )


def scenario(vocab: int) -> list[tuple[ForwardMode, list[list[int]], list[int]]]:
    """A prefill of three prompts (15 tokens: bucket 16), decode steps of 3, 2 and 1 requests
    (buckets 4, 2, 1, each hit twice so it is specialised), then a 20-token prefill beyond
    the largest bucket (the general graph, unpadded)."""
    lens = [len(p) for p in PROMPTS]
    steps = [(ForwardMode.EXTEND, PROMPTS, [0, 0, 0])]
    for n in (3, 3, 2, 2, 1, 1):
        steps.append((ForwardMode.DECODE, [[(7 * i + n) % vocab] for i in range(n)], lens[:n]))
        lens = [length + 1 if i < n else length for i, length in enumerate(lens)]
    steps.append((ForwardMode.EXTEND, [list(range(1, 21))], [0]))
    return steps


@torch.inference_mode()
def max_logit_error(runner: ModelRunner) -> float:
    """Run the scenario through `runner`'s phase runners and through the plain forward of the
    same model (each step on the same KV cache); the largest absolute logit difference."""
    eager = EagerForward(runner.model, runner.attn_backend)
    worst = 0.0
    for mode, tokens, prefix in scenario(runner.config.vocab_size):
        plan = make_plan(mode, tokens, prefix)
        got = runner.forward_logits(plan).clone()
        batch = runner.make_forward_batch(plan)
        runner.attn_backend.init_forward_metadata(batch)
        want = eager(batch, None)
        assert got.shape == want.shape == (len(tokens), runner.config.vocab_size)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        worst = max(worst, (got - want).abs().max().item())
    return worst
