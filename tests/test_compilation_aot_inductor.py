"""tc_piecewise with `aot_inductor` (each piece an AOTInductor package; C++ on the CPU) and the
split graph bound without Dynamo: parity with the uncompiled model, a warm start that imports
neither Dynamo nor Inductor and compiles nothing, and nothing loaded that the cache did not
write for it: a damaged package and a foreign capture are detected, compiled and traced again.

The cold engine compiles three distinct pieces (first, middle, last) once for the module; the
other engines reuse its cache entry."""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from compile_helpers import greedy_ids, max_logit_error, tc_engine
from test_compilation_inductor import (
    CHILD_PROLOGUE,
    compile_info,
    copy_of_the_cache,
    run_in_a_child,
)
from torch import fx, nn

from srt import Engine
from srt.compilation.backend import GraphInput
from srt.compilation.bound_forward import UnboundInput, bind_inputs, dynamo_input_name
from srt.compilation.cache import pack_artifact, unpack_artifact
from srt.compilation.errors import CompilationError
from srt.compilation.piece_compiler import tensor_inputs_only


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aot-inductor-cache")


@pytest.fixture(scope="module")
def cold(tiny_llama: Path, cache_root: Path) -> Iterator[Engine]:
    with tc_engine(tiny_llama, cache_root, "aot_inductor") as eng:
        yield eng


def sources(info: dict[str, Any]) -> list[str]:
    return [p["aot_inductor"]["source"] for p in info["pieces"]]


def test_packages_match_the_uncompiled_model(cold: Engine, reference: list[list[int]]) -> None:
    info = compile_info(cold)
    assert info["compilers"] == ["aot_inductor"] and info["cache_hit"] is False
    assert sources(info) == ["compiled", "compiled", "compiled"]
    assert (info["graph_source"], info["bound"]) == ("traced", True)
    pieces = Path(info["cache_dir"]) / "pieces"
    assert len(list(pieces.glob("aot_inductor-*.bin"))) == 3
    # The capture saved without Dynamo, and Dynamo's not at all.
    assert [p.name for p in pieces.glob("*graph-*")] == ["bound-graph-aot_inductor-t8192.bin"]
    assert greedy_ids(cold) == reference
    assert max_logit_error(cold.runner) <= 1e-4


# A warm start in a child process, which reports what it imported.
WARM_START = (
    CHILD_PROLOGUE
    + """
with tc_engine(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]) as eng:
    info = eng.get_server_info()["compile"]
    ids = greedy_ids(eng)
print(json.dumps({
    "ids": ids,
    "info": {k: info[k] for k in ("graph_source", "traces", "bound", "cache_hit", "pieces")},
    "imported": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules],
    "warnings": records,
}))
"""
)


def warm_start(model: Path, root: Path, compiler: str) -> dict[str, Any]:
    return run_in_a_child([sys.executable, "-c", WARM_START, str(model), str(root), compiler])


def test_a_warm_start_imports_neither_dynamo_nor_inductor(
    tiny_llama: Path, cache_root: Path, cold: Engine, reference: list[list[int]]
) -> None:
    warm = warm_start(tiny_llama, cache_root, "aot_inductor")
    assert warm["ids"] == reference
    assert warm["imported"] == [] and warm["warnings"] == []
    info = warm["info"]
    assert (info["graph_source"], info["traces"], info["bound"]) == ("loaded", 0, True)
    assert info["cache_hit"] is True and sources(info) == ["loaded"] * 3


