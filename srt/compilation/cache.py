"""The compile cache: where compiled pieces live between runs, and when they may be reused.

Layout, everything private to the user (directories 0700, files 0600, Inductor's own files
included; a root that already exists with a looser mode is used, with a warning):

    <root>/                     --compile-cache-dir (default ~/.cache/srt/compile)
      triton/                   TRITON_CACHE_DIR: Triton's kernel cache, shared by every entry
      flashinfer/               FLASHINFER_WORKSPACE_BASE: FlashInfer's JIT-built modules
                                (.cache/flashinfer/<version>/<arch>/cached_ops/), shared too
      inductor/                 TORCHINDUCTOR_CACHE_DIR outside a session, shared by every entry
        precompiled_headers/    Inductor's C++ precompiled headers (else under $TMPDIR)
      <key>/                    one entry per cache key (`cache_key`)
        factors.json            the four factors the key hashes (read it to see why a key changed)
        computation_graph.py    the split graph as readable Python, every piece named
        manifest.json           buckets actually hit, per phase (`bucket_manifest`)
        pieces/<name>.bin       a compiled piece or the saved trace: header (entry, name, size,
                                sha256) + payload
        inductor/               Inductor's own cache while we compile or load (its C++ builds)
        inductor-files.json     size and sha256 of every file in inductor/, checked before use
        entry.lock              held while compiling or loading pieces (one process at a time)
        manifest.json.lock      held while a process merges a bucket into the manifest

Nothing is loaded that this cache did not write for this entry: an artifact written for
another entry or another piece, damaged, or failing to load is logged, removed and
recompiled; a file in Inductor's directory that the index does not vouch for is removed and
rebuilt.

Triton's cache and Inductor's precompiled headers are shared across entries: both are
content-addressed by their tools (a new config reuses what an old one built), and neither
can crash the process (Triton replaces its files atomically; the C++ compiler checks a
precompiled header and ignores one that does not match). FlashInfer's modules are shared the
same way: it names each by its version, GPU architecture and every template argument, and
builds and loads them under a file lock. A variable the user set when launching
(`TRITON_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR`, `FLASHINFER_WORKSPACE_BASE`) is respected, and
the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from srt.compilation.bucket_manifest import BucketManifest
from srt.compilation.cache_key import CacheFactors
from srt.compilation.private_files import locked, make_private_dir, write_private

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The tools' cache locations, as the process was launched: srt points them under the compile
# cache root only where the user left them unset (it sets them itself later in the process,
# and Inductor writes its default into TORCHINDUCTOR_CACHE_DIR on first use).
TOOL_CACHE_DIRS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}
LAUNCH_TOOL_CACHE_DIRS = {name: os.environ.get(name) for name in TOOL_CACHE_DIRS}


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "srt" / "compile"


def point_tool_caches(root: Path) -> dict[str, str]:
    """Point Triton's, Inductor's and FlashInfer's caches under `root` (`<root>/triton`,
    `<root>/inductor`, `<root>/flashinfer`) for this process, each unless the user set it at
    launch; returns where each now is. Triton and Inductor read the variable when they compile
    (per kernel, per cache access), FlashInfer when it is imported (`flashinfer.jit.env`): so
    this must run before the first compile and before FlashInfer's import."""
    where = {}
    for name, sub in TOOL_CACHE_DIRS.items():
        chosen = LAUNCH_TOOL_CACHE_DIRS[name]
        if chosen:
            logger.info("compile cache: %s=%s as set at launch (not under %s)", name, chosen, root)
        else:
            chosen = str(make_private_dir(root / sub))
            os.environ[name] = chosen
        where[name] = chosen
    return where


def point_precompiled_headers(directory: Path) -> None:
    """Have Inductor build its C++ precompiled headers in `directory`. Inductor puts them
    under `$TMPDIR` whatever TORCHINDUCTOR_CACHE_DIR says (a module constant, computed at its
    import, in torch 2.11 and 2.13), so a new machine or a cleaned /tmp rebuilds them; the
    constant is read on each use, so setting it before the first compile moves them."""
    from torch._inductor import codecache

    if not hasattr(codecache, "_HEADER_DIR"):
        logger.warning(
            "compile cache: this torch keeps Inductor's precompiled headers elsewhere; they "
            "stay where torch puts them"
        )
        return
    codecache._HEADER_DIR = str(make_private_dir(directory))
    codecache._HEADER_LOCK_DIR = str(make_private_dir(directory / "locks"))


