"""The compile cache: where compiled pieces live between runs, and when they may be reused.

Layout, everything private to the user (directories 0700, files 0600, Inductor's own files
included; a root that already exists with a looser mode is used, with a warning):

    <root>/                     --compile-cache-dir (default ~/.cache/srt/compile), resolved once
      triton/                   TRITON_CACHE_DIR: Triton's kernel cache, shared by every entry
      flashinfer/               FLASHINFER_WORKSPACE_BASE: FlashInfer's JIT-built modules
                                (.cache/flashinfer/<version>/<arch>/cached_ops/), shared too
      inductor/                 TORCHINDUCTOR_CACHE_DIR outside a session, shared by every entry
        precompiled_headers/    Inductor's C++ precompiled headers, checked (`precompiled_headers`)
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

(`inductor/` and the entries' `inductor/` are under the root's build directory, which is the
root itself unless the root is read-only or its path has a space: `cache_root`.)

Nothing is loaded that this cache did not write for this entry: an artifact written for
another entry or another piece, damaged, a link, or failing to load is logged, removed and
recompiled; a file in Inductor's directory that the index does not vouch for, and every link
there, is removed and rebuilt (`file_index`).

Triton's cache and Inductor's precompiled headers are shared across entries: both are
content-addressed by their tools (a new config reuses what an old one built); Triton replaces
its files atomically, and the headers are built under a lock and checked against an index.
FlashInfer's modules are shared the same way: it names each by its version, GPU architecture
and every template argument, and builds and loads them under a file lock. A variable the user
set when launching (`TRITON_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR`, `FLASHINFER_WORKSPACE_BASE`)
is respected, and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from srt.compilation.bucket_manifest import BucketManifest
from srt.compilation.cache_key import CacheFactors
from srt.compilation.cache_root import (
    FLAG,
    CacheRoot,
    open_cache_root,
    point_tool_caches,
    scratch_dir,
)
from srt.compilation.file_index import FileIndex
from srt.compilation.precompiled_headers import use_precompiled_headers
from srt.compilation.private_files import locked, make_private_dir, write_private

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


def _own_dir(path: Path) -> Path:
    """`path` as a private directory of this entry: a link there (to another entry, or out of
    the root) is removed first, so that what the entry holds is inside it."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        logger.warning("compile cache: %s is not a directory of this entry; replacing it", path)
        path.unlink()
    return make_private_dir(path)


