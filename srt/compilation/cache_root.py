"""The compile cache root (`--compile-cache-dir`), resolved once per process, and where the
tools build: what a root that cannot take a write, or whose name Inductor cannot build in,
does instead of failing.

- The root is made absolute, links resolved, once: Inductor runs its C++ compiler in other
  working directories, so a relative path would put the shared precompiled header (150 MB)
  inside each entry, and two spellings of one root would be two roots.
- A read-only root (a container's read-only mount) is used as it is: its entries load, and
  nothing is written there (no mode change, no manifest, no artifact). The tools' caches and
  Inductor's builds go to a private temporary directory, removed at exit, into which an
  entry's checked builds are copied (Inductor writes locks and unpacks artifacts where it
  builds, even when it compiles nothing). A read-only root without the entry a start needs
  is replaced, with a warning, by a temporary cache that is lost at exit (`CompileCache`).
- Inductor's C++ build commands do not quote paths (sources, outputs, `-include` of the
  precompiled header), so a root whose path the shell would split (a space in `HOME`, under
  which the default root lies) breaks every compile. Inductor's directories then go to a
  private directory of this user under the temporary directory, named by a hash of the root,
  kept between starts (checked at each, like everything Inductor built), and the log says so;
  the rest of the cache stays under the root.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import logging
import os
import shlex
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from srt.compilation.errors import CompileCacheError
from srt.compilation.private_files import make_private_dir

logger = logging.getLogger(__name__)

FLAG = "--compile-cache-dir"
# The tools' cache locations, as the process was launched: srt points them under the compile
# cache root only where the user left them unset (it sets them itself later in the process,
# and Inductor writes its default into TORCHINDUCTOR_CACHE_DIR on first use).
TOOL_CACHE_DIRS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}
# The tools that build with command lines (a C++ compiler, ninja and nvcc): their directories
# go where such a command can take the path (`builds_in`).
BUILDING_TOOLS = frozenset({"TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"})
LAUNCH_TOOL_CACHE_DIRS = {name: os.environ.get(name) for name in TOOL_CACHE_DIRS}
# What a write into a directory that cannot take one raises.
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "srt" / "compile"


def builds_in(path: Path) -> bool:
    """Whether Inductor's unquoted build commands keep `path` as one word."""
    return shlex.quote(str(path)) == str(path)


@dataclass(frozen=True)
class CacheRoot:
    path: Path  # absolute, links resolved
    writable: bool
    # Where the tools build (Inductor's directories, and Triton's when the root is
    # read-only): `path`, or a private directory when `path` cannot take it.
    builds: Path

    @property
    def tools(self) -> Path:
        """The parent of the tools' caches (`triton/`, `inductor/`)."""
        return self.path if self.writable else self.builds


_opened: dict[Path, CacheRoot] = {}


def scratch_dir(prefix: str) -> Path:
    """A new private (0700) temporary directory, removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _writable(path: Path) -> bool:
    """Whether `path` (a directory) takes a new file: the mode bits do not tell (root may
    write anywhere, and a read-only mount refuses everyone)."""
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".srt-write-probe-")
    except OSError as e:
        if e.errno in READ_ONLY_ERRNOS:
            return False
        raise CompileCacheError(f"{FLAG} {path}: cannot write there ({e})") from e
    os.close(fd)
    os.unlink(probe)
    return True


def _private_builds_dir(root: Path) -> Path:
    """This user's directory for Inductor's builds of `root`, under the temporary directory:
    made by this user, 0700, not a link (else someone else chose what this process loads)."""
    parent = Path(tempfile.gettempdir()).resolve() / f"srt-compile-{os.geteuid()}"
    path = parent / hashlib.sha256(str(root).encode()).hexdigest()[:16]
    for d in (parent, path):
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise CompileCacheError(
                f"{FLAG} {root}: the directory for Inductor's builds, {d}, is not a directory "
                "of this user; remove it, or choose a root whose path has no spaces"
            )
        d.chmod(0o700)
    return path


def open_cache_root(root: Path) -> CacheRoot:
    """The compile cache root `root` (created private, 0700, if new), resolved once per
    process. An existing one with a looser mode is warned about, not changed; one that is
    read-only, or whose path Inductor cannot build in, is used as the module says."""
    path = Path(root).expanduser().resolve()
    if path in _opened:
        return _opened[path]
    if path.exists() and not path.is_dir():
        raise CompileCacheError(f"{FLAG} {path} is not a directory")
    writable = True
    if not path.exists():
        try:
            make_private_dir(path)
        except OSError as e:
            if e.errno not in READ_ONLY_ERRNOS:
                raise CompileCacheError(f"{FLAG} {path}: cannot create it ({e})") from e
            writable = False  # as read-only as a read-only root, and empty
    else:
        writable = _writable(path)
    if not writable:
        builds = scratch_dir("srt-compile-")
        logger.warning(
            "compile cache root %s is read-only: its entries are used as they are and nothing "
            "is saved there; the tools build in %s (private, removed at exit)",
            path,
            builds,
        )
    elif not builds_in(path):
        builds = _private_builds_dir(path)
        logger.warning(
            "compile cache root %s has a character that Inductor's C++ build commands cannot "
            "take (they do not quote paths): Inductor builds in %s instead (private, checked "
            "at each start); the rest of the cache stays under the root",
            path,
            builds,
        )
    else:
        builds = path
    if not builds_in(builds):
        raise CompileCacheError(
            f"{FLAG} {path}: Inductor cannot build in {builds} either (its build commands do "
            "not quote paths): choose a root, or a TMPDIR, whose path has no spaces"
        )
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0
    if writable and mode & 0o077:
        # Not ours to change (it may be a shared parent someone chose), but whoever can
        # write into it can replace the code this process will load.
        logger.warning(
            "compile cache root %s has mode %o: other users can read or replace the "
            "compiled code in it; make it 0700",
            path,
            mode,
        )
    opened = _opened[path] = CacheRoot(path, writable, builds)
    return opened


def point_tool_caches(root: CacheRoot) -> dict[str, str]:
    """Point Triton's, Inductor's and FlashInfer's caches under `root` (`triton/`,
    `inductor/`, `flashinfer/`; the last two where a build command can take the path) for
    this process, each unless the user set it at launch; returns where each now is. Triton
    and Inductor read the variable when they compile (per kernel, per cache access),
    FlashInfer when it is imported (`flashinfer.jit.env`): so this must run before the first
    compile and before FlashInfer's import."""
    where = {}
    for name, sub in TOOL_CACHE_DIRS.items():
        chosen = LAUNCH_TOOL_CACHE_DIRS[name]
        if chosen:
            logger.info(
                "compile cache: %s=%s as set at launch (not under %s)", name, chosen, root.path
            )
        else:
            parent = root.builds if name in BUILDING_TOOLS else root.tools
            chosen = str(make_private_dir(parent / sub))
            os.environ[name] = chosen
        where[name] = chosen
    return where
