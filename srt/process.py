"""Set-up shared by the server's processes: one log format, and children tied to the launcher.

A child reports to the launcher over a pipe exactly once: its startup figures when it is ready,
or the error that stopped it. Its figures time its own start (the interpreter and its imports)
from the moment the launcher spawned it.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

from srt.ipc.reports import ReadyReport, RunnerInfo, StartFailure

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def proc_stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat from the 3rd (the state) on, or None once the process
    is gone (Linux only, as the server). The 2nd (the command) may hold spaces and
    parentheses: the fields start after its last closing parenthesis."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def process_cpu_s(pid: int) -> float | None:
    """The CPU seconds (user and system, every thread) that process `pid` has used, from its
    counters in /proc (another process's, which `time.process_time` cannot give); None once
    it is gone."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    # utime and stime, the 14th and 15th fields.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def configure_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        # Milliseconds: the startup lines of three processes interleave within a second.
        format=f"%(asctime)s.%(msecs)03d [{process}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (the launcher, or the runner for its
    compile workers) dies, so that no child is orphaned."""
    launcher = multiprocessing.parent_process()
    parent = launcher.pid if launcher is not None else os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


class Worker(Protocol):
    def runner_info(self) -> RunnerInfo | None:
        """The model runner's record, for its ready report (None for other processes)."""
        ...

    def run(self) -> None: ...


W = TypeVar("W", bound=Worker)


@dataclass(frozen=True)
class ChildEntry:
    """A child's entry function, named as `module` and `function` rather than held: the
    launcher spawns the model runner without importing its module (and torch) itself. The
    child imports it on the call, so the import counts in the child's start."""

    module: str
    function: str

    def __call__(self, *args: Any) -> None:
        die_with_parent()  # first: the imports take seconds, the launcher may die meanwhile
        getattr(importlib.import_module(self.module), self.function)(*args)


@dataclass
class ReadyPipe:
    """A child's end of the pipe on which it reports to the launcher."""

    conn: Connection
    spawned_at: float  # time.time() in the launcher just before the spawn


def run_child(name: str, log_level: str, ready: ReadyPipe, build: Callable[[], W]) -> None:
    """Body of a child process (started by a `ChildEntry`, which has tied it to the launcher):
    build its worker, report readiness (or the error), serve."""
    # The child's modules are imported by now (the entry's module, before it called this).
    spawn_imports_s = max(time.time() - ready.spawned_at, 0.0)
    configure_logging(log_level, name)
    # Ctrl-C reaches the whole process group; the launcher alone decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start = time.perf_counter()
    try:
        worker = build()
    except Exception as e:
        logger.exception("%s failed to start", name)
        ready.conn.send(StartFailure(f"{type(e).__name__}: {e}"))
        ready.conn.close()
        sys.exit(1)
    ready.conn.send(
        ReadyReport(
            os.getpid(),
            round(spawn_imports_s, 3),
            round(time.perf_counter() - start, 3),
            worker.runner_info(),
        )
    )
    ready.conn.close()
    worker.run()
