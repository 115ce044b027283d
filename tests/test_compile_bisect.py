"""`srt.tools.compile_bisect` finds a deliberately wrong piece, and the op in it (CPU)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo.backends.debugging as debugging
from compile_helpers import count_rsqrt
from torch import fx

from srt.compilation.cache import CompileCache
from srt.compilation.cache_key import collect_factors
from srt.compilation.graph_passes import register_graph_pass
from srt.compilation.piecewise_model import PiecewiseModel
from srt.model_config import ModelConfig
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from srt.tools import compile_bisect
from srt.tools.compile_bisect import bisect


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> ModelRunner:
    args = ServerArgs(
        model_path=str(tiny_llama),
        device="cpu",
        dtype="float32",
        disable_cuda_graph=True,
        max_total_tokens=64,
    )
    return ModelRunner(args, ModelConfig.from_path(tiny_llama, "float32"))


@pytest.fixture
def cache(tmp_path: Path, runner: ModelRunner) -> CompileCache:
    return CompileCache(
        tmp_path, collect_factors({"test": "bisect"}, runner.device, Path(__file__))
    )


@pytest.fixture
def rsqrt_miscompiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`aot_eager` that computes sqrt where the graph says rsqrt: a compiler bug in one op."""
    real = debugging.aot_eager

    def wrong(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        for node in gm.graph.nodes:
            if node.target is torch.rsqrt:
                node.target = torch.sqrt
        gm.recompile()
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(debugging, "aot_eager", wrong)
    yield


def test_everything_agrees_on_a_correct_compiler(runner: ModelRunner, cache: CompileCache) -> None:
    for phase in ("prefill", "decode"):
        report = bisect(runner, ["aot_eager"], cache, phase=phase)
        assert not report.differs, compile_bisect.format_report(report)
        assert report.num_pieces == 3  # two layers: L + 1 pieces
        assert report.num_tokens == (16 if phase == "prefill" else 2)
        assert [c.first_piece for c in report.compilers] == [None]


def test_finds_the_piece_and_the_op_a_compiler_gets_wrong(
    runner: ModelRunner, cache: CompileCache, rsqrt_miscompiled: None
) -> None:
    report = bisect(runner, ["aot_eager"], cache)
    (result,) = report.compilers
    assert report.differs and not report.traced.differs
    assert result.forward.differs
    # The first RMSNorm is in piece 0 (embedding and layer 0 up to its attention).
    assert result.first_piece == 0
    assert result.first_op is not None and "rsqrt" in result.first_op.target
    assert "rsqrt" in result.first_op.source  # the model's line
    text = compile_bisect.format_report(report)
    assert "first differing piece: 0" in text and "result: something differs" in text


def test_a_wrong_piece_alone_is_found(runner: ModelRunner, cache: CompileCache) -> None:
    """A piece that is wrong only as served (its op-by-op recompile is right): the piece is
    named, and no op is blamed."""

    def break_piece(model: PiecewiseModel) -> None:
        pieces = model.general("aot_eager")
        right = pieces[1]
        pieces[1] = lambda *args: tuple(t + 1 for t in right(*args))

    report = bisect(runner, ["aot_eager"], cache, piece_hook=break_piece)
    (result,) = report.compilers
    assert result.first_piece == 1
    assert not result.pieces[0].differs and result.pieces[1].differs
    assert result.first_op is None


def sqrt_for_rsqrt(graph: fx.Graph) -> int:
    """A wrong graph pass: sqrt where the graph says rsqrt."""
    nodes = [n for n in graph.nodes if n.target is torch.ops.aten.rsqrt.default]
    for node in nodes:
        node.target = torch.ops.aten.sqrt.default
    return len(nodes)


def test_names_the_graph_pass_that_changes_a_result(
    runner: ModelRunner, cache: CompileCache, graph_pass_registry: None
) -> None:
    register_graph_pass("count_rsqrt")(count_rsqrt)
    register_graph_pass("sqrt_for_rsqrt")(sqrt_for_rsqrt)
    passes = ["count_rsqrt", "sqrt_for_rsqrt"]
    report = bisect(runner, ["inductor"], cache, phase="decode", partition=True, passes=passes)
    (inductor,) = report.compilers
    assert report.differs and report.passes == passes
    # The op search compiles with the passes too: it finds the op the wrong pass rewrote.
    assert inductor.first_piece == 0
    assert inductor.first_op is not None and "rsqrt" in inductor.first_op.target
    assert report.partition is not None and report.partition.differs
    for mode in ("piecewise", "partition"):
        effects = [(e.passes, e.forward.differs) for e in report.pass_effects if e.mode == mode]
        assert effects == [([], False), (["count_rsqrt"], False), (["sqrt_for_rsqrt"], True)]
        assert report.changed_by(mode) == ["sqrt_for_rsqrt"]
    text = compile_bisect.format_report(report)
    assert "inductor, partition mode: whole forward" in text
    assert "changed by: sqrt_for_rsqrt" in text


def test_command_line(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--model-path", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    argv += ["--compilers", "aot_eager", "--result-file", str(out)]
    assert compile_bisect.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["compilers"][0]["compiler"] == "aot_eager"
    assert report["compilers"][0]["first_piece"] is None
    for bad in (
        ["--batch-size", "0"],
        ["--compilers", "aot_eager", "--partition"],
        ["--compile-passes", "no_such_pass"],
    ):
        with pytest.raises(SystemExit):
            compile_bisect.main([*argv[:6], *bad])
