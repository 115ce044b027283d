"""The partition mode (`--inductor-graph-partition`): the whole traced graph compiled by Inductor
once, cut at the split ops into partitions that the capture kinds serve as they serve pieces.

Inductor cuts CUDA-graph partitions only around GPU kernels, so on the CPU a compiled graph
has none (tests/test_compilation_inductor.py checks that it runs so). These tests stand the
CPU in for the GPU (`partitions_on_the_cpu`, in tests/conftest.py: Inductor's scheduler is
told every kernel is a GPU kernel), so that the partitions are made, routed through the
bucket dispatcher, saved and reloaded as on CUDA; the CUDA graphs themselves are the GPU
tests' (tests/test_graph_backends_gpu.py)."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compile_helpers import (
    count_inductor_compiles,
    greedy_ids,
    max_logit_error,
    no_trace,
    tc_engine,
)

from srt import Engine
from srt.compilation.dispatch import PieceFn
from srt.model_config import ModelConfig
from srt.model_executor.graphs.config import GraphConfigError
from srt.model_executor.graphs.piecewise import PieceGraphs

PARTITION = {"inductor_graph_partition": True}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("partition-cache")


@pytest.fixture(scope="module")
def cold(tiny_llama: Path, cache_root: Path, partitions_on_the_cpu: None) -> Iterator[Engine]:
    with tc_engine(tiny_llama, cache_root, "inductor", **PARTITION) as eng:
        yield eng


def compile_info(eng: Engine) -> dict[str, Any]:
    return eng.get_server_info()["compile"]


def test_one_compile_cut_into_a_partition_per_piece(
    cold: Engine, tiny_llama: Path, reference: list[list[int]]
) -> None:
    info = compile_info(cold)
    layers = ModelConfig.from_path(tiny_llama).num_layers
    assert info["mode"] == "partition" and info["compilers"] == ["inductor"]
    # One compile, L attention splits: L + 1 partitions, as the FX split has pieces.
    assert info["num_pieces"] == layers + 1 and info["cache_hit"] is False
    [whole] = info["pieces"]
    assert whole["partitions"] == layers + 1 and whole["inductor"]["source"] == "compiled"
    pieces = Path(info["cache_dir"]) / "pieces"
    assert len(list(pieces.glob("inductor-partition-*.bin"))) == 1
    assert (pieces / "graph-inductor-partition-t8192.bin").is_file()  # the trace, saved
    graph = (Path(info["cache_dir"]) / "computation_graph.py").read_text()
    assert f"{layers + 1} partitions" in graph and "srt.attention" in graph
    assert greedy_ids(cold) == reference
    assert max_logit_error(cold.runner) <= 1e-4


def test_a_warm_start_compiles_nothing(
    tiny_llama: Path,
    cache_root: Path,
    cold: Engine,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_inductor_compiles(monkeypatch)
    no_trace(monkeypatch)
    with tc_engine(tiny_llama, cache_root, "inductor", **PARTITION) as warm:
        info = compile_info(warm)
        assert greedy_ids(warm) == reference
        assert max_logit_error(warm.runner) <= 1e-4
    assert calls == []
    assert (info["graph_source"], info["cache_hit"]) == ("loaded", True)
    assert info["num_pieces"] == compile_info(cold)["num_pieces"]
    assert info["cache_dir"] == compile_info(cold)["cache_dir"]


def test_a_damaged_artifact_is_recompiled(
    tiny_llama: Path,
    cold: Engine,
    reference: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "root"
    shutil.copytree(Path(compile_info(cold)["cache_dir"]).parent, root)
    [artifact] = root.glob("*/pieces/inductor-partition-*.bin")
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    calls = count_inductor_compiles(monkeypatch)
    with caplog.at_level(logging.INFO, logger="srt.compilation"):
        with tc_engine(tiny_llama, root, "inductor", **PARTITION) as again:
            info = compile_info(again)
            assert greedy_ids(again) == reference
    assert len(calls) == 1 and info["cache_hit"] is False
    # The saved trace is sound but its compiled graph is not: traced again, whole.
    assert info["graph_source"] == "traced"
    assert re.search(r"no usable inductor-partition-\w+-t8192; tracing again", caplog.text)
    assert "checksum mismatch" in caplog.text
    assert artifact.read_bytes() != bytes(data)  # written again


def test_the_capture_kinds_get_every_partition_per_bucket(
    tiny_llama: Path,
    cache_root: Path,
    cold: Engine,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tc_piecewise's specializer is handed each partition of a bucket on its second hit, as it
    is each FX piece (it captures it on CUDA; here it keeps the partition), and later hits run
    what it returned."""
    from graph_emulation import EmulatedCapturer

    import srt.model_executor.graphs.pool as graph_memory

    monkeypatch.setattr(graph_memory, "default_capturer", lambda device: EmulatedCapturer())
    handed: list[tuple[int, int]] = []

    def keep(
        self: PieceGraphs, piece: int, bucket: int, general: PieceFn, args: tuple[Any, ...]
    ) -> PieceFn:
        handed.append((piece, bucket))
        return general

    monkeypatch.setattr(PieceGraphs, "__call__", keep)
    with tc_engine(tiny_llama, cache_root, "inductor", **PARTITION) as eng:
        assert greedy_ids(eng) == reference
        partitions = compile_info(eng)["num_pieces"]
        decode = eng.get_server_info()["graphs"]["decode"]
    captured = decode["captured"]
    assert captured, decode
    for bucket in captured:
        assert sorted(p for p, b in handed if b == bucket) == list(range(partitions))


def test_the_partition_mode_needs_inductor(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(GraphConfigError, match="--inductor-graph-partition compiles the whole"):
        with tc_engine(tiny_llama, tmp_path, "eager", **PARTITION):
            pass


def test_the_partition_flag_without_a_compiled_phase_is_ignored(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        with Engine(model_path=str(tiny_llama), device="cpu", dtype="float32", **PARTITION) as e:
            assert e.get_server_info()["compile"]["mode"] is None
    assert "--inductor-graph-partition is ignored" in caplog.text
