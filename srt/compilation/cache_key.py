"""The compile cache's key: a hash of four factors, so that an entry is reused only where what
it holds would be compiled the same way again.

- environment: the compiler-relevant environment variables (`TORCHDYNAMO_*`,
  `TORCHINDUCTOR_*`, `TORCH_COMPILE_*`, `TRITON_*`, cache locations and tool paths left out);
- config: the model config and the runtime options that change the graph (the caller's);
- code: srt's own source and the model's file, by content;
- compiler: torch, triton, Python, the device: the CPU's ISA and feature flags, Inductor's
  settings and thread count, the GPU's compute capability, driver and CUDA runtime; and the
  versions of any other kernel package the attention backend runs (the caller's: this
  package imports none of them).

Each entry writes its factors out (`factors.json`), to read why a key changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

SRT_ROOT = Path(__file__).resolve().parent.parent
# Environment variables that change what Dynamo, Inductor or Triton generate. Cache dirs and
# tool paths only say where things are (and Inductor sets TRITON_PTXAS_PATH and
# TRITON_LIBDEVICE_PATH itself while compiling for CUDA, which would change the key mid-process);
# the compiler factor already pins the versions, so neither is part of the key.
ENV_PREFIXES = (
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "TORCH_COMPILE_",
    "TRITON_",
    "AOT_INDUCTOR_",
    "AOTINDUCTOR_",
)
ENV_LOCATION_SUFFIXES = ("CACHE_DIR", "_PATH")


def environment_factor() -> dict[str, str]:
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(ENV_PREFIXES) and not name.endswith(ENV_LOCATION_SUFFIXES)
    }


def source_files(roots: Iterable[Path]) -> list[Path]:
    """Every Python file under `roots` (a root may also be a single file), sorted, no repeats."""
    files: set[Path] = set()
    for root in roots:
        root = Path(root).resolve()
        files.update([root] if root.is_file() else root.rglob("*.py"))
    return sorted(files)


def code_factor(files: Sequence[Path]) -> str:
    """A hash of the files' contents, wherever the checkout lives (a fresh clone still hits)."""
    contents = sorted(hashlib.sha256(path.read_bytes()).hexdigest() for path in files)
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
        if flags
        else None,
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


def aot_inductor_factor(device: torch.device) -> dict[str, Any]:
    """What changes an AOTInductor package, without importing Inductor (1.2-2.1 s on a 2-core
    CPU: a warm start of packages never needs it). A package holds all it runs, so Inductor's
    settings in the loading process cannot make it wrong; what built it is pinned by the
    torch version and the environment factor (the variables Inductor's settings read), and
    on the CPU by the thread count its kernels are specialised for (Inductor's default,
    `cpp.threads` unset: the process's thread count)."""
    factor: dict[str, Any] = {"packages": "aot_inductor"}
    if device.type == "cpu":
        factor["threads"] = torch.get_num_threads()
    return factor


def cuda_driver_version() -> int:
    """The CUDA driver's version number, asked of the driver itself (torch 2.11 has no binding
    for it)."""
    import ctypes

    version = ctypes.c_int()
    if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise RuntimeError("cuDriverGetVersion failed")
    return version.value


def cuda_factor(device: torch.device) -> dict[str, Any]:
    """The GPU and the CUDA stack under it: Triton compiles for this compute capability (and
    sizes persistent kernels by the SM count), through this driver and runtime."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    runtimes = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("nvidia-cuda-runtime")
    )
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "driver": cuda_driver_version(),
        "runtime": torch.version.cuda,
        "runtime_packages": runtimes,
    }


def compiler_factor(
    device: torch.device, inductor: str | None = "inductor", kernels: dict[str, str] | None = None
) -> dict[str, Any]:
    """The toolchain. Inductor's settings only where it compiles (`inductor`: "inductor", its
    Python output, or "aot_inductor", its packages alone; None): reading them imports Inductor
    and Dynamo, seconds of startup for a setup that only captures or loads packages.
    `kernels`: other kernel packages the runner calls, by name, and their versions."""
    factor: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "triton": _package_version("triton"),
        "kernels": dict(sorted((kernels or {}).items())),
        "python": platform.python_version(),
        "device": device.type,
        "cpu": cpu_factor(),  # CUDA graphs can hold CPU kernels too; the host is the host
        "inductor": {"inductor": inductor_factor, "aot_inductor": aot_inductor_factor}[inductor](
            device
        )
        if inductor
        else None,
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
    inductor: str | None = "inductor",
    kernels: dict[str, str] | None = None,
) -> CacheFactors:
    """The factors of this process: `config` is the model config plus the graph-relevant
    runtime options; the code factor covers `source_roots` and `model_file`; `inductor`:
    what of Inductor's output is cached (`compiler_factor`); `kernels`: the versions of the
    other kernel packages the runner calls (the flashinfer attention backend's)."""
    return CacheFactors(
        environment=environment_factor(),
        config=config,
        code=code_factor(source_files([*source_roots, model_file])),
        compiler=compiler_factor(device, inductor, kernels),
    )
