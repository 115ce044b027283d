"""Triton's kernels compiled side by side: a forward run once with every Triton launch turned
into a compile on a thread pool, before the forward that needs them runs.

On an empty cache each kernel specialisation the warm-up launches compiles when it is first
launched, one after another on the start's critical path (r12d's 1B start: a 4.9 s warm-up
against 0.7 s warm). What a launch compiles is known only at the launch (its dtypes,
constexprs, which integer arguments are 1 or multiples of 16), so it is learned by launching:
`compile_ahead` installs Triton's `jit_cache_hook`, which Triton calls before compiling a
specialisation its kernel's in-memory cache lacks. The hook hands the specialisation, in
Triton's own serialised form, to a pool that compiles it (`JITFunction.preload`, which also
loads what Triton's disk cache has), and returns True, which tells Triton to compile and launch
nothing. The pool compiles into a copy of the kernel's caches, so that no launch inside the
block finds a kernel compiled meanwhile and runs it; leaving the context waits for the pool and
puts each compiled kernel into its kernel's cache, and the real forward after it compiles
nothing. Threads share one GIL, under which much of a compile runs (r17b: 16 kernels in 4.08 s
on one thread, 2.70 s on sixteen); given `CompileWorkers` (processes started when the runner
process started, `srt.compilation.triton_workers`), a thread first has a worker compile its
specialisation into Triton's disk cache, then compiles it itself, which then only loads.
(Triton's own `AsyncCompileMode` compiles on an executor too, but a launch under it waits for
its kernel: only launches that are warm-ups, which Inductor's generated code makes and srt's
wrappers do not, run side by side.)

The forward run under it launches no Triton kernel, so what those kernels would have written
is whatever the memory held: run only a forward whose other kernels read no Triton output as
an index or a size (the model runner asks its attention backend, `compiles_ahead`), and
discard what it returns. A failed compile is logged and left to the real launch, which compiles
it again and raises where it belongs; so is one still running `WAIT_S` after the block ends.
"""

from __future__ import annotations

import copy as pycopy
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

import torch

from srt.compilation.triton_workers import CompileWorkers

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AheadReport:
    """What a `compile_ahead` block compiled: filled in when it ends."""

    threads: int
    kernels: int = 0  # distinct specialisations seen (compiled, or loaded from the disk cache)
    failed: int = 0
    unfinished: int = 0  # still compiling at the deadline: left to their launch
    on_workers: int = 0  # compiled by a worker process (the thread only loaded them)
    seconds: float = 0.0  # from entering the block to the last compile's end
    waited_s: float = 0.0  # of them, the wait in `finish` (after what ran between the steps)
    # What bounds the block: the forwards that hand out the compiles (from entering it to
    # the last launch), the longest compile on a worker and all of them together, and the
    # longest compile or load on a thread (after its worker's, where there was one).
    forwards_s: float = 0.0
    longest_worker_s: float = 0.0
    longest_worker_kernel: str = ""  # the JIT function that compile was of
    worker_s: float = 0.0
    longest_thread_s: float = 0.0
    # The compile that ended last, which ends the block where the work between its steps
    # does not: its kernel, when it was handed out and when it ended, from entering the block
    # (a late hand-out, or a long compile?).
    last_kernel: str = ""
    last_handed_s: float = 0.0
    last_done_s: float = 0.0


class _Launches:
    """The hook: each specialisation a launch asks for, once, to the pool."""

    def __init__(
        self, pool: ThreadPoolExecutor, previous: Any, load: bool, workers: CompileWorkers | None
    ) -> None:
        self.pool = pool
        self.load = load  # each kernel's launcher built and its binary loaded too
        self.workers = workers
        self.previous = previous  # a hook installed before (srt's JIT miss timer), chained
        self.lock = threading.Lock()
        self.seen: set[tuple[int, str]] = set()
        # Each compile handed out: what it is, when (perf_counter), and its future.
        self.futures: list[tuple[str, float, Future[Any]]] = []

    def __call__(self, **kwargs: Any) -> bool | None:
        if kwargs["is_manual_warmup"]:  # the pool's own compile (preload): let it run
            return self.previous(**kwargs) if self.previous is not None else None
        fn = kwargs["fn"].jit_function
        with self.lock:
            if (id(fn), kwargs["key"]) not in self.seen:
                self.seen.add((id(fn), kwargs["key"]))
                spec = kwargs["compile"]["specialization_data"]
                task = self.pool.submit(_compile, fn, spec, self.load, self.workers)
                self.futures.append((kwargs["repr"], time.perf_counter(), task))
        return True  # compile nothing and launch nothing now


