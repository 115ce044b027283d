"""JIT compiles after the model runner is ready, logged and counted as misses; and FlashInfer's
module builds, timed from the start.

A compile after ready is one a request waits for; each is logged with what compiled, how long
it took and the step it happened in, so that the warm-up or the capture manifest can cover it
on the next start. The sources:

- Triton's JIT: `triton.knobs.runtime.jit_cache_hook` runs before a kernel specialisation
  missing from the process's kernel cache is compiled (or loaded from Triton's disk cache),
  `jit_post_compile_hook` after it; the miss names the kernel and its specialisation.
- torch.compile: Dynamo's compile start and end callbacks around each frame it compiles, with
  everything compiled inside (Inductor's code and kernels), e.g. the first hit of a bucket
  under `--enable-torch-compile`.
- FlashInfer (the `flashinfer` attention backend): every kernel module it JIT-builds goes
  through `flashinfer.jit.JitSpec.build_and_load` (nvcc through ninja, then the load; only the
  load when its cache has the module). FlashInfer offers no hook, so that public method is
  wrapped; a module whose library file the call wrote was compiled (a miss after ready), one
  it did not was loaded. Its builds are also summed over the whole process
  (`flashinfer_builds`), hooked as soon as the backend has imported FlashInfer: before ready
  they are the startup breakdown's `flashinfer_jit_s` (minutes per module on a cold cache).

A lazy CUDA graph capture is not a miss: it is expected, and logged with its cost where it
happens; a compile inside it is one. The hooks are process-wide, installed once for each JIT
the process has imported by ready (`install_hooks`), and report to every armed `JitMissLog`
alive in the process (one per model runner).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from srt.batch_layout import ForwardMode
from srt.ipc.reports import JitBuildsInfo, JitMiss, JitMissesInfo

logger = logging.getLogger(__name__)

MAX_LISTED = 32  # misses kept in the info (the count covers all)

Report = Callable[[str, float], None]


class JitMissLog:
    """The misses of one model runner: a count, their milliseconds and the first `MAX_LISTED`.
    `when` says in the log when they happened (after ready, or in the warm-up after its
    kernels were compiled ahead: what the pool did not see)."""

    def __init__(self, when: str = "after ready") -> None:
        self.when = when
        self.count = 0
        self.ms = 0.0
        self.listed: list[JitMiss] = []
        # (mode, requests, tokens) of the step being run, set by the runner for each step.
        self.step: tuple[ForwardMode, int, int] | None = None

    def arm(self) -> None:
        """Count compiles from now on (the runner is ready)."""
        install_hooks()
        _armed.add(self)

    def disarm(self) -> None:
        _armed.discard(self)

    def record(self, what: str, ms: float) -> None:
        during = None
        if self.step is not None:
            mode, requests, tokens = self.step
            during = f"{mode.name.lower()} step of {requests} request(s), {tokens} token(s)"
        self.count += 1
        self.ms += ms
        if len(self.listed) < MAX_LISTED:
            self.listed.append(JitMiss(what, round(ms, 3), during))
        logger.info("JIT miss %s: %s took %.1f ms (%s)", self.when, what, ms, during or "no step")

    def info(self) -> JitMissesInfo:
        return JitMissesInfo(self.count, tuple(self.listed))


@dataclasses.dataclass
class JitBuilds:
    """A running count of FlashInfer's module builds: compiled, only loaded, seconds in both."""

    compiled: int = 0
    loaded: int = 0
    s: float = 0.0

    def add(self, compiled: bool, seconds: float) -> None:
        self.compiled += compiled
        self.loaded += not compiled
        self.s += seconds

    def since(self, before: JitBuilds) -> JitBuildsInfo:
        """What was built after the snapshot `before` (a `dataclasses.replace` copy)."""
        return JitBuildsInfo(
            self.compiled - before.compiled,
            self.loaded - before.loaded,
            round(self.s - before.s, 3),
        )


flashinfer_builds = JitBuilds()  # this process's, all told
_armed: weakref.WeakSet[JitMissLog] = weakref.WeakSet()
# Our Dynamo (start, end) callbacks once made: `torch._dynamo.reset()` clears every callback,
# so they are put back whenever they are found missing.
_dynamo_callbacks: tuple[Callable[[Any], None], Callable[[Any], None]] | None = None
_triton_hooked = False
_flashinfer_hooked = False


def report_miss(what: str, ms: float) -> None:
    for log in list(_armed):
        log.record(what, ms)


