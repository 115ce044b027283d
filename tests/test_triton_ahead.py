"""Triton kernels compiled ahead on a pool (`srt.compilation.triton_ahead`), on a machine
without a GPU: Triton's real JIT, with its active driver replaced by one that knows only its
target (the H200's sm_90), launches nothing. Under `compile_ahead` a launch compiles on the
pool and launches nothing; after it, every specialisation seen is in the kernel's cache, and
its cubin is the one a compile one kernel at a time makes.

Each check runs in a process of its own without Triton's interpreter (`run_python`: the
other CPU tests run interpreted launches, after which the compiler cannot build a kernel in
their process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.test_triton_compile import run_python  # noqa: E402

CPU = torch.device("cpu")


def _scale(X, Y, n, BLOCK: tl.constexpr, SCALE: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, x * SCALE, mask=offs < n)


@contextmanager
def _no_gpu() -> Iterator[tuple[Any, Path]]:
    """The compiler's JIT function of `_scale` (made by hand: `triton.jit` makes the
    interpreter's under TRITON_INTERPRET), on the target-only driver, with a fresh disk cache."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from srt.compilation.triton_workers import TargetOnlyDriver

    driver.set_active(TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = str(Path(tmp) / "ahead")
        yield JITFunction(_scale), Path(tmp)


def _launch(kernel: Any, scale: float, n: int = 100, block: int = 128) -> Any:
    x = torch.zeros(n, dtype=torch.float16)
    return kernel[(1,)](x, torch.empty_like(x), n, BLOCK=block, SCALE=scale)


def _cached(kernel: Any) -> dict[str, Any]:
    return dict(kernel.device_caches[0][0])


def check_launches_compile_on_the_pool_and_launch_nothing() -> None:
    from triton import knobs

    from srt.compilation.triton_ahead import compile_ahead

    threads: list[str] = []

    def timer(**kwargs: Any) -> None:  # a hook set before (srt's JIT miss timer) sees them
        threads.append(threading.current_thread().name)

    with _no_gpu() as (kernel, _):
        knobs.runtime.jit_cache_hook = timer
        with compile_ahead(CPU, 4) as report:
            for scale in (2.0, 3.0, 4.0, 2.0):  # the repeat compiles once
                assert _launch(kernel, scale) is None  # nothing launched
        assert knobs.runtime.jit_cache_hook is timer  # put back
        assert (report.kernels, report.failed, report.threads) == (3, 0, 4), report
        assert len(threads) == 3 and all(name.startswith("triton-ahead") for name in threads)
        assert len(_cached(kernel)) == 3  # each in the kernel's cache: its launch compiles none


def check_the_pool_compiles_the_kernels_a_sequential_compile_makes() -> None:
    from srt.compilation.triton_ahead import compile_ahead

    with _no_gpu() as (kernel, tmp):
        with compile_ahead(CPU, 3):
            for scale in (2.0, 3.0, 5.0):
                _launch(kernel, scale)
        ahead = {key: k.asm["cubin"] for key, k in _cached(kernel).items()}
        # One at a time, into a cache of its own (or it would load the pool's files).
        os.environ["TRITON_CACHE_DIR"] = str(tmp / "sequential")
        kernel.device_caches.clear()
        for scale in (2.0, 3.0, 5.0):
            x = torch.zeros(100, dtype=torch.float16)
            kernel.warmup(x, x, 100, BLOCK=128, SCALE=scale, grid=(1,))
        sequential = {key: k.asm["cubin"] for key, k in _cached(kernel).items()}
        assert len(ahead) == 3 and ahead == sequential


def check_the_block_compiles_beside_the_work_between_its_steps() -> None:
    """The model runner's use: the launches handed out in `launching()`, then work of its own
    (the weight fill) while they compile, then `finish()`: nothing reaches the kernel's cache
    before it, everything after, and the report's wait is only what came after the work."""
    import time

    from triton import knobs

    from srt.compilation.triton_ahead import AheadBlock

    with _no_gpu() as (kernel, _):
        before = knobs.runtime.jit_cache_hook
        block = AheadBlock(CPU, 2)
        with block.launching() as report:
            for scale in (2.0, 3.0):
                assert _launch(kernel, scale) is None
        assert knobs.runtime.jit_cache_hook is before  # put back at the first step's end
        assert _cached(kernel) == {}  # no launch between the steps finds a kernel of the pool
        time.sleep(3.0)  # longer than the two compiles
        assert block.finish() is report
        assert (report.kernels, report.failed, report.unfinished) == (2, 0, 0), report
        assert len(_cached(kernel)) == 2
        assert report.forwards_s < report.seconds and report.seconds >= 3.0, report
        assert report.waited_s < 1.0, report  # the compiles ended during the work
        # The last to end: one of the kernel's, handed out in the forwards, ended in the work.
        assert report.last_kernel == kernel.__name__, report
        assert 0.0 <= report.last_handed_s <= report.forwards_s < report.last_done_s, report
        assert report.last_done_s < 3.0 + report.forwards_s, report


def check_a_failed_compile_is_counted_and_left_to_the_launch() -> None:
    from srt.compilation.triton_ahead import compile_ahead

    with _no_gpu() as (kernel, _):
        with compile_ahead(CPU, 2) as report:
            _launch(kernel, 1.0, n=10, block=100)  # not a power of two: the compiler refuses
            _launch(kernel, 2.0)
        assert (report.kernels, report.failed) == (2, 1), report
        assert len(_cached(kernel)) == 1


def check_a_compile_past_the_deadline_is_left_to_the_launch() -> None:
    from srt.compilation.triton_ahead import compile_ahead

    with _no_gpu() as (kernel, _):
        with compile_ahead(CPU, 1, wait_s=0.0) as report:
            _launch(kernel, 2.0)  # a compile takes longer than no time at all
        assert (report.kernels, report.unfinished, report.failed) == (1, 1, 0), report
        assert _cached(kernel) == {}  # not merged: its launch compiles it


def check_every_srt_kernel_compiles_ahead(threads: int = 2) -> None:
    """Every kernel srt launches, through its wrapper (as the compile test exercises them),
    compiles ahead on `threads` threads, none failing; the report printed as JSON (the last
    line: `scripts/bench_compile_ahead.py` reads it)."""
    from srt.compilation.triton_ahead import compile_ahead
    from tests.test_triton_compile import exercise_kernels

    with _no_gpu():
        with compile_ahead(CPU, threads) as report:
            exercise_kernels()
    assert report.failed == 0 and report.kernels >= 10, report
    print(json.dumps(dataclasses.asdict(report)))


def check_the_workers_compile_and_the_threads_only_load(
    processes: int = 2, threads: int = 4, ready_first: bool = False
) -> None:
    """Given worker processes, every srt kernel the wrappers launch compiles in one of them
    into Triton's disk cache, and the pool's threads only load it: the compiler's stages are
    broken in this process, so a thread that compiled would fail. With `ready_first` the block
    starts once every worker has imported (as in a server's start, where they import while
    the runner loads). The report printed as JSON (the last line:
    `scripts/bench_compile_ahead.py` reads it)."""
    import time

    from triton.backends.nvidia.compiler import CUDABackend

    from srt.compilation.triton_ahead import compile_ahead
    from srt.compilation.triton_workers import CompileWorkers
    from srt.model_executor.runner_entry import KERNEL_PACKAGES
    from tests.test_triton_compile import exercise_kernels

    def compiled_here(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a thread compiled a kernel the workers had compiled")

    with _no_gpu():
        workers = CompileWorkers(processes, KERNEL_PACKAGES)  # spawned: their compiler whole
        CUDABackend.add_stages = compiled_here  # type: ignore[method-assign]
        try:
            while ready_first and workers.ready_after_s() is None:
                time.sleep(0.01)
            with compile_ahead(CPU, threads, workers=workers) as report:
                exercise_kernels()
            ready_s = workers.ready_after_s()  # each did a task: each had imported
        finally:
            workers.shutdown()
    assert report.failed == 0 and report.kernels >= 10, report
    assert report.on_workers == report.kernels, report
    # The block's bounds: each compile took time on a worker, the longest no more than all
    # of them, and none outlasted the block; the forwards handed them out inside it.
    assert 0 < report.longest_worker_s <= report.worker_s, report
    assert report.longest_worker_kernel.startswith("_"), report  # srt's kernels' names
    assert report.longest_worker_s <= report.seconds, report
    assert 0 < report.forwards_s <= report.seconds, report
    assert 0 < report.longest_thread_s <= report.seconds, report
    assert ready_s is not None and 0 < ready_s < report.seconds + 600, ready_s
    print(json.dumps(dataclasses.asdict(report) | {"processes": processes, "ready_s": ready_s}))


@pytest.mark.parametrize(
    "check",
    [
        "check_launches_compile_on_the_pool_and_launch_nothing",
        "check_the_pool_compiles_the_kernels_a_sequential_compile_makes",
        "check_the_block_compiles_beside_the_work_between_its_steps",
        "check_a_failed_compile_is_counted_and_left_to_the_launch",
        "check_a_compile_past_the_deadline_is_left_to_the_launch",
        "check_every_srt_kernel_compiles_ahead",
        "check_the_workers_compile_and_the_threads_only_load",
    ],
)
def test_compile_ahead(check: str) -> None:
    run_python(f"from tests.test_triton_ahead import {check}; {check}()", interpret=False)


@pytest.mark.parametrize(
    ("device", "index"), [(torch.device("cuda"), 3), (torch.device("cuda", 1), 1)]
)
def test_the_pool_threads_compile_on_the_device_asked_for(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, index: int
) -> None:
    """Each pool thread makes the device current before it compiles: an index-less CUDA device
    is the caller's current one (`torch.cuda.set_device` refuses a device without an index,
    which broke every pool on the H200 in r17a)."""
    from srt.compilation.triton_ahead import _pool

    set_to: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    pool = _pool(device, 2)
    try:
        assert pool.submit(lambda: "compiled").result() == "compiled"
    finally:
        pool.shutdown()
    assert set_to and set(set_to) == {index}


def test_the_disk_cache_entries_are_the_kernels_triton_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start compiles ahead only while Triton's disk cache holds no kernel (a warm start's
    launches load theirs): a directory with Triton's group file per kernel; a missing cache,
    a stray file and a C module Triton built there (its driver's utilities, made on a thread
    before the runner asks) count none."""
    from srt.compilation.triton_workers import disk_cache_entries

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert disk_cache_entries() == 0
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "stray.lock").write_text("")
    (tmp_path / "triton" / "U5TLS").mkdir()
    (tmp_path / "triton" / "U5TLS" / "cuda_utils.cpython-312-x86_64-linux-gnu.so").write_text("")
    assert disk_cache_entries() == 0
    for name in ("K3QRZ", "A7XPL"):
        save_kernel_entry(tmp_path / "triton" / name)
    assert disk_cache_entries() == 2


def save_kernel_entry(directory: Path) -> None:
    """What Triton's disk cache holds for one compiled kernel, as far as the count looks."""
    directory.mkdir(parents=True)
    (directory / "_scale.cubin").write_bytes(b"")
    (directory / "__grp___scale.json").write_text("{}")


def test_compile_workers_start_on_a_first_start_on_cuda_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's entry starts worker processes where its warm-up will compile ahead: on
    CUDA, with threads to compile on, a warm-up, an attention backend that compiles ahead,
    and an empty Triton disk cache under the compile cache root; one per thread, at most
    MAX_WORKERS."""
    from srt.compilation import cache_root
    from srt.compilation.triton_workers import MAX_WORKERS
    from srt.model_executor import runner_entry
    from srt.server_args import ServerArgs, usable_cpus

    started: list[int] = []

    def workers(processes: int, packages: tuple[str, ...], first: Any) -> str:
        assert packages == runner_entry.KERNEL_PACKAGES and first is not None
        started.append(processes)
        return "workers"

    monkeypatch.setattr(runner_entry, "CompileWorkers", workers)
    for name in cache_root.TOOL_CACHE_DIRS:  # as if unset at launch; restored after
        monkeypatch.setenv(name, "")
        monkeypatch.setitem(cache_root.LAUNCH_TOOL_CACHE_DIRS, name, None)

    def start(**flags: Any) -> Any:
        args = ServerArgs(model_path="m", compile_cache_dir=str(tmp_path / "cache"), **flags)
        return runner_entry.start_compile_workers(args)

    assert start(device="cpu") is None
    assert start(device="cuda", compile_threads=0) is None
    assert start(device="cuda", skip_warmup=True) is None
    assert start(device="cuda", attention_backend="flashinfer") is None
    assert started == []
    assert start(device="cuda", compile_threads=3) == "workers" and started == [3]
    assert start(device="cuda") == "workers"
    assert started[-1] == min(usable_cpus(), MAX_WORKERS)
    save_kernel_entry(tmp_path / "cache" / "triton" / "K3QRZ")  # a warm start
    assert start(device="cuda") is None and len(started) == 2


def test_triton_is_hashed_on_a_thread_before_the_first_launch() -> None:
    """`start_triton_setup` leaves Triton's key of its own code cached for the process, as
    a kernel's first launch would compute it (a fresh process: nothing hashed it before).
    Without a GPU no driver is active: its future holds the error, which the runner logs."""
    out = run_python(
        "import sys\n"
        "from srt.compilation.triton_ahead import start_triton_setup\n"
        "assert 'triton' not in sys.modules\n"
        "setup = start_triton_setup()\n"
        "setup.hashed.result(timeout=120)\n"
        "from triton.runtime.cache import triton_key\n"
        "import triton\n"
        "info = triton_key.cache_info()\n"
        "key = triton_key()\n"
        "error = setup.driver.exception(timeout=120)\n"
        "print(info.currsize, triton_key.cache_info().hits, key.startswith(triton.__version__),\n"
        "      'active drivers' in str(error))",
        interpret=False,
    )
    assert out.split() == ["1", "1", "True", "True"], out


def test_triton_driver_is_made_on_its_own_thread() -> None:
    """The driver is made once, on the setup's driver thread (on a first start its C
    utilities compile there, beside the hash), and is the one launches then find active."""
    out = run_python(
        "import sys, threading\n"
        "import triton.runtime.driver\n"
        "runtime_driver = sys.modules['triton.runtime.driver']  # the module, not its `driver`\n"
        "made = []\n"
        "class Driver:\n"
        "    def __init__(self):\n"
        "        made.append(threading.current_thread().name)\n"
        "runtime_driver._create_driver = Driver\n"
        "from srt.compilation.triton_ahead import start_triton_setup\n"
        "setup = start_triton_setup()\n"
        "setup.driver.result(timeout=120)\n"
        "setup.hashed.result(timeout=120)\n"
        "print(made, type(runtime_driver.driver.active).__name__)",
        interpret=False,
    )
    assert out.split() == ["['triton-driver']", "Driver"], out
