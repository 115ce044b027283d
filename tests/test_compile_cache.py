"""The compile cache on its own (no model): the compiler factor of the key, artifacts bound to
their entry and piece, atomic writes, the manifest shared by two processes, Inductor's files
checked against the index, private modes, and piece signatures."""

from __future__ import annotations

import builtins
import errno
import io
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

from srt.compilation import cache_key
from srt.compilation import cache_root as cache_module
from srt.compilation.bucket_manifest import BucketManifest
from srt.compilation.cache import CompileCache
from srt.compilation.cache_key import CacheFactors, collect_factors
from srt.compilation.split import piece_signature


def factors(config: dict[str, Any] | None = None) -> CacheFactors:
    return CacheFactors({}, config or {"model": "toy"}, "code", {})


def cpu_key() -> str:
    return collect_factors({"dtype": "float32"}, torch.device("cpu"), Path(__file__)).key()


# ---- the compiler factor -----------------------------------------------------------------------


def test_cache_key_follows_the_cpu_isa_and_features(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu_key()
    assert cpu_key() == before
    isa = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if isa != "AVX2" else "AVX512"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert cpu_key() != before
    monkeypatch.undo()
    real = cache_key._cpuinfo_field

    def fewer_flags(*names: str) -> str | None:  # same model, one feature less (-march=native)
        value = real(*names)
        return " ".join(value.split()[1:]) if value and "flags" in names else value

    monkeypatch.setattr(cache_key, "_cpuinfo_field", fewer_flags)
    assert cpu_key() != before


def test_cache_key_follows_inductor_settings_and_threads() -> None:
    from torch._inductor import config

    before = cpu_key()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # Inductor's C++ bakes the thread count in
        assert cpu_key() != before
    finally:
        torch.set_num_threads(threads)
    assert cpu_key() == before
    with config.patch({"cpp.simdlen": 128}):
        assert cpu_key() != before


def test_cache_key_follows_the_gpu_and_its_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132

    props = Props()
    driver = [13000]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(cache_key, "cuda_driver_version", lambda: driver[0])

    def key() -> str:
        return collect_factors({}, torch.device("cuda"), Path(__file__)).key()

    before = key()
    assert key() == before
    props.major = 8  # another compute capability
    assert key() != before
    props.major = 9
    driver[0] = 12080
    assert key() != before
    factor = collect_factors({}, torch.device("cuda"), Path(__file__)).compiler["cuda"]
    assert factor["capability"] == "9.0" and factor["driver"] == 12080
    assert "runtime" in factor


def test_key_changes_with_the_attention_kernels_version() -> None:
    def key(kernels: dict[str, str] | None) -> str:
        return collect_factors({}, torch.device("cpu"), Path(__file__), kernels=kernels).key()

    assert key(None) == key({})
    assert key({"flashinfer": "0.5.3"}) != key({})
    assert key({"flashinfer": "0.5.3"}) != key({"flashinfer": "0.6.0"})


# ---- artifacts ----------------------------------------------------------------------------------


def save(cache: CompileCache, name: str, payload: bytes) -> None:
    cache.save_artifact(name, lambda path: path.write_bytes(payload))


def load(cache: CompileCache, name: str) -> bytes | None:
    return cache.load_artifact(name, lambda path: path.read_bytes())


def rejections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "corrupted or mismatched" in r.message]


def test_an_artifact_copied_from_another_entry_is_rejected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = CompileCache(tmp_path, factors()), CompileCache(tmp_path, factors({"m": 2}))
    save(theirs, "inductor-abc-t64", b"compiled for the other config")
    theirs.artifact_path("inductor-abc-t64").rename(ours.artifact_path("inductor-abc-t64"))
    with caplog.at_level(logging.WARNING):
        assert load(ours, "inductor-abc-t64") is None
    [why] = rejections(caplog)
    assert f"written for entry {theirs.key!r}, not {ours.key!r}" in why
    assert not ours.artifact_path("inductor-abc-t64").exists()  # removed, to be recompiled


def test_artifacts_swapped_between_pieces_are_rejected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CompileCache(tmp_path, factors())
    save(cache, "piece-a", b"code of piece a")
    save(cache, "piece-b", b"code of piece b")
    a, b = cache.artifact_path("piece-a"), cache.artifact_path("piece-b")
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    with caplog.at_level(logging.WARNING):
        assert load(cache, "piece-a") is None and load(cache, "piece-b") is None
    assert len([w for w in rejections(caplog) if "written for name" in w]) == 2


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[:-3], "size mismatch"),
        (lambda data: data[:-3] + bytes(b ^ 0xFF for b in data[-3:]), "checksum mismatch"),
    ],
)
def test_a_damaged_artifact_is_rejected(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[bytes], bytes],
    reason: str,
) -> None:
    cache = CompileCache(tmp_path, factors())
    save(cache, "piece", b"compiled code")
    assert load(cache, "piece") == b"compiled code"
    path = cache.artifact_path("piece")
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING):
        assert load(cache, "piece") is None
    [why] = rejections(caplog)
    assert reason in why


