"""Start real server subprocesses for the server tests, and inspect their processes (Linux)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from srt.bench.server_process import ServerProcess as BenchServerProcess
from srt.bench.server_process import free_port  # noqa: F401 (the tests take it from here)
from srt.process import proc_stat_fields

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120


def process_state(pid: int) -> str | None:
    """The /proc state letter of `pid` (R, S, Z...), or None if there is no such process."""
    fields = proc_stat_fields(pid)
    return fields[0] if fields else None


def is_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


def child_pids(pid: int) -> list[int]:
    return [
        int(proc.name)
        for proc in Path("/proc").glob("[0-9]*")
        if (fields := proc_stat_fields(int(proc.name))) and int(fields[1]) == pid
    ]


class ServerProcess(BenchServerProcess):
    """The benchmarks' server subprocess, on the CPU and run from this checkout."""

    def __init__(
        self, args: list[str], log_path: Path, api_key: str | None = None, script: bool = False
    ) -> None:
        entry = ("launch_server.py",) if script else ("-m", "srt.launch_server")
        super().__init__(
            ["--device", "cpu", *args], log_path, api_key=api_key, cwd=REPO, entry=entry
        )

    def wait_ready(self) -> list[int]:  # type: ignore[override]
        """Poll /health until 200; returns every status code seen on the way."""
        super().wait_ready(STARTUP_TIMEOUT_S)
        return self.health_codes


def still_alive(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """The pids alive after `grace_s` (multiprocessing's resource tracker exits a moment after
    the launcher, when its pipe closes)."""
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid in pids if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def assert_a_death_takes_it_down(srv: ServerProcess, name: str, notice_s: float = 5.0) -> None:
    """Kill the server's process `name` (as its startup record names it): the server must
    exit non-zero within `notice_s`, leave no process and no ipc directory behind, and say
    which process died."""
    info = srv.info()
    pid = info["processes"][name]["pid"]
    children = child_pids(srv.proc.pid)
    assert pid in children
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    assert srv.proc.wait(30) != 0
    assert time.monotonic() - start < notice_s, "took too long to notice"
    assert not still_alive(children)
    assert not Path(info["ipc_dir"]).exists()
    assert f"{name} process (pid {pid}) died" in srv.log()
