"""tc_piecewise with Inductor (C++ on the CPU): parity with the uncompiled model, a warm start
that compiles nothing, and corrupted artifacts detected and recompiled.

The cold engine compiles three distinct pieces (first, middle, last) once for the module; the
other engines reuse its cache entry."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from compile_helpers import greedy_ids, max_logit_error, tc_engine

from srt import Engine


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture(scope="module")
def cold(tiny_llama: Path, cache_root: Path) -> Iterator[Engine]:
    with tc_engine(tiny_llama, cache_root, "inductor") as eng:
        yield eng


def compile_info(eng: Engine) -> dict[str, Any]:
    return eng.get_server_info()["compile"]


def sources(info: dict[str, Any]) -> list[str]:
    return [p["inductor"]["source"] for p in info["pieces"]]


def count_inductor_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = torch._inductor.standalone_compile

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "standalone_compile", counted)
    return calls


def test_inductor_pieces_match_the_uncompiled_model(
    cold: Engine, reference: list[list[int]]
) -> None:
    info = compile_info(cold)
    assert info["compilers"] == ["inductor"] and info["cache_hit"] is False
    assert sources(info) == ["compiled", "compiled", "compiled"]
    assert len(list((Path(info["cache_dir"]) / "pieces").glob("inductor-*.bin"))) == 3
    assert greedy_ids(cold) == reference
    assert max_logit_error(cold.runner) <= 1e-4


def test_a_warm_start_compiles_nothing(
    tiny_llama: Path, cache_root: Path, cold: Engine, reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    calls = count_inductor_compiles(monkeypatch)
    with caplog.at_level(logging.INFO, logger="srt.compilation"):
        with tc_engine(tiny_llama, cache_root, "inductor") as warm:
            info = compile_info(warm)
            assert greedy_ids(warm) == reference
    assert calls == []
    assert info["cache_dir"] == compile_info(cold)["cache_dir"]
    assert info["cache_hit"] is True and sources(info) == ["loaded"] * 3
    assert "loaded from the cache" in caplog.text and "compile cache" in caplog.text
    assert "torch.compile took" in caplog.text


def test_corrupted_artifacts_are_detected_and_recompiled(
    tiny_llama: Path, cache_root: Path, cold: Engine, reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    pieces = Path(compile_info(cold)["cache_dir"]) / "pieces"
    truncated, garbled = sorted(pieces.glob("inductor-*.bin"))[:2]
    truncated.write_bytes(truncated.read_bytes()[:1000])  # checksum mismatch
    garbled.write_bytes(b"not an artifact")  # checksum updated to match: fails to load
    meta = garbled.with_suffix(".json")
    digest = hashlib.sha256(b"not an artifact").hexdigest()
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "bytes": 15, "sha256": digest}))
    calls = count_inductor_compiles(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="srt.compilation.cache"):
        with tc_engine(tiny_llama, cache_root, "inductor") as again:
            info = compile_info(again)
            assert greedy_ids(again) == reference
            assert max_logit_error(again.runner) <= 1e-4
    assert len(calls) == 2 and info["cache_hit"] is False
    assert sorted(sources(info)) == ["compiled", "compiled", "loaded"]
    warnings = [r.getMessage() for r in caplog.records if "corrupted or mismatched" in r.message]
    assert len(warnings) == 2 and "checksum mismatch" in " ".join(warnings)
    assert truncated.stat().st_size > 1000  # rewritten by the recompilation


@pytest.mark.gpu
def test_cuda_pieces_with_graphs_match_eager_and_warm_start(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def engine(**kwargs: Any) -> Engine:
        return Engine(model_path=str(tiny_llama), device="cuda", dtype="float32",
                      max_total_tokens=4096,
                      cuda_graph_bs_prefill=[8, 16], cuda_graph_bs_decode=[1, 2, 4], **kwargs)

    with engine(disable_cuda_graph=True) as eager:
        expected = greedy_ids(eager)
    tc = {"cuda_graph_backend_prefill": "tc_piecewise", "cuda_graph_backend_decode":
          "tc_piecewise", "cuda_graph_tc_compiler": "inductor",
          "compile_cache_dir": str(tmp_path)}
    with engine(**tc) as cold:
        assert greedy_ids(cold) == expected
        assert greedy_ids(cold) == expected  # replays the captured pieces
        assert compile_info(cold)["cache_hit"] is False
        decode = cold.get_server_info()["graphs"]["decode"]["buckets"]
        assert any(b["state"] == "replayed" for b in decode)
    calls = count_inductor_compiles(monkeypatch)
    with engine(**tc) as warm:
        assert greedy_ids(warm) == expected
        assert compile_info(warm)["cache_hit"] is True
    assert calls == []
