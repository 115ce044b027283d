"""The compile cache: where compiled pieces live between runs, and when they may be reused.

Layout, everything private to the user (directories 0700, files 0600):

    <root>/                     --compile-cache-dir (default ~/.cache/srt/compile)
      <key>/                    one entry per cache key
        factors.json            the four factors the key hashes (read it to see why a key changed)
        computation_graph.py    the split graph as readable Python, every piece named
        manifest.json           buckets actually hit, per phase (prewarms a later start)
        inductor/               Inductor's own cache while we compile or load (C++/Triton builds)
        pieces/<name>.bin       a compiled piece (torch CompiledArtifact)
        pieces/<name>.json      its size and sha256, checked before every load

The key hashes four factors: environment (compiler-relevant environment variables), config
(the model config and the runtime options that change the graph), code (srt's own source and
the model's file) and compiler (torch, triton, Python; the CPU's ISA and feature flags,
Inductor's settings and thread count; the GPU's compute capability, driver and CUDA runtime).
An artifact whose checksum does not match, or that fails to load, is logged, removed and
recompiled; never used blindly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

SRT_ROOT = Path(__file__).resolve().parent.parent
# Environment variables that change what Dynamo, Inductor or Triton generate. Cache dirs and
# tool paths only say where things are (and Inductor sets TRITON_PTXAS_PATH and
# TRITON_LIBDEVICE_PATH itself while compiling for CUDA, which would change the key mid-process);
# the compiler factor already pins the versions, so neither is part of the key.
ENV_PREFIXES = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_", "TRITON_")
ENV_LOCATION_SUFFIXES = ("CACHE_DIR", "_PATH")


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "srt" / "compile"


def environment_factor() -> dict[str, str]:
    return {
        name: value for name, value in sorted(os.environ.items())
        if name.startswith(ENV_PREFIXES) and not name.endswith(ENV_LOCATION_SUFFIXES)
    }


def source_files(roots: Iterable[Path]) -> list[Path]:
    """Every Python file under `roots` (a root may also be a single file), sorted, no repeats."""
    files: set[Path] = set()
    for root in roots:
        root = Path(root).resolve()
        files.update([root] if root.is_file() else root.rglob("*.py"))
    return sorted(files)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_factor(files: Sequence[Path]) -> str:
    """A hash of the files' contents, wherever the checkout lives (a fresh clone still hits)."""
    contents = sorted(_sha256(path) for path in files)
    return hashlib.sha256("".join(contents).encode()).hexdigest()


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpuinfo_field(*names: str) -> str | None:
    """The first `name : value` line of /proc/cpuinfo for any of `names` (None elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return None


def cpu_factor() -> dict[str, Any]:
    """What the host CPU contributes to generated code. Inductor compiles its C++ with
    `-march=native` and picks vector code by the ISA ATen reports, so a .so built here may
    use instructions (AVX-512, AMX) another CPU lacks: the feature flags are part of the key,
    hashed (x86 `flags`, Arm `Features`), with the ISA and model name to read."""
    flags = _cpuinfo_field("flags", "Features")
    return {
        "machine": platform.machine(),
        "model": _cpuinfo_field("model name", "CPU part"),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "flags": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
        if flags else None,
    }


def inductor_factor(device: torch.device) -> dict[str, Any]:
    """Inductor's settings that change its output: its whole (portable) config, hashed, and
    on the CPU the thread count its C++ kernels are specialised for (`#pragma omp parallel
    num_threads(N)` is generated code unless `cpp.dynamic_threads`)."""
    from torch._inductor import config
    from torch._inductor.utils import parallel_num_threads

    settings = json.dumps(config.save_config_portable(), sort_keys=True, default=str)
    factor: dict[str, Any] = {"config": hashlib.sha256(settings.encode()).hexdigest()[:16]}
    if device.type == "cpu":
        factor["threads"] = "dynamic" if config.cpp.dynamic_threads else parallel_num_threads()
    return factor


def cuda_factor(device: torch.device) -> dict[str, Any]:
    """The GPU and the CUDA stack under it: Triton compiles for this compute capability (and
    sizes persistent kernels by the SM count), through this driver and runtime."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    runtimes = sorted(
        f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("nvidia-cuda-runtime")
    )
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "driver": torch._C._cuda_getDriverVersion(),
        "runtime": torch.version.cuda,
        "runtime_packages": runtimes,
    }


