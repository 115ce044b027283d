"""An index of the files a tool built in a directory (size and sha256 of each), written by the
compile cache once a build succeeded and checked before the tool reads the directory again:
whatever the index does not vouch for is removed, for the tool to build again.

What it refuses: a file the index does not list (left by a crashed or interrupted build), a
file whose size or checksum changed (cut short by a full disk or a copy, edited), and every
symbolic link (to a file or a directory, inside the directory or out of it): a tool follows a
link wherever it points, to a damaged file outside the cache or another entry's valid build,
which the index of this directory cannot vouch for. So every file the tool then reads is a
regular file inside the directory, with the bytes the index recorded for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from srt.compilation.private_files import make_private_dir, write_private


def _digest(path: Path) -> list[int | str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return [size, h.hexdigest()]


class FileIndex:
    """The files under `directory` (except the top-level `skip` directories: lock files, which
    hold no code) against the index in `path`."""

    def __init__(self, directory: Path, path: Path, skip: tuple[str, ...] = ("locks",)) -> None:
        self.directory = directory
        self.path = path
        self.skip = skip

    def read(self) -> dict[str, list[int | str]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: it vouches for nothing
            return {}
        return data if isinstance(data, dict) else {}

    def _walk(self) -> Iterator[tuple[str, Path]]:
        """(relative name, path) of every entry under the directory, links not followed."""
        for dirpath, dirnames, filenames in os.walk(self.directory):
            here = Path(dirpath)
            for name in [*dirnames, *filenames]:
                path = here / name
                yield path.relative_to(self.directory).as_posix(), path

    def _links(self) -> list[tuple[str, Path]]:
        return [(rel, p) for rel, p in self._walk() if p.is_symlink()]

    def files(self) -> Iterator[tuple[str, Path]]:
        """The regular files the index is about (no links, nothing under `skip`)."""
        for rel, path in self._walk():
            if rel.split("/", 1)[0] in self.skip or path.is_symlink() or not path.is_file():
                continue
            yield rel, path

    def unvouched(self) -> list[tuple[str, Path]]:
        """Every link, and every file the index does not list with its size and sha256."""
        index = self.read()
        bad = self._links()
        bad += [(rel, p) for rel, p in self.files() if index.get(rel) != _digest(p)]
        return bad

    def remove_unvouched(self) -> list[str]:
        """Remove what the index does not vouch for; the relative names removed."""
        removed = []
        for rel, path in self.unvouched():
            path.unlink(missing_ok=True)  # a link to a directory is unlinked, not followed
            removed.append(rel)
        return removed

    def copy_vouched(self, into: Path) -> list[str]:
        """Copy the files the index vouches for into `into` (private, mirrored names); the
        relative names left out."""
        index = self.read()
        left_out = [rel for rel, _ in self._links()]
        for rel, path in self.files():
            if index.get(rel) != _digest(path):
                left_out.append(rel)
                continue
            target = into / rel
            make_private_dir(target.parent)
            shutil.copyfile(path, target)
            target.chmod(0o600)
        return left_out

    def record(self, trust_known: bool = False) -> None:
        """Write the index of the files there now. `trust_known`: keep the entries of files
        the index already lists at their recorded size (checked at the start of this session,
        and written only by builds that hold the same lock), hashing only the new ones."""
        known = self.read() if trust_known else {}
        index = {}
        for rel, path in self.files():
            entry = known.get(rel)
            if entry is not None and entry[0] == path.stat().st_size:
                index[rel] = entry
            else:
                index[rel] = _digest(path)
        write_private(self.path, json.dumps(index, indent=0).encode())