class HalfWrites:
    """A file whose writes stop half-way with a full disk (a crash mid-write, as seen by a
    reader of the file)."""

    def __init__(self, f: io.IOBase) -> None:
        self.f = f

    def write(self, data: bytes) -> int:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> HalfWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def writes_fail_half_way(monkeypatch: pytest.MonkeyPatch) -> None:
    real = io.open

    def failing_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real(file, mode, *args, **kwargs)
        return HalfWrites(f) if any(c in mode for c in "wax+") else f

    monkeypatch.setattr(io, "open", failing_open)  # os.fdopen and pathlib open through it
    monkeypatch.setattr(builtins, "open", failing_open)


def test_an_interrupted_artifact_write_leaves_the_old_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def save_raw(path: Path) -> None:  # the compiler's own write succeeds; the cache's fails
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"new compiled code " * 100)
        os.close(fd)

    cache = CompileCache(tmp_path, factors())
    save(cache, "piece", b"old compiled code " * 100)
    with monkeypatch.context() as m:
        writes_fail_half_way(m)
        with pytest.raises(OSError, match="No space left"):
            cache.save_artifact("piece", save_raw)
    assert load(cache, "piece") == b"old compiled code " * 100
    assert sorted(p.name for p in cache.pieces_dir.iterdir()) == ["piece.bin"]


# ---- the manifest -------------------------------------------------------------------------------