def compiler_factor(device: torch.device) -> dict[str, Any]:
    factor: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "triton": _package_version("triton"),
        "python": platform.python_version(),
        "device": device.type,
        "cpu": cpu_factor(),  # CUDA graphs can hold CPU kernels too; the host is the host
        "inductor": inductor_factor(device),
    }
    if device.type == "cuda":
        factor["cuda"] = cuda_factor(device)
    return factor


@dataclass
class CacheFactors:
    environment: dict[str, str]
    config: dict[str, Any]
    code: str
    compiler: dict[str, Any]

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def collect_factors(
    config: dict[str, Any],
    device: torch.device,
    model_file: Path,
    source_roots: Sequence[Path] = (SRT_ROOT,),
) -> CacheFactors:
    """The factors of this process: `config` is the model config plus the graph-relevant
    runtime options; the code factor covers `source_roots` and `model_file`."""
    return CacheFactors(
        environment=environment_factor(),
        config=config,
        code=code_factor(source_files([*source_roots, model_file])),
        compiler=compiler_factor(device),
    )


def make_private_dir(path: Path) -> Path:
    """Create `path` (parents as usual) with mode 0700; an existing directory is left as is."""
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        path.chmod(0o700)  # mkdir's mode is masked by the umask; say it exactly
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write `path` atomically (a reader sees the old file or the new one), mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class CompileCache:
    """One cache entry `<root>/<key>/` and the artifacts in it."""

    def __init__(self, root: Path, factors: CacheFactors) -> None:
        self.root = make_private_dir(Path(root).expanduser())
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

    def _meta_path(self, name: str) -> Path:
        return self.pieces_dir / f"{name}.json"

    def save_artifact(self, name: str, save: Callable[[Path], None]) -> None:
        """`save(path)` writes the artifact; its checksum is recorded next to it."""
        path = self.artifact_path(name)
        save(path)
        path.chmod(0o600)
        meta = {"bytes": path.stat().st_size, "sha256": _sha256(path), "torch": torch.__version__}
        write_private(self._meta_path(name), json.dumps(meta).encode())

    def load_artifact(self, name: str, load: Callable[[Path], T]) -> T | None:
        """`load(path)` of a stored artifact whose checksum matches; None when there is none,
        or (logged, and the files removed) when it is corrupted or fails to load."""
        path, meta_path = self.artifact_path(name), self._meta_path(name)
        if not path.exists() and not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            size, expected = path.stat().st_size, meta["sha256"]
            if size != meta["bytes"] or _sha256(path) != expected:
                raise ValueError(f"checksum mismatch ({size} bytes, expected {meta['bytes']})")
            return load(path)
        except Exception as e:  # any failure means: do not use it, compile afresh
            logger.warning(
                "compile cache: artifact %s is corrupted or mismatched (%s: %s); recompiling",
                path, type(e).__name__, e,
            )
            path.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)
            return None


class BucketManifest:
    """The buckets actually hit, per phase, across runs (rewritten atomically on each new one)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.buckets: dict[str, list[int]] = {}
        if path.exists():
            try:
                data = json.loads(path.read_text())
                self.buckets = {k: sorted(int(b) for b in v) for k, v in data["buckets"].items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                logger.warning("compile cache: ignoring unreadable manifest %s (%s)", path, e)

    def record(self, phase: str, bucket: int) -> None:
        hit = self.buckets.setdefault(phase, [])
        if bucket in hit:
            return
        hit.append(bucket)
        hit.sort()
        write_private(self.path, json.dumps({"buckets": self.buckets}, indent=2).encode())
