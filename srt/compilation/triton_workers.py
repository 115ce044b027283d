"""Processes that compile Triton kernels into Triton's disk cache, started before the model
runner imports torch, for `compile_ahead` to hand its specialisations to.

Why processes: on threads (r17b, the H200's 16 CPUs) the warm-up's 16 kernels took 4.08 s on
one thread and 2.70 s on sixteen, 1.5x: much of a compile is Python (Triton's front end, its
pass pipelines driven from Python) under one GIL. On processes a block is bounded by its
longest compile (the decode attention kernel, about 1 s) instead. A process pays for its own
imports (torch, triton, the kernel's module: 3-4 s on the H200's host), which is why the pool
starts first thing in the runner process (`srt.model_executor.runner_entry`): the workers
import while the runner imports, loads the weights and builds its graphs, and are idle by the
time the warm-up asks.

A worker imports the kernel's module by name, compiles the specialisation Triton serialised
(`JITFunction.preload`) for the target the runner names with it, with a driver that knows only that
target (it never touches the GPU: no CUDA context, no device memory), and on CUDA builds the
kernel's launcher (a C compile per signature, cached by Triton beside its kernels). Both land
in the disk cache, where the runner's own compile of the same specialisation (its pool thread,
`srt.compilation.triton_ahead`) finds them and only loads. What a worker cannot do (a kernel
that is not a module's attribute, a compile that fails) it reports, and the runner's thread
compiles it as without the workers.

This module imports neither torch nor triton at import: the runner entry imports it before
both.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pkgutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

# More workers than this only import torch for nothing: the warm-up's 16-20 specialisations
# take about 4 s of compiling in all, the longest about 1 s (r17b, bench_compile_ahead).
MAX_WORKERS = 8


def disk_cache_entries() -> int:
    """How many kernels Triton's disk cache holds: none on a first start, where compiling
    ahead pays; a warm start's launches only load theirs, and the block's extra forwards would
    cost more than they save (r17b: +0.2 s on the 1B warm start). A kernel is a directory
    holding Triton's group file (`__grp__NAME.json`, which lists its artifacts); the C modules
    Triton builds in the same cache (its driver's utilities, a launcher) have none, and do not
    count: r36's runner made the driver on a thread before it asked, and took the utilities'
    directory for a warm start's kernels (no compile ahead: a 1B first start 6.9 -> 11.5 s);
    a start that stopped after its first launch leaves the same.
    Where the variable names the directory (srt's processes set it: `point_tool_caches`),
    Triton is not imported for it: the runner asks while a thread may be importing Triton."""
    path = os.environ.get("TRITON_CACHE_DIR")
    if not path:  # Triton's own default, as it resolves it
        from triton import knobs

        path = knobs.cache.dir
    try:
        entries = [entry.path for entry in os.scandir(path) if entry.is_dir()]
    except OSError:  # not made yet: nothing compiled there
        return 0
    return sum(1 for entry in entries if _holds_group_file(entry))


def _holds_group_file(directory: str) -> bool:
    try:
        return any(name.startswith("__grp__") for name in os.listdir(directory))
    except OSError:  # removed meanwhile
        return False


class TargetOnlyDriver:
    """A Triton driver that names one target and nothing more: enough to compile for it; a
    worker launches nothing, and touching the GPU would give each worker a CUDA context (the
    CPU tests compile for the H200 through it too)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def _jit_function(module: str, name: str) -> Any:
    """The JIT function named `name` in `module`, through the wrappers Triton puts around one
    (`autotune`, `heuristics`: each holds the next as `fn`)."""
    from triton.runtime.jit import JITFunction

    obj = getattr(importlib.import_module(module), name)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def _start_worker(
    packages: tuple[str, ...], first: Callable[[], None] | None, ready_at: Any, slots: Any
) -> None:
    """A worker's initializer: `first` (the runner ties the worker's life to its own), then
    what its tasks would pay for first, paid while the runner is busy elsewhere: every module
    of `packages` (those holding the kernels, torch with them), and Triton's key of its own
    code (a hash of its files, 0.3 s). Then it writes when it was ready into its slot of
    `ready_at` (the wall clock), `slots` counting the slots taken."""
    from triton.runtime.cache import triton_key

    if first is not None:
        first()
    for package in packages:
        for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
            importlib.import_module(f"{package}.{module.name}")
    triton_key()
    with slots.get_lock():
        slot = slots.value
        slots.value += 1
    ready_at[slot] = time.time()


def compile_to_disk(module: str, name: str, spec: str, target: Any, launcher: bool) -> float:
    """In a worker: compile the specialisation `spec` (Triton's serialised form) of the JIT
    function `name` of `module` for `target` into Triton's disk cache, and with `launcher` its
    launcher too (CUDA's, a C module Triton caches by its source). Returns the seconds that
    took (the block's report: is it bounded by its longest compile, or by waiting?)."""
    from triton.runtime.driver import driver

    start = time.perf_counter()

    driver.set_active(TargetOnlyDriver(target))
    kernel = _jit_function(module, name).preload(spec)
    if launcher and kernel is not None:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    return time.perf_counter() - start


class CompileWorkers:
    """`processes` spawned workers, all started from the constructor on, each running `first`
    and importing the modules of `packages` (the kernels' own) before its first task."""

    def __init__(
        self,
        processes: int,
        packages: tuple[str, ...] = (),
        first: Callable[[], None] | None = None,
    ) -> None:
        self.processes = processes
        self.started_at = time.time()
        context = multiprocessing.get_context("spawn")  # the runner may hold CUDA: no fork
        self.ready_at = context.Array("d", processes, lock=False)
        slots = context.Value("i", 0)
        self.pool = ProcessPoolExecutor(
            processes,
            context,
            initializer=_start_worker,
            initargs=(packages, first, self.ready_at, slots),
        )
        # A spawn pool starts a process per task waiting for one: one task each starts all.
        for _ in range(processes):
            self.pool.submit(time.time)

    def ready_after_s(self) -> float | None:
        """The seconds from the pool's start to its last worker's being ready (its imports
        done); None while one is still importing."""
        ready = list(self.ready_at)
        return None if min(ready) == 0.0 else max(ready) - self.started_at

    def submit(
        self, module: str, name: str, spec: str, target: Any, launcher: bool
    ) -> Future[float]:
        return self.pool.submit(compile_to_disk, module, name, spec, target, launcher)

    def shutdown(self) -> None:
        """Stop the workers (their imports hold memory); a compile running is not waited for."""
        self.pool.shutdown(wait=False, cancel_futures=True)