def test_two_processes_on_one_entry_keep_each_others_buckets(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    first, second = BucketManifest(path), BucketManifest(path)  # both started on an empty one
    first.record("decode", 1)
    second.record("decode", 4)
    first.record("prefill", 8)
    second.record("decode", 1)
    assert json.loads(path.read_text()) == {"buckets": {"decode": [1, 4], "prefill": [8]}}
    assert BucketManifest(path).buckets == {"decode": [1, 4], "prefill": [8]}


def test_an_interrupted_manifest_write_leaves_the_old_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "manifest.json"
    manifest = BucketManifest(path)
    manifest.record("decode", 1)
    with monkeypatch.context() as m:
        writes_fail_half_way(m)
        with pytest.raises(OSError, match="No space left"):
            manifest.record("decode", 2)
    assert json.loads(path.read_text()) == {"buckets": {"decode": [1]}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "manifest.json.lock"]


# ---- Inductor's directory, modes ----------------------------------------------------------------


def test_inductor_files_are_checked_against_the_index(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CompileCache(tmp_path, factors())
    built = cache.inductor_dir / "ab" / "cab.main.so"
    kept = cache.inductor_dir / "cd" / "ccd.py"
    with cache.inductor_session():  # what Inductor writes while compiling
        built.parent.mkdir()
        built.write_bytes(b"\x7fELF" + bytes(1000))
        kept.parent.mkdir()
        kept.write_text("code = 1\n")
        (cache.inductor_dir / "locks").mkdir()
        (cache.inductor_dir / "locks" / "cab.lock").write_bytes(b"")
    built.write_bytes(built.read_bytes()[:100])  # truncated afterwards
    stray = cache.inductor_dir / "ef" / "cef.main.so"  # never recorded (a crashed build)
    stray.parent.mkdir()
    stray.write_bytes(b"\x7fELF")
    with caplog.at_level(logging.WARNING), cache.inductor_session():
        assert not built.exists() and not stray.exists()
        assert kept.read_text() == "code = 1\n"
        assert (cache.inductor_dir / "locks" / "cab.lock").exists()
    assert "removed 2 file(s)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), cache.inductor_session():
        assert kept.exists()
    assert caplog.text == ""
    half = cache.inductor_dir / "gh" / "cgh.main.so"
    with pytest.raises(KeyboardInterrupt), cache.inductor_session():
        half.parent.mkdir()
        half.write_bytes(b"\x7fELF")  # the linker was writing this when the process stopped
        raise KeyboardInterrupt
    assert stat.S_IMODE(half.stat().st_mode) == 0o600
    with caplog.at_level(logging.WARNING), cache.inductor_session():
        assert not half.exists() and kept.exists()
    assert "removed 1 file(s)" in caplog.text and "gh/cgh.main.so" in caplog.text


def test_tool_caches_go_under_the_root_unless_set_at_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in cache_module.TOOL_CACHE_DIRS:  # restored after the test
        monkeypatch.setenv(name, "before")
    monkeypatch.setattr(
        cache_module, "LAUNCH_TOOL_CACHE_DIRS", dict.fromkeys(cache_module.TOOL_CACHE_DIRS)
    )
    cache = CompileCache(tmp_path / "root", factors())
    root = cache.root.path
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(root / "flashinfer")
    tools = ("triton", "inductor", "flashinfer")
    assert {stat.S_IMODE((root / d).stat().st_mode) for d in tools} == {0o700}
    from torch._inductor import codecache

    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    with cache.inductor_session():  # Inductor's precompiled headers, else under $TMPDIR
        assert codecache._HEADER_DIR == str(root / "inductor" / "precompiled_headers")
        assert codecache._HEADER_LOCK_DIR == str(
            root / "inductor" / "precompiled_headers" / "locks"
        )
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.inductor_dir)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    # A location the user launched with stays, and the log says where it is.
    user = str(tmp_path / "mine")
    monkeypatch.setenv("TRITON_CACHE_DIR", user)
    monkeypatch.setitem(cache_module.LAUNCH_TOOL_CACHE_DIRS, "TRITON_CACHE_DIR", user)
    with caplog.at_level(logging.INFO, logger="srt.compilation"):
        other = CompileCache(tmp_path / "other", factors())
    assert os.environ["TRITON_CACHE_DIR"] == user and not (other.root.path / "triton").exists()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(other.root.path / "inductor")
    assert f"TRITON_CACHE_DIR={user} as set at launch" in caplog.text


def test_every_path_of_an_entry_is_private(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "root", factors())
    save(cache, "piece", b"code")
    cache.manifest.record("decode", 1)
    cache.write_text("computation_graph.py", "# graph\n")
    with cache.inductor_session():  # Inductor writes with its own modes (0755 / 0644)
        sub = cache.inductor_dir / "ab"
        sub.mkdir(mode=0o755)
        (sub / "cab.so").write_bytes(b"so")
        (sub / "cab.so").chmod(0o755)
    paths = [cache.root.path, *cache.root.path.rglob("*")]
    modes = {
        p.relative_to(cache.root.path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in paths
    }
    assert {
        p: m for p, m in modes.items() if m != (0o700 if (cache.root.path / p).is_dir() else 0o600)
    } == {}
    assert {"entry.lock", "manifest.json.lock", "inductor-files.json", "factors.json"} <= {
        Path(p).name for p in modes
    }


def test_a_cache_root_with_a_loose_mode_gets_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o755)
    with caplog.at_level(logging.WARNING):
        cache = CompileCache(root, factors())
    assert "has mode 755" in caplog.text and "make it 0700" in caplog.text
    assert stat.S_IMODE(cache.dir.stat().st_mode) == 0o700
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the runner opens the root before its cache
        CompileCache(root, factors())
    assert caplog.text == ""  # said once per process
    root.chmod(0o700)
    for d in (cache.dir, cache.pieces_dir):  # an entry left looser (an older srt, a copy)
        d.chmod(0o755)
    with caplog.at_level(logging.WARNING):
        CompileCache(root, factors())
    assert caplog.text == ""  # ours: made private again without a word
    assert {stat.S_IMODE(d.stat().st_mode) for d in (cache.dir, cache.pieces_dir)} == {0o700}


# ---- piece signatures ---------------------------------------------------------------------------


def test_piece_signatures_follow_argument_shapes_strides_and_dtypes() -> None:
    def piece(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w).relu()

    gm = fx.symbolic_trace(piece)

    def sig(*args: torch.Tensor) -> str:
        return piece_signature(gm, args)

    x, w = torch.empty(4, 8), torch.empty(16, 8)
    assert sig(x, w) == sig(torch.empty(4, 8), torch.empty(16, 8))
    assert sig(x, torch.empty(32, 8)) != sig(x, w)  # a wider layer: another kernel
    assert sig(x, torch.empty(8, 16).t()) != sig(x, w)  # same shape, transposed weight
    assert sig(x, w.half()) != sig(x, w)


# ---- the root: resolved once, unusual paths; links; the shared precompiled header -------------


def test_a_relative_root_is_resolved_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import codecache

    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR", "_precompile_header"):
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    monkeypatch.chdir(tmp_path)
    cache = CompileCache(Path("relative"), factors())
    root = tmp_path / "relative"
    assert cache.root.path == root and cache.headers_dir.is_absolute()
    monkeypatch.chdir(cache.inductor_dir)  # Inductor runs its compiler in other directories
    with cache.inductor_session():
        assert Path(codecache._HEADER_DIR) == root / "inductor" / "precompiled_headers"
    assert not (cache.inductor_dir / "relative").exists()


def test_a_root_with_a_space_builds_in_a_private_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        cache = CompileCache(tmp_path / "my cache" / "root", factors())
    assert cache.dir == tmp_path / "my cache" / "root" / cache.key  # artifacts stay there
    builds = cache.root.builds
    assert " " not in str(builds) and cache.inductor_dir == builds / cache.key / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(builds / "inductor")
    assert stat.S_IMODE(builds.stat().st_mode) == 0o700 and not builds.is_symlink()
    assert f"Inductor builds in {builds} instead" in caplog.text
    save(cache, "piece", b"code")
    assert load(cache, "piece") == b"code"


def test_links_inside_an_entry_are_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = CompileCache(tmp_path, factors()), CompileCache(tmp_path, factors({"m": 2}))
    for cache, code in ((ours, b"ours"), (theirs, b"theirs")):
        with cache.inductor_session():
            (cache.inductor_dir / "ab").mkdir()
            (cache.inductor_dir / "ab" / "cab.main.so").write_bytes(code)
            (cache.inductor_dir / "cd").mkdir()
            (cache.inductor_dir / "cd" / "ccd.py").write_text("code = 1\n")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "damaged.so").write_bytes(b"\x7fELF")
    kernel = ours.inductor_dir / "ab" / "cab.main.so"
    kernel.unlink()
    kernel.symlink_to(theirs.inductor_dir / "ab" / "cab.main.so")  # another entry's, valid
    (ours.inductor_dir / "ef").mkdir()
    (ours.inductor_dir / "ef" / "cef.main.so").symlink_to(outside / "damaged.so")
    shutil.rmtree(ours.inductor_dir / "cd")
    (ours.inductor_dir / "cd").symlink_to(theirs.inductor_dir / "cd")  # a linked directory
    save(theirs, "piece", b"their code")
    ours.artifact_path("piece").symlink_to(theirs.artifact_path("piece"))
    with caplog.at_level(logging.WARNING), ours.inductor_session():
        leftover = [p for p in ours.inductor_dir.rglob("*") if p.is_symlink()]
        assert leftover == [] and not kernel.exists() and not (ours.inductor_dir / "cd").exists()
    assert "removed 3 file(s)" in caplog.text and "are links" in caplog.text
    assert (theirs.inductor_dir / "ab" / "cab.main.so").read_bytes() == b"theirs"  # untouched
    assert (outside / "damaged.so").exists()
    with caplog.at_level(logging.WARNING):
        assert load(ours, "piece") is None
    assert "a symbolic link" in caplog.text and not ours.artifact_path("piece").is_symlink()
    assert load(theirs, "piece") == b"their code"


