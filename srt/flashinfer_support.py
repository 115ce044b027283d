"""What the `flashinfer` attention backend needs, checked at startup without importing
FlashInfer (its import asks every GPU for its compute capability, which initialises CUDA: the
launcher checks the flags before it spawns anything, and must not).

The facts are FlashInfer 0.5.3's (`TESTED_VERSION`, the version the `flashinfer` extra pins):
its Hopper prefill kernels, which the backend runs for prompts on H100/H200, are instantiated
for head sizes 64, 128 and 256 only (a `static_assert` in `attention/hopper/prefill_sm90.cuh`);
its prefill and grouped-decode kernels run bf16 on tensor-core instructions that sm80
introduced (FlashInfer itself refuses below sm75).

Each check raises `ServerArgsError` naming `--attention-backend`: the flags and the installed
package (`ServerArgs.check`), the model's head size once its config is read
(`ServerArgs.check_model`), the device once the runner has it, before the weights load
(`FlashInferBackend.check_device`).

The import itself takes about a second even when every kernel module is built (its own
modules, TVM FFI's libraries, torch's C++ extension helpers, the CUDA query): the model runner
starts it on a thread (`start_import`) before it initialises the device and loads the
weights, which spend most of their time outside the interpreter, and the backend takes the
module from there (`module`). Even there it slows the load (the two take turns at the GIL),
so with the tested version only the modules the backend uses are imported (`PARTS`: the
decode and prefill wrappers, the JIT directory), without the package's `__init__`, which
imports every other kernel family FlashInfer has (MoE, GEMM, quantization, sampling, ...):
about half the work on a CPU. The package object stays as that partial one, which
is all this process uses; with another version, or if a part fails to import that way, the
whole package is imported as usual.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

from srt.errors import ServerArgsError

DISTRIBUTION = "flashinfer-python"
TESTED_VERSION = "0.5.3"
HEAD_SIZES = (64, 128, 256)
MIN_CAPABILITY = (8, 0)
# The package's modules the backend uses, as attributes of what `module` returns.
PARTS = ("flashinfer.decode", "flashinfer.prefill", "flashinfer.jit.env")

logger = logging.getLogger(__name__)


_importing: Future[ModuleType] | None = None


def start_import() -> None:
    """Begin `import flashinfer` on a thread of its own (once; nothing if not installed)."""
    global _importing
    if _importing is None and installed():
        pool = ThreadPoolExecutor(1, thread_name_prefix="srt-flashinfer-import")
        _importing = pool.submit(import_package)
        pool.shutdown(wait=False)  # its one job is queued; the thread ends with it


def module() -> ModuleType:
    """The flashinfer package: the import `start_import` began, waited for, or one now.
    ImportError naming the flag where it is not installed."""
    try:
        if _importing is not None:
            return _importing.result()
        return import_package()
    except ImportError as e:
        raise ImportError(
            "--attention-backend flashinfer needs the flashinfer-python package "
            "(pip install 'srt[flashinfer]'); or choose --attention-backend triton"
        ) from e


def version() -> str | None:
    """The installed distribution's version, read without importing it (the package takes
    its `__version__` from there); None if it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_package() -> ModuleType:
    """The flashinfer package with `PARTS` imported: with `TESTED_VERSION`, the parts alone
    under a package object whose `__init__` has not run; else (or if that fails) the whole."""
    if version() != TESTED_VERSION or "flashinfer" in sys.modules:
        return importlib.import_module("flashinfer")
    spec = importlib.util.find_spec("flashinfer")
    assert spec is not None and spec.submodule_search_locations is not None, "a package"
    package = importlib.util.module_from_spec(spec)  # its path set, its code not run
    sys.modules["flashinfer"] = package
    try:
        for name in PARTS:
            importlib.import_module(name)
    except Exception as e:  # a part that needs what only the package's __init__ sets up
        logger.warning("flashinfer's modules alone did not import (%s); importing it whole", e)
        for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            del sys.modules[name]
        return importlib.import_module("flashinfer")
    return package


def installed() -> bool:
    """Whether `import flashinfer` would find the package (it is not imported)."""
    return importlib.util.find_spec("flashinfer") is not None


def check_flashinfer(
    *,
    installed: bool | None = None,
    device_type: str | None = None,
    capability: tuple[int, int] | None = None,
    head_dim: int | None = None,
) -> None:
    """ServerArgsError for the first of the given facts FlashInfer cannot run with; a fact
    left None is not checked."""

    def refuse(why: str) -> ServerArgsError:
        return ServerArgsError(
            "attention_backend", f"flashinfer {why}; or choose --attention-backend triton"
        )

    if installed is False:
        raise refuse(
            f"needs the {DISTRIBUTION} package ({TESTED_VERSION}: "
            "pip install 'srt[flashinfer]'), which is not installed"
        )
    if device_type is not None and device_type != "cuda":
        raise refuse(f"runs on CUDA GPUs only, not on {device_type}")
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        need, have = (".".join(map(str, c)) for c in (MIN_CAPABILITY, capability))
        raise refuse(f"needs a GPU of compute capability {need} or newer; this one's is {have}")
    if head_dim is not None and head_dim not in HEAD_SIZES:
        sizes = ", ".join(map(str, HEAD_SIZES))
        raise refuse(f"supports head sizes {sizes}; the model's is {head_dim}")