def test_eager_pieces_warm_start_without_dynamo(
    tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    with tc_engine(tiny_llama, tmp_path, "eager") as eng:
        assert compile_info(eng)["bound"] is True
        assert greedy_ids(eng) == reference
    warm = warm_start(tiny_llama, tmp_path, "eager")
    assert warm["ids"] == reference and warm["imported"] == []
    assert (warm["info"]["graph_source"], warm["info"]["bound"]) == ("loaded", True)


def test_the_bound_graph_runs_every_layer_under_first_layer_only(
    tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """The compile-ahead block's forwards (`first_layer_only`, before the warm-up on CUDA) call
    the split graph first: it is bound to the model's weights where it is traced, so it still
    runs every layer, and no name of a cut layer is looked up (r38: 'ModuleList' object has no
    attribute '1', and the block fell back to compiling at launches)."""
    with tc_engine(tiny_llama, tmp_path, "eager", skip_warmup=True) as eng:
        assert compile_info(eng)["bound"] is True
        with eng.runner.model.first_layer_only():
            assert greedy_ids(eng) == reference


def test_a_damaged_package_and_a_foreign_capture_are_rebuilt(
    tiny_llama: Path,
    cold: Engine,
    reference: list[list[int]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = copy_of_the_cache(cold, tmp_path)
    package = sorted(root.glob("*/pieces/aot_inductor-*.bin"))[1]
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    package.write_bytes(bytes(data))
    [capture] = root.glob("*/pieces/bound-*.bin")
    # A capture whose header is consistent but names another artifact: written for another
    # name, it is not this entry's capture.
    header, payload = unpack_artifact(capture.read_bytes())
    header.update(name="bound-graph-eager-t8192", sha256=hashlib.sha256(payload).hexdigest())
    capture.write_bytes(pack_artifact(header, payload))
    with caplog.at_level(logging.WARNING, logger="srt.compilation.cache"):
        with tc_engine(tiny_llama, root, "aot_inductor") as again:
            info = compile_info(again)
            assert greedy_ids(again) == reference
    assert (info["graph_source"], info["bound"]) == ("traced", True)
    assert sorted(sources(info)) == ["compiled", "loaded", "loaded"]
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert "checksum mismatch" in reasons and "written for name" in reasons
    assert unpack_artifact(capture.read_bytes())[0]["name"] == capture.stem  # rewritten


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_inputs_bind_by_dynamo_names_and_the_rest_is_refused() -> None:
    model = Tiny()
    weight = dynamo_input_name("L['self']._modules['proj']._parameters['weight']")
    assert weight == "L_self_modules_proj_parameters_weight_"
    x = dynamo_input_name("L['x']")
    example = torch.empty(4, 4)
    slots = bind_inputs(model, [GraphInput(x, example, True), GraphInput(weight, example, True)])
    assert [(s.kind, s.name, s.index) for s in slots] == [
        ("arg", "", 0),
        ("weight", "proj.weight", 0),
    ]
    with pytest.raises(UnboundInput, match="neither an argument nor a weight"):
        bind_inputs(model, [GraphInput("G_table_", example, True)])
    with pytest.raises(UnboundInput, match="not what was traced"):
        bind_inputs(model, [GraphInput(weight, torch.empty(4, 5), True)])


def test_a_piece_whose_integer_is_no_tensor_size_is_refused() -> None:
    graph = fx.Graph()
    x, n = graph.placeholder("x"), graph.placeholder("n")
    graph.output(graph.call_function(torch.add, (x, n)))
    gm = fx.GraphModule(nn.Module(), graph)
    with pytest.raises(CompilationError, match="no tensor input's size gives"):
        tensor_inputs_only(gm, [torch.ones(3), 2])


def test_a_loader_that_kills_its_process_is_a_clear_error(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first package is loaded in a child first: a loader that crashes (as AOTInductor's
    did under one torch and CUDA driver) fails the start with a clear error, and this process
    lives on."""
    from srt.compilation import piece_compiler

    crash = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    monkeypatch.setattr(piece_compiler, "LOAD_CHECK", crash)
    monkeypatch.setattr(piece_compiler, "_loader_checked", set())
    with pytest.raises(Exception, match="killed by SIGSEGV.*--cuda-graph-tc-compiler inductor"):
        tc_engine(tiny_llama, tmp_path, "aot_inductor")
    assert not list(tmp_path.glob("*/pieces/aot_inductor-*.bin"))  # nothing saved
