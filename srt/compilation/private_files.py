"""Files only the user can read: private directories (0700), atomic private writes (0600) and
locks across processes. What the compile cache and its bucket manifest write goes through here."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def make_private_dir(path: Path) -> Path:
    """Create `path` (parents as usual) with mode 0700, or make an existing one 0700."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)  # mkdir's mode is masked by the umask, and an old entry may be looser
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write `path` atomically (a reader sees the old file or the new one, never part of
    one), mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: Path, on_wait: Callable[[], object] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created 0600) across processes; call `on_wait` first
    if another process holds it. The kernel drops the lock when its holder exits, crash or not."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
