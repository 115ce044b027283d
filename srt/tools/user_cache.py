"""Things the tools build once per user and keep in `$XDG_CACHE_HOME/srt/` (default
`~/.cache/srt/`): the tiny model, the Llama-3-size tokenizer."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def built_once(name: str, marker: str, build: Callable[[Path], object]) -> Path:
    """`<cache>/srt/<name>`, made by `build(directory)` (its return value unused) on first
    use. `name` carries a version, bumped whenever the builder changes, so a stale copy is
    never served; `marker` is the file whose presence says the directory is whole. It is built
    in a temporary directory next to it and renamed into place, so concurrent callers never
    see it half-written; the loser of a race discards its copy."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / "srt" / name
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