# An artifact file is one unit: a magic line, the header's length (8 bytes, big-endian), the
# header (JSON: which entry and which piece it was written for, the payload's size and
# sha256), then the payload (what the compiler saved). Written whole under a temporary name
# and renamed, so data and metadata can never disagree or be seen half-written.
ARTIFACT_MAGIC = b"srt compiled artifact 1\n"


def pack_artifact(header: dict[str, Any], payload: bytes) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    return ARTIFACT_MAGIC + len(head).to_bytes(8, "big") + head + payload


def unpack_artifact(data: bytes) -> tuple[dict[str, Any], bytes]:
    if not data.startswith(ARTIFACT_MAGIC):
        raise ValueError("not an srt artifact file")
    start = len(ARTIFACT_MAGIC) + 8
    end = start + int.from_bytes(data[len(ARTIFACT_MAGIC) : start], "big")
    return json.loads(data[start:end]), data[end:]


def _tree(root: Path) -> Iterator[Path]:
    """Every file and directory under `root` (not `root` itself), parents first."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        yield from (here / d for d in dirnames)
        yield from (here / f for f in filenames)


_warned_roots: set[Path] = set()


def open_cache_root(root: Path) -> Path:
    """The compile cache root, made private (0700) if it is new; an existing one with a looser
    mode is warned about (once per process), not changed."""
    root = Path(root).expanduser()
    if root.is_dir() and stat.S_IMODE(root.stat().st_mode) & 0o077:
        # Not ours to change (it may be a shared parent someone chose), but whoever can
        # write into it can replace the code this process will load.
        if root in _warned_roots:
            return root
        _warned_roots.add(root)
        logger.warning(
            "compile cache root %s has mode %o: other users can read or replace the "
            "compiled code in it; make it 0700",
            root,
            stat.S_IMODE(root.stat().st_mode),
        )
    else:
        make_private_dir(root)
    return root


class CompileCache:
    """One cache entry `<root>/<key>/` and the artifacts in it."""

    def __init__(self, root: Path, factors: CacheFactors) -> None:
        self.root = root = open_cache_root(root)
        self.tool_dirs = point_tool_caches(root)
        self.headers_dir = Path(self.tool_dirs["TORCHINDUCTOR_CACHE_DIR"]) / "precompiled_headers"
        self.key = factors.key()
        self.dir = make_private_dir(self.root / self.key)
        self.pieces_dir = make_private_dir(self.dir / "pieces")
        self.inductor_dir = make_private_dir(self.dir / "inductor")
        factors_file = self.dir / "factors.json"
        if not factors_file.exists():
            write_private(factors_file, json.dumps(asdict(factors), indent=2, default=str).encode())
        self.manifest = BucketManifest(self.dir / "manifest.json")

    def write_text(self, name: str, text: str) -> Path:
        path = self.dir / name
        write_private(path, text.encode())
        return path

    def artifact_path(self, name: str) -> Path:
        return self.pieces_dir / f"{name}.bin"

    def save_artifact(self, name: str, save: Callable[[Path], object]) -> None:
        """`save(path)` writes the artifact (what it returns is ignored); it is stored bound
        to this entry and `name`."""
        with tempfile.TemporaryDirectory(dir=self.pieces_dir) as tmp:  # private (0700)
            staged = Path(tmp) / name
            save(staged)
            payload = staged.read_bytes()
        header = {
            "entry": self.key,
            "name": name,
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "torch": torch.__version__,
        }
        write_private(self.artifact_path(name), pack_artifact(header, payload))

    def load_artifact(self, name: str, load: Callable[[Path], T]) -> T | None:
        """`load(path)` of the artifact stored as `name` in this entry; None when there is
        none, or (logged, and the file removed) when it was written for another entry or
        another piece, is damaged, or fails to load."""
        path = self.artifact_path(name)
        if not path.exists():
            return None
        try:
            header, payload = unpack_artifact(path.read_bytes())
            for field, expected in (("entry", self.key), ("name", name)):
                if header.get(field) != expected:
                    raise ValueError(f"written for {field} {header.get(field)!r}, not {expected!r}")
            if len(payload) != header["bytes"]:
                raise ValueError(
                    f"size mismatch ({len(payload)} bytes, expected {header['bytes']})"
                )
            if hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("checksum mismatch")
            with tempfile.TemporaryDirectory(dir=self.pieces_dir) as tmp:
                staged = Path(tmp) / name
                staged.write_bytes(payload)
                return load(staged)
        except Exception as e:  # any failure means: do not use it, compile afresh
            logger.warning(
                "compile cache: artifact %s is corrupted or mismatched (%s: %s); recompiling",
                path,
                type(e).__name__,
                e,
            )
            path.unlink(missing_ok=True)
            return None

    @contextmanager
    def inductor_session(self) -> Iterator[None]:
        """Compile or load Inductor pieces inside this: Inductor's own cache (its C++ builds
        and FX graph cache; Triton's kernels go to TRITON_CACHE_DIR) is the entry's
        `inductor/` directory, whatever TORCHINDUCTOR_CACHE_DIR says outside the session:
        the builds the entry's artifacts load are checked against its index.

        One process at a time holds the entry (a second server waits, then loads what the
        first compiled). Before anything loads from `inductor/`, every file there is checked
        against the index this cache wrote at the end of the last session (size and sha256):
        a file it did not record (left by a crashed build) or that changed (a truncated .so
        would crash the process in dlopen, beyond any except clause) is removed, and Inductor
        rebuilds it from the artifact. At the end the files are made private and indexed
        (only after a session that succeeded: an interrupted one may leave half a build)."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        waiting = f"compile cache: waiting for another process compiling into {self.dir}"
        with locked(self.dir / "entry.lock", on_wait=lambda: logger.info(waiting)):
            point_precompiled_headers(self.headers_dir)
            self._check_inductor_files()
            try:
                with temporary_cache_dir(str(self.inductor_dir)):
                    yield
            except BaseException:
                # What a failed or interrupted session wrote may be half a build: leave it
                # out of the index (the next session removes it), but private all the same.
                self._make_inductor_files_private()
                raise
            self._make_inductor_files_private()
            self._index_inductor_files()

    def _inductor_index_path(self) -> Path:
        return self.dir / "inductor-files.json"

    def _inductor_files(self) -> Iterator[tuple[str, Path]]:
        for path in _tree(self.inductor_dir):
            rel = path.relative_to(self.inductor_dir)
            if path.is_file() and not path.is_symlink() and rel.parts[0] != "locks":
                yield rel.as_posix(), path

    def _check_inductor_files(self) -> None:
        index_path = self._inductor_index_path()
        try:
            index = json.loads(index_path.read_text()) if index_path.exists() else {}
        except ValueError:
            index = {}
        removed = []
        for rel, path in self._inductor_files():
            data = path.read_bytes()
            if index.get(rel) != [len(data), hashlib.sha256(data).hexdigest()]:
                path.unlink()
                removed.append(rel)
        if removed:
            logger.warning(
                "compile cache: removed %d file(s) from %s that this cache did not write or "
                "that changed since (%s); Inductor rebuilds them",
                len(removed),
                self.inductor_dir,
                ", ".join(removed[:5]),
            )

    def _make_inductor_files_private(self) -> None:
        ours = [self.inductor_dir]
        if self.headers_dir.is_relative_to(self.root):  # not in a directory the user chose
            ours.append(self.headers_dir)
        for path in (p for d in ours for p in _tree(d)):  # Inductor writes 0755 / 0644
            if not path.is_symlink():
                path.chmod(0o700 if path.is_dir() else 0o600)

    def _index_inductor_files(self) -> None:
        index = {}
        for rel, path in self._inductor_files():
            data = path.read_bytes()
            index[rel] = [len(data), hashlib.sha256(data).hexdigest()]
        write_private(self._inductor_index_path(), json.dumps(index, indent=0).encode())