@dataclasses.dataclass
class _Compiled:
    fn: Any  # the JIT function
    caches: dict[Any, Any]  # its copy's caches, holding the compiled kernel
    worker_s: float | None  # the worker's compile (None: no worker compiled it)
    thread_s: float  # this thread's compile or load after it
    done_at: float  # when it ended (perf_counter)


def _compile(fn: Any, spec: str, load: bool, workers: CompileWorkers | None) -> _Compiled:
    """Compile `spec` of JIT function `fn` into caches of a copy of it. `load` (on a GPU):
    also build its launcher and load it onto the device, which Triton does at a kernel's first
    launch, and which on an empty cache is a C compile per signature (a `gcc` run: r17c's 1B
    start spent 2.2 s on them in the warm-up after the block). With `workers`, one of them
    compiles both into the disk cache first, and this only loads them (what it cannot do,
    this compiles)."""
    worker_s = None
    if workers is not None:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        try:
            worker_s = workers.submit(fn.__module__, fn.__name__, spec, target, load).result()
        except Exception as e:
            logger.debug("worker compile of %s failed (%s: %s)", fn.__name__, type(e).__name__, e)
    start = time.perf_counter()
    copy = pycopy.copy(fn)
    copy.device_caches = defaultdict(copy.create_binder)
    kernel = copy.preload(spec)
    if load and kernel is not None:
        kernel._init_handles()
    done_at = time.perf_counter()
    return _Compiled(fn, copy.device_caches, worker_s, done_at - start, done_at)


@dataclasses.dataclass
class TritonSetup:
    """What a start's first Triton launch would otherwise do on its critical path, begun on
    threads (`start_triton_setup`)."""

    # Triton imported and its key of its own code computed: wait for it (`result()`) before
    # anything else imports Triton (two threads importing one package can deadlock).
    hashed: Future[None]
    # Its CUDA driver made: wait for it before the first launch, which would make another.
    driver: Future[None]


def _run_into(future: Future[None], work: Callable[[], None]) -> None:
    try:
        work()
    except BaseException as e:  # the waiter sees it
        future.set_exception(e)
    else:
        future.set_result(None)


def start_triton_setup() -> TritonSetup:
    """Begin on threads what the first launch of any kernel on a start needs, once per process,
    where the host waits on the device or the disk (both release the GIL):
    - Triton's key of its own code (`triton_key`: a hash of its files and its 0.5 GB library,
      0.3-0.4 s), to find a kernel in the disk cache; a warm start's warm-up paid it on its
      critical path;
    - its active CUDA driver, which on a first start (an empty Triton cache) compiles the
      driver's C utilities with gcc (`cuda_utils`: 0.25-0.35 s on a 2-core CPU) after an
      `ldconfig -p`: the first start's first launch, inside the compile-ahead block and
      before it handed out any compile, paid it there.
    One thread imports Triton; then the hash and the driver run side by side (one reads and
    hashes files, the other waits on gcc)."""
    hashed: Future[None] = Future()
    driver: Future[None] = Future()

    def make_driver() -> None:
        from triton.runtime.driver import driver as triton_driver

        triton_driver.active  # noqa: B018 (the property makes it)

    def import_and_hash() -> None:
        try:
            from triton.runtime.cache import triton_key
        except BaseException as e:  # no Triton: no driver either
            driver.set_exception(e)
            raise
        # After the import: never two threads importing Triton.
        threading.Thread(
            target=_run_into, args=(driver, make_driver), name="triton-driver", daemon=True
        ).start()
        triton_key()

    threading.Thread(
        target=_run_into, args=(hashed, import_and_hash), name="triton-key", daemon=True
    ).start()
    return TritonSetup(hashed, driver)