def test_a_damaged_precompiled_header_is_removed_and_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import functools

    from torch._inductor import codecache

    builds: list[str] = []

    @functools.cache
    def precompile_header(header: str, cmd_line: str) -> str:  # as Inductor's, memoised
        path = Path(codecache._HEADER_DIR) / "cab.h"
        if not (path.parent / "cab.h.gch").exists():  # Inductor trusts any file of the name
            builds.append(header)
            path.write_text(f"#include <{header}>\n")
            (path.parent / "cab.h.gch").write_bytes(b"gpch" + bytes(4096))
        return str(path)

    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    monkeypatch.setattr(codecache, "_precompile_header", precompile_header)
    cache = CompileCache(tmp_path, factors())

    def compile_once() -> Path:
        with cache.inductor_session():
            return Path(codecache._precompile_header("torch/prefix.h", "g++ -O3"))

    header = compile_once()
    assert builds == ["torch/prefix.h"] and header.parent == cache.headers_dir
    assert compile_once() == header and len(builds) == 1  # indexed, so trusted: not rebuilt
    gch = header.with_name("cab.h.gch")
    gch.write_bytes(gch.read_bytes()[:100])  # cut short: a full disk, a copy
    (cache.headers_dir / "cxy.h.gch").write_bytes(b"gp")  # a build whose process died
    with caplog.at_level(logging.WARNING):
        compile_once()
    assert len(builds) == 2 and gch.stat().st_size == 4100  # built again, whole
    assert "removed 2 precompiled header file(s)" in caplog.text
    assert not (cache.headers_dir / "cxy.h.gch").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        compile_once()
    assert caplog.text == "" and len(builds) == 2
