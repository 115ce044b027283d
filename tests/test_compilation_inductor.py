"""tc_piecewise with Inductor (C++ on the CPU): parity with the uncompiled model, a warm start
that compiles nothing, and nothing loaded that the cache did not write for the piece: damaged
or swapped artifacts and damaged Inductor builds are detected and recompiled; every file the
cache writes is private.

The cold engine compiles three distinct pieces (first, middle, last) once for the module; the
other engines reuse its cache entry."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from compile_helpers import (
    KERNEL_PASS_MATCHES,
    KERNEL_PASSES,
    count_inductor_compiles,
    greedy_ids,
    max_logit_error,
    no_trace,
    tc_engine,
)

from srt import Engine
from srt.compilation.cache import pack_artifact, unpack_artifact
from srt.compilation.cache_root import TOOL_CACHE_DIRS


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


def test_inductor_pieces_match_the_uncompiled_model(
    cold: Engine, reference: list[list[int]]
) -> None:
    info = compile_info(cold)
    assert info["compilers"] == ["inductor"] and info["cache_hit"] is False
    assert sources(info) == ["compiled", "compiled", "compiled"]
    entry = Path(info["cache_dir"])
    assert len(list((entry / "pieces").glob("inductor-*.bin"))) == 3
    assert (entry / "pieces" / "graph-inductor-t8192.bin").is_file()  # the trace, saved
    # Inductor's precompiled header under the root, not in $TMPDIR. Inductor builds it once
    # per process (earlier tests in this one may have, under their own root), so what is
    # checked is where it is pointed.
    headers = entry.parent / "inductor" / "precompiled_headers"
    assert Path(torch._inductor.codecache._HEADER_DIR) == headers
    assert greedy_ids(cold) == reference
    assert max_logit_error(cold.runner) <= 1e-4


def test_a_warm_start_compiles_nothing(
    tiny_llama: Path,
    cache_root: Path,
    cold: Engine,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = count_inductor_compiles(monkeypatch)
    no_trace(monkeypatch)
    with caplog.at_level(logging.INFO, logger="srt.compilation"):
        with tc_engine(tiny_llama, cache_root, "inductor") as warm:
            info = compile_info(warm)
            assert greedy_ids(warm) == reference
            assert max_logit_error(warm.runner) <= 1e-4
    assert calls == []
    assert (info["graph_source"], info["traces"], info["dynamo_s"]) == ("loaded", 0, 0.0)
    assert info["cache_dir"] == compile_info(cold)["cache_dir"]
    assert info["cache_hit"] is True and sources(info) == ["loaded"] * 3
    assert "loaded from the cache" in caplog.text and "compile cache" in caplog.text
    assert "torch.compile took" in caplog.text
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def copy_of_the_cache(cold: Engine, tmp_path: Path) -> Path:
    """A copy of the cold engine's cache root (same entry key) for a test to damage."""
    root = tmp_path / "root"
    shutil.copytree(Path(compile_info(cold)["cache_dir"]).parent, root)
    return root


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_corrupted_artifacts_are_detected_and_recompiled(
    tiny_llama: Path,
    cold: Engine,
    reference: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = copy_of_the_cache(cold, tmp_path)
    truncated, flipped, garbled = sorted(root.glob("*/pieces/inductor-*.bin"))
    truncated.write_bytes(truncated.read_bytes()[:-1000])  # the size check
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    flipped.write_bytes(bytes(data))
    header, _ = unpack_artifact(garbled.read_bytes())  # a consistent header: fails to load
    payload = b"not an artifact"
    header.update(bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    garbled.write_bytes(pack_artifact(header, payload))
    calls = count_inductor_compiles(monkeypatch)
    with caplog.at_level(logging.INFO, logger="srt.compilation"):
        with tc_engine(tiny_llama, root, "inductor") as again:
            info = compile_info(again)
            assert greedy_ids(again) == reference
            assert max_logit_error(again.runner) <= 1e-4
    assert len(calls) == 3 and info["cache_hit"] is False
    # The saved trace is sound, but its pieces are not: traced again, not routed half-loaded.
    assert info["graph_source"] == "traced"
    assert re.search(r"no usable artifact inductor-\w+-t8192; tracing again", caplog.text)
    assert sources(info) == ["compiled", "compiled", "compiled"]
    reasons = {Path(m.split()[3]).name: m for m in warnings_about(caplog, "corrupted or mism")}
    assert set(reasons) == {truncated.name, flipped.name, garbled.name}
    assert "size mismatch" in reasons[truncated.name]
    assert "checksum mismatch" in reasons[flipped.name]
    assert "mismatch" not in reasons[garbled.name].split("(", 1)[1]  # the load itself failed
    assert unpack_artifact(truncated.read_bytes())[0]["bytes"] > 1000  # rewritten


def test_artifacts_swapped_between_pieces_are_rejected(
    tiny_llama: Path,
    cold: Engine,
    reference: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = copy_of_the_cache(cold, tmp_path)
    first, second, _ = sorted(root.glob("*/pieces/inductor-*.bin"))
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)  # each a valid artifact, checksums and all, of the other piece
    second.write_bytes(a)
    calls = count_inductor_compiles(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="srt.compilation.cache"):
        with tc_engine(tiny_llama, root, "inductor") as again:
            assert greedy_ids(again) == reference
            assert sorted(sources(compile_info(again))) == ["compiled", "compiled", "loaded"]
    assert len(calls) == 2
    rejected = warnings_about(caplog, "written for name")
    assert len(rejected) == 2


# What a child start script begins with: the test helpers, and srt.compilation's warnings
# collected in `records`.
CHILD_PROLOGUE = """
import json, logging, sys
from pathlib import Path
sys.path.insert(0, "tests")
from compile_helpers import greedy_ids, tc_engine
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(r.getMessage())
logging.getLogger("srt.compilation").addHandler(handler)
logging.getLogger("srt.compilation").setLevel(logging.WARNING)
"""

# A warm start in a child process: a damaged .so can kill the process that dlopens it
# (SIGBUS), which must not take the test session with it.
WARM_START = (
    CHILD_PROLOGUE
    + """
with tc_engine(Path(sys.argv[1]), Path(sys.argv[2]), "inductor") as eng:
    info = eng.get_server_info()["compile"]
    print(json.dumps({"ids": greedy_ids(eng), "hit": info["cache_hit"], "warnings": records}))
"""
)


def child_env() -> dict[str, str]:
    """This process's environment as a fresh start has it: without the tool cache locations
    srt set here (a child would take them as set at launch, and use another root's)."""
    return {k: v for k, v in os.environ.items() if k not in TOOL_CACHE_DIRS}


def run_in_a_child(argv: list[str]) -> dict[str, Any]:
    """Run a child start (`argv`, from the repository, as a fresh start's environment has
    it); the JSON its last line printed."""
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_start_in_a_child(model: Path, root: Path) -> dict[str, Any]:
    return run_in_a_child([sys.executable, "-c", WARM_START, str(model), str(root)])


def test_damaged_inductor_output_and_headers_are_rebuilt_not_loaded(
    tiny_llama: Path,
    cold: Engine,
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    root = copy_of_the_cache(cold, tmp_path)
    inductor = next(root.glob("*/inductor"))
    kernels = sorted(inductor.glob("*/*.so"))
    assert len(kernels) > 1

    def damage() -> None:  # truncated C++ builds: dlopen of one is a crash, not an exception
        for so in kernels:
            so.write_bytes(so.read_bytes()[:4096])

    damage()
    stray = inductor / "zz" / "czzz.main.so"  # a build this cache never recorded
    stray.parent.mkdir()
    stray.write_bytes(kernels[0].read_bytes())
    outside = tmp_path / "outside.so"  # a kernel replaced by a link to a damaged file
    outside.write_bytes(kernels[1].read_bytes())
    kernels[1].unlink()
    kernels[1].symlink_to(outside)
    damaged = warm_start_in_a_child(tiny_llama, root)
    assert damaged["ids"] == reference
    [removed] = [w for w in damaged["warnings"] if "did not write, that changed" in w]
    assert f"removed {len(kernels) + 1} file(s)" in removed and "are links" in removed
    assert not kernels[1].is_symlink()
    # Rebuilding the kernels needed the shared precompiled header: now it is there. Cut it
    # short (a full disk, a copy): Inductor would trust it and fail every C++ compile.
    [header] = root.glob("inductor/precompiled_headers/*.gch")
    header.write_bytes(header.read_bytes()[:4096])
    damage()
    again = warm_start_in_a_child(tiny_llama, root)
    assert again["ids"] == reference and again["hit"] is True
    assert any("removed 1 precompiled header file(s)" in w for w in again["warnings"])
    assert header.stat().st_size > 4096


def test_a_restart_with_another_context_length_recompiles(
    tiny_llama: Path,
    cold: Engine,
    reference: list[list[int]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Past max_position_embeddings (2048): larger rotary tables, which the pieces close over.
    # In a root whose path has spaces, which Inductor's build commands cannot take.
    root = tmp_path / "a root with spaces"
    shutil.copytree(Path(compile_info(cold)["cache_dir"]).parent, root)
    with caplog.at_level(logging.WARNING, logger="srt.compilation"):
        with tc_engine(tiny_llama, root, "inductor", context_length=4096) as longer:
            info = compile_info(longer)
            assert greedy_ids(longer) == reference
    assert info["cache_hit"] is False and sources(info) == ["compiled"] * 3
    entry = Path(info["cache_dir"])
    assert entry.parent == root and entry.name != Path(compile_info(cold)["cache_dir"]).name
    assert "Inductor builds in" in caplog.text
    factors = json.loads((entry / "factors.json").read_text())
    assert factors["config"]["model"]["context_length"] == 4096


def test_the_cpu_graph_runs_whole(
    tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """The partition mode on the CPU: Inductor cuts partitions around GPU kernels only, so
    there is nothing to cut; one compiled function, split ops inline (the partitions are
    tests/test_compilation_partition.py's)."""
    with tc_engine(tiny_llama, tmp_path, "inductor", inductor_graph_partition=True) as eng:
        info = compile_info(eng)
        assert greedy_ids(eng) == reference
    assert (info["mode"], info["num_pieces"]) == ("partition", 0)


def test_a_warm_start_without_a_cpp_compiler_says_why(
    tiny_llama: Path, cold: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.cpp_builder import cpp_compiler_search

    from srt.compilation.errors import CompilerMissingError

    root = copy_of_the_cache(cold, tmp_path)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CXX", raising=False)
    cpp_compiler_search.cache_clear()  # Inductor remembers the compiler it found
    try:
        with pytest.raises(CompilerMissingError, match=r"needs a C\+\+ compiler at every start"):
            tc_engine(tiny_llama, root, "inductor")
    finally:
        cpp_compiler_search.cache_clear()


READ_ONLY_STARTS = (
    CHILD_PROLOGUE
    + """
from srt import Engine
from srt.compilation.cache import CompileCache
from srt.compilation.cache_key import CacheFactors
model, root = Path(sys.argv[1]), Path(sys.argv[2])
options = {"model_path": str(model), "device": "cpu", "dtype": "float32"}
with Engine(compile_cache_dir=str(root), **options) as eng:
    plain = greedy_ids(eng)  # compiles nothing
with tc_engine(model, root, "inductor") as eng:
    info = eng.get_server_info()["compile"]
    warm = {"ids": greedy_ids(eng), "hit": info["cache_hit"], "dir": info["cache_dir"]}
other = CompileCache(root, CacheFactors({}, {"another": "config"}, "code", {}))
print(json.dumps({"plain": plain, "warm": warm, "other": str(other.dir), "warnings": records}))
"""
)


def test_a_read_only_root_is_used_as_it_is(
    tiny_llama: Path, cold: Engine, reference: list[list[int]], tmp_path: Path
) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root, to mount the cache read-only for a child")
    source = copy_of_the_cache(cold, tmp_path)
    mounted = tmp_path / "read-only"
    mounted.mkdir()
    script = (
        f"mount --bind {source} {mounted} && mount -o remount,bind,ro {mounted} && "
        f'exec "$0" -c "$1" {tiny_llama} {mounted}'
    )
    result = run_in_a_child(["unshare", "-m", "sh", "-c", script, sys.executable, READ_ONLY_STARTS])
    assert result["plain"] == reference
    assert result["warm"]["ids"] == reference and result["warm"]["hit"] is True
    assert Path(result["warm"]["dir"]).parent == mounted  # its entry, used where it is
    assert not Path(result["other"]).is_relative_to(mounted)  # no entry: a temporary cache
    warnings = result["warnings"]
    assert any(f"compile cache root {mounted} is read-only" in w for w in warnings)
    assert any("has no entry for this configuration" in w for w in warnings)
    assert [w for w in warnings if "file(s)" in w] == []  # the copied builds are all vouched for


def test_every_file_and_directory_the_cache_writes_is_private(
    tiny_llama: Path, cache_root: Path, cold: Engine
) -> None:
    with tc_engine(tiny_llama, cache_root, "inductor"):  # a warm start rewrites some
        pass
    paths = [cache_root, *cache_root.rglob("*")]
    assert any(p.suffix == ".so" for p in paths) and any(p.name == "locks" for p in paths)
    loose = [
        f"{stat.S_IMODE(p.lstat().st_mode):o} {p}"
        for p in paths
        if stat.S_IMODE(p.lstat().st_mode) != (0o700 if p.is_dir() else 0o600)
    ]
    assert loose == []


def cuda_engine(model: Path, dtype: str, **kwargs: Any) -> Engine:
    """The tiny model on CUDA with small ladders (the GPU tests' engines)."""
    return Engine(
        model_path=str(model),
        device="cuda",
        dtype=dtype,
        max_total_tokens=4096,
        cuda_graph_bs_prefill=[8, 16],
        cuda_graph_bs_decode=[1, 2, 4],
        **kwargs,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("capture", "partition"),
    [("tc_piecewise", False), ("tc_piecewise", True), ("full", True)],
    ids=["pieces", "partitions", "full-partition"],
)
def test_cuda_pieces_with_graphs_match_eager_and_warm_start(
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capture: str,
    partition: bool,
) -> None:
    """Both phases captured over the Inductor-compiled graph: per piece (the FX pieces or, in
    the partition mode, Inductor's partitions) or whole; eager's ids, cold and warm."""

    def engine(**kwargs: Any) -> Engine:
        return cuda_engine(tiny_llama, "float32", **kwargs)

    with engine(disable_cuda_graph=True) as eager:
        expected = greedy_ids(eager)
    tc = {
        "cuda_graph_backend_prefill": capture,
        "cuda_graph_backend_decode": capture,
        "cuda_graph_tc_compiler": "inductor",
        "inductor_graph_partition": partition,
        "compile_cache_dir": str(tmp_path),
    }
    with engine(**tc) as cold:
        assert greedy_ids(cold) == expected
        assert greedy_ids(cold) == expected  # replays the captured pieces
        info = compile_info(cold)
        assert info["cache_hit"] is False
        assert info["mode"] == ("partition" if partition else "piecewise")
        assert info["num_pieces"] == 3  # two layers: three pieces, or three partitions
        graphs = cold.get_server_info()["graphs"]["decode"]
        assert any(b["state"] == "captured" and b["replays"] > 1 for b in graphs["buckets"])
        if capture == "tc_piecewise":  # every piece of every captured bucket
            captured = graphs["capture"]["pieces_captured"]
            assert captured == 3 * len(graphs["captured"]), graphs
    calls = count_inductor_compiles(monkeypatch)
    with engine(**tc) as warm:
        assert greedy_ids(warm) == expected
        assert compile_info(warm)["cache_hit"] is True
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("partition", [False, True], ids=["pieces", "partitions"])
def test_cuda_kernel_passes_give_eager_ids_in_bfloat16(
    tiny_llama: Path, tmp_path: Path, partition: bool
) -> None:
    """The kernel passes on, both phases captured per piece (FX pieces or Inductor's
    partitions) in bfloat16: eager's ids (eager runs the same kernels: `--custom-ops` left at
    its default) and every place of the tiny Llama matched. The sums of the fused norms take
    both forms on CUDA: folded into the product (addmm) where the sum leaves the piece, a
    plain add where every user is pointwise (the final norm, the whole graph's)."""

    def engine(**kwargs: Any) -> Engine:
        return cuda_engine(tiny_llama, "bfloat16", **kwargs)

    with engine(disable_cuda_graph=True) as eager:
        expected = greedy_ids(eager)
    with engine(
        cuda_graph_backend_prefill="tc_piecewise",
        cuda_graph_backend_decode="tc_piecewise",
        cuda_graph_tc_compiler="inductor",
        inductor_graph_partition=partition,
        compile_passes=KERNEL_PASSES,
        compile_cache_dir=str(tmp_path),
    ) as eng:
        assert greedy_ids(eng) == expected
        assert greedy_ids(eng) == expected  # replays the captured pieces
        info = compile_info(eng)
    assert info["mode"] == ("partition" if partition else "piecewise")
    assert info["passes"] == KERNEL_PASSES
    assert info["pass_matches"] == KERNEL_PASS_MATCHES
