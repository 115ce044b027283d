"""Inductor's C++ precompiled headers, shared by every entry of a root and checked like every
build the cache keeps.

Torch puts them under `$TMPDIR` whatever TORCHINDUCTOR_CACHE_DIR says (a module constant,
computed at its import, in torch 2.11 and 2.13), so a new machine or a cleaned /tmp rebuilt
them; srt points that constant at `<builds>/inductor/precompiled_headers/` (it is read on
each use, so setting it before the first compile moves them).

Inductor builds a header once and then trusts any file of its name: one cut short (a full
disk, a copy) makes every later C++ compile on the root fail ("while reading precompiled
header"). So srt builds them only under its lock (`precompiled_headers.lock`, beside the
directory; every srt process on the root takes it for each header Inductor asks for) and
indexes them once a build returned (`precompiled_headers-files.json`), and each session,
under the same lock, removes what the index does not vouch for (a header cut short, one a
build left half-written when its process died, a link) before anything is compiled: the next
compile that needs it builds it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from srt.compilation.file_index import FileIndex
from srt.compilation.private_files import locked, make_private_dir

logger = logging.getLogger(__name__)

# What srt sets or wraps in `torch._inductor.codecache` (the same in torch 2.11 and 2.13).
HEADER_NAMES = ("_HEADER_DIR", "_HEADER_LOCK_DIR", "_precompile_header")


def _lock_path(directory: Path) -> Path:
    return directory.with_name(directory.name + ".lock")


def header_index(directory: Path) -> FileIndex:
    return FileIndex(directory, directory.with_name(directory.name + "-files.json"))


class CheckedHeaderBuild:
    """Inductor's `_precompile_header`, run under srt's lock on the header directory it
    currently points at, with what it built indexed before the lock is released."""

    def __init__(self, build: Callable[..., str]) -> None:
        self.build = build

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        from torch._inductor import codecache

        directory = Path(codecache._HEADER_DIR)
        with locked(_lock_path(directory)):
            header = self.build(*args, **kwargs)
            header_index(directory).record(trust_known=True)
        return header

    def forget(self) -> None:
        """Drop Inductor's memo of the headers it built (one was removed, to be rebuilt)."""
        cache_clear = getattr(self.build, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def use_precompiled_headers(directory: Path) -> None:
    """Have Inductor build its C++ precompiled headers in `directory`, checked: what the
    index does not vouch for is removed first (the module says why)."""
    from torch._inductor import codecache

    if not all(hasattr(codecache, name) for name in HEADER_NAMES):
        logger.warning(
            "compile cache: this torch keeps Inductor's precompiled headers elsewhere; they "
            "stay where torch puts them, unchecked"
        )
        return
    codecache._HEADER_DIR = str(make_private_dir(directory))
    codecache._HEADER_LOCK_DIR = str(make_private_dir(directory / "locks"))
    build: Any = getattr(codecache, "_precompile_header")  # noqa: B009 (typed as a memo)
    if not isinstance(build, CheckedHeaderBuild):
        build = CheckedHeaderBuild(build)
        setattr(codecache, "_precompile_header", build)  # noqa: B010 (not its declared type)
    with locked(_lock_path(directory)):
        removed = header_index(directory).remove_unvouched()
    if removed:
        build.forget()
        logger.warning(
            "compile cache: removed %d precompiled header file(s) from %s that this cache did "
            "not build or that changed since (%s); Inductor builds them again",
            len(removed),
            directory,
            ", ".join(removed[:5]),
        )