def _pool(device: torch.device, threads: int) -> ThreadPoolExecutor:
    """`threads` threads whose current device is `device` (Triton compiles for the current
    device, and its kernel caches are per device); a CUDA device without an index is the
    caller's current one (`torch.cuda.set_device` takes no index-less device)."""
    index = None
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index

    def on_device() -> None:
        if index is not None:
            torch.cuda.set_device(index)

    return ThreadPoolExecutor(threads, "triton-ahead", on_device)


# How long the block waits for the pool, at most: a compile that hangs must not hold the
# start (what is unfinished then compiles at its launch, as without the pool).
WAIT_S = 300.0


class AheadBlock:
    """A compile-ahead block in two steps: `launching()`, inside which every Triton launch on
    `device` becomes a compile on `threads` threads (each compiled by one of `workers` first,
    where given) and launches nothing (see the module docstring); then `finish()`, which waits
    for them, `wait_s` seconds at most, and puts what they compiled into each kernel's cache.
    Between the two the caller may do work that launches no Triton kernel (the model runner
    loads the weights there), which the compiles then run beside."""

    def __init__(
        self,
        device: torch.device,
        threads: int,
        wait_s: float = WAIT_S,
        workers: CompileWorkers | None = None,
    ) -> None:
        self.start = time.perf_counter()
        self.report = AheadReport(threads)
        self.wait_s = wait_s
        self.pool = _pool(device, threads)
        self.launches: _Launches | None = None
        self.workers = workers
        self.device = device

    @contextmanager
    def launching(self) -> Iterator[AheadReport]:
        from triton import knobs

        runtime = knobs.runtime
        self.launches = _Launches(
            self.pool, runtime.jit_cache_hook, self.device.type == "cuda", self.workers
        )
        runtime.jit_cache_hook = self.launches
        try:
            yield self.report
        finally:
            runtime.jit_cache_hook = self.launches.previous
            self.report.forwards_s = time.perf_counter() - self.start

    def finish(self) -> AheadReport:
        """Wait for the compiles handed out (once), and install them; the report, filled."""
        report = self.report
        futures = self.launches.futures if self.launches is not None else []
        waiting = time.perf_counter()
        deadline = time.monotonic() + self.wait_s
        for what, handed_at, future in futures:
            try:
                done = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                report.unfinished += 1
                continue
            except Exception as e:  # the real launch compiles it again, and raises there
                report.failed += 1
                logger.warning("compile ahead of %s failed: %s: %s", what, type(e).__name__, e)
                continue
            if done.worker_s is not None:
                report.on_workers += 1
                report.worker_s += done.worker_s
                if done.worker_s > report.longest_worker_s:
                    report.longest_worker_s = done.worker_s
                    report.longest_worker_kernel = done.fn.__name__
            report.longest_thread_s = max(report.longest_thread_s, done.thread_s)
            if done.done_at - self.start > report.last_done_s:
                report.last_kernel = done.fn.__name__
                report.last_handed_s = handed_at - self.start
                report.last_done_s = done.done_at - self.start
            for device_key, (kernels, *_) in done.caches.items():
                done.fn.device_caches[device_key][0].update(kernels)
        if report.unfinished:
            logger.warning(
                "compile ahead: %d compile(s) still running after %.0f s, left to their launch",
                report.unfinished,
                self.wait_s,
            )
        self.pool.shutdown(wait=not report.unfinished, cancel_futures=True)
        report.kernels = len(futures)
        now = time.perf_counter()
        report.waited_s = now - waiting
        report.seconds = now - self.start
        return report


@contextmanager
def compile_ahead(
    device: torch.device,
    threads: int,
    wait_s: float = WAIT_S,
    workers: CompileWorkers | None = None,
) -> Iterator[AheadReport]:
    """An `AheadBlock` whose two steps are entering and leaving the context: inside, every
    Triton launch is handed to the pool; leaving waits for it (an error inside too)."""
    block = AheadBlock(device, threads, wait_s, workers)
    try:
        with block.launching() as report:
            yield report
    finally:
        block.finish()