class CompileCache:
    """One cache entry `<root>/<key>/` and the artifacts in it. On a read-only root the entry
    is used as it is (`read_only`: nothing is written there); a read-only root without this
    entry is replaced by a temporary one, with a warning."""

    def __init__(self, root: Path | CacheRoot, factors: CacheFactors) -> None:
        opened = root if isinstance(root, CacheRoot) else open_cache_root(root)
        self.key = factors.key()
        if not opened.writable and not (opened.path / self.key).is_dir():
            temporary = scratch_dir("srt-compile-cache-")
            logger.warning(
                "compile cache root %s is read-only and has no entry for this configuration "
                "(key %s): compiling into %s, which is removed at exit; make the root "
                "writable (%s) to keep what compiles",
                opened.path,
                self.key,
                temporary,
                FLAG,
            )
            opened = open_cache_root(temporary)
        self.root = opened
        self.read_only = not opened.writable
        self.tool_dirs = point_tool_caches(opened)
        self.headers_dir = Path(self.tool_dirs["TORCHINDUCTOR_CACHE_DIR"]) / "precompiled_headers"
        self.dir = opened.path / self.key
        self.pieces_dir = self.dir / "pieces"
        # Where Inductor builds for this entry: the entry's `inductor/`, unless the root cannot
        # take Inductor's builds (then its build directory, into which a read-only entry's
        # checked builds are copied at the first session).
        self.inductor_dir = opened.builds / self.key / "inductor"
        self._index = FileIndex(self.inductor_dir, self.dir / "inductor-files.json")
        self._copied = False  # a read-only entry's builds, copied at the first session
        entry_dirs = [] if self.read_only else [self.dir, self.pieces_dir]
        for d in (*entry_dirs, self.inductor_dir.parent, self.inductor_dir):
            _own_dir(d)
        factors_file = self.dir / "factors.json"
        if not self.read_only and not factors_file.exists():
            write_private(factors_file, json.dumps(asdict(factors), indent=2, default=str).encode())
        self.manifest = BucketManifest(self.dir / "manifest.json", read_only=self.read_only)

    def write_text(self, name: str, text: str) -> Path:
        """Write `name` into the entry (into the build directory, where the root is
        read-only); its path."""
        path = (self.inductor_dir.parent if self.read_only else self.dir) / name
        make_private_dir(path.parent)
        write_private(path, text.encode())
        return path

    def artifact_path(self, name: str) -> Path:
        return self.pieces_dir / f"{name}.bin"

    def save_artifact(self, name: str, save: Callable[[Path], object]) -> None:
        """`save(path)` writes the artifact (what it returns is ignored); it is stored bound
        to this entry and `name` (not on a read-only root: logged, and served from memory)."""
        if self.read_only:
            logger.warning(
                "compile cache: %s is read-only, so %s is not saved: a restart compiles it again",
                self.dir,
                name,
            )
            return
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
        none, or (logged, and the file removed) when it is a link, was written for another
        entry or another piece, is damaged, or fails to load."""
        path = self.artifact_path(name)
        if not path.exists() and not path.is_symlink():
            return None
        try:
            if path.is_symlink():  # whatever it points at is not this entry's to vouch for
                raise ValueError("a symbolic link, not a file of this entry")
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
            with tempfile.TemporaryDirectory(dir=self.inductor_dir.parent) as tmp:
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
            if not self.read_only:
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
        a file it did not record (left by a crashed build), one that changed (a truncated .so
        would crash the process in dlopen, beyond any except clause) and every link (to a
        damaged file out of the root, or to another entry's build) is removed, and Inductor
        rebuilds it from the artifact. At the end the files are made private and indexed
        (only after a session that succeeded: an interrupted one may leave half a build). On
        a read-only root the files the index vouches for are copied to the build directory
        first, and nothing is indexed (no other process writes the entry)."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        waiting = f"compile cache: waiting for another process compiling into {self.dir}"
        holding = (
            nullcontext()
            if self.read_only
            else locked(self.dir / "entry.lock", on_wait=lambda: logger.info(waiting))
        )
        with holding:
            use_precompiled_headers(self.headers_dir)
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
            if not self.read_only:
                self._index.record()

    def _check_inductor_files(self) -> None:
        left_out = []
        if self.read_only and not self._copied:
            entry_builds = FileIndex(self.dir / "inductor", self._index.path)
            if entry_builds.directory.is_dir():
                left_out = entry_builds.copy_vouched(self.inductor_dir)
            self._copied = True
        removed = left_out + self._index.remove_unvouched()
        if removed:
            logger.warning(
                "compile cache: removed %d file(s) from %s that this cache did not write, that "
                "changed since, or that are links (%s); Inductor rebuilds them",
                len(removed),
                self.dir / "inductor" if left_out else self.inductor_dir,
                ", ".join(removed[:5]),
            )

    def _make_inductor_files_private(self) -> None:
        ours = [self.inductor_dir]
        if self.headers_dir.is_relative_to(self.root.builds):  # not in one the user chose
            ours.append(self.headers_dir)
        for path in (p for d in ours for p in _tree(d)):  # Inductor writes 0755 / 0644
            if not path.is_symlink():
                path.chmod(0o700 if path.is_dir() else 0o600)


def _tree(root: Path) -> Iterator[Path]:
    """Every file and directory under `root` (not `root` itself), parents first."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        yield from (here / d for d in dirnames)
        yield from (here / f for f in filenames)