class CompileTimer:
    """Start and end callbacks that time each compile by a key and report it as `what`."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.started: dict[str, float] = {}

    def start(self, key: str) -> None:
        self.started[key] = time.perf_counter()

    def end(self, key: str, what: str) -> None:
        began = self.started.pop(key, None)
        if began is not None:
            self.report(what, (time.perf_counter() - began) * 1000)


def install_triton_hooks(runtime: Any, report: Report) -> None:
    """Time Triton's JIT compiles through `runtime` (`triton.knobs.runtime`), chaining to any
    hooks already set there. The start hook returns what the one before it returns (a true
    value would skip the compile)."""
    timer = CompileTimer(report)
    before_start, before_end = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_start(**kwargs: Any) -> bool | None:
        timer.start(kwargs["repr"])
        return before_start(**kwargs) if before_start is not None else None

    def on_end(**kwargs: Any) -> bool | None:
        timer.end(kwargs["repr"], f"triton {kwargs['repr']}")
        return before_end(**kwargs) if before_end is not None else None

    runtime.jit_cache_hook = on_start
    runtime.jit_post_compile_hook = on_end


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def install_flashinfer_hook(jit_spec: Any, report: Report) -> None:
    """Time each FlashInfer module build through `jit_spec` (`flashinfer.jit.JitSpec`): sum it
    into `flashinfer_builds`, and report the ones that compiled."""
    build_and_load = jit_spec.build_and_load

    def timed_build_and_load(spec: Any) -> Any:
        library = Path(spec.jit_library_path)
        before = _mtime(library)
        start = time.perf_counter()
        try:
            return build_and_load(spec)
        finally:
            seconds = time.perf_counter() - start
            compiled = _mtime(library) != before
            flashinfer_builds.add(compiled, seconds)
            if compiled:
                report(f"flashinfer {spec.name}", seconds * 1000)

    jit_spec.build_and_load = timed_build_and_load


def dynamo_callbacks(report: Report) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """Start and end callbacks that time each Dynamo compile (and what compiles inside it) by
    its compile id."""
    from torch._dynamo.callback import CallbackTrigger

    timer = CompileTimer(report)

    def counted(args: Any) -> bool:
        # CUDA graph recording (torch.compile's cudagraph trees) is a capture, not a compile.
        return args.callback_trigger is not CallbackTrigger.CUDAGRAPH_RECORDING

    def on_start(args: Any) -> None:
        if counted(args):
            timer.start(args.compile_id)

    def on_end(args: Any) -> None:
        if counted(args):
            timer.end(args.compile_id, f"torch.compile (Dynamo compile {args.compile_id})")

    return on_start, on_end


def install_dynamo_callbacks() -> None:
    """Register our Dynamo callbacks unless they are registered already."""
    global _dynamo_callbacks
    from torch._dynamo.callback import callback_handler

    if _dynamo_callbacks is None:
        _dynamo_callbacks = dynamo_callbacks(report_miss)
    on_start, on_end = _dynamo_callbacks
    if on_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(on_start)
    if on_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(on_end)


def install_hooks() -> None:
    """Hook each JIT this process has imported, once. Importing one only to watch it would
    cost startup time (Dynamo's import takes a second), and one not imported by ready compiles
    nothing after it: srt builds its compiled callables, and imports their JITs, at
    construction. The runner calls this at ready, and once before the warm-up too, so that
    FlashInfer's builds there are timed."""
    global _triton_hooked, _flashinfer_hooked
    if "torch._dynamo" in sys.modules:
        install_dynamo_callbacks()
    triton = sys.modules.get("triton")
    if not _triton_hooked and triton is not None:
        _triton_hooked = True
        knobs = getattr(triton, "knobs", None)
        if knobs is None:
            logger.warning("triton %s has no knobs: its compiles go uncounted", triton.__version__)
        else:
            install_triton_hooks(knobs.runtime, report_miss)
    flashinfer = sys.modules.get("flashinfer")
    if not _flashinfer_hooked and flashinfer is not None:
        _flashinfer_hooked = True
        jit_spec = getattr(getattr(flashinfer, "jit", None), "JitSpec", None)
        if not callable(getattr(jit_spec, "build_and_load", None)):
            logger.warning(
                "flashinfer %s has no jit.JitSpec.build_and_load: its JIT builds go uncounted",
                flashinfer.__version__,
            )
        else:
            install_flashinfer_hook(jit_spec, report_miss)
