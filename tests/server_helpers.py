"""Start real server subprocesses for the server tests, and inspect their processes (Linux)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat_fields(stat: Path) -> list[str] | None:
    """The fields after the command name of a /proc/<pid>/stat file (state, ppid, ...), or
    None once the process is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_state(pid: int) -> str | None:
    """The /proc state letter of `pid` (R, S, Z...), or None if there is no such process."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return fields[0] if fields else None


def is_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


def child_pids(pid: int) -> list[int]:
    return [
        int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
        if (fields := _stat_fields(stat)) and int(fields[1]) == pid
    ]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None,
                 script: bool = False) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        entry = ["launch_server.py"] if script else ["-m", "srt.launch_server"]
        cmd = [sys.executable, *entry, "--device", "cpu", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> list[int]:
        """Poll /health until 200; returns every status code seen on the way."""
        seen: list[int] = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                seen.append(httpx.get(f"{self.url}/health", timeout=2).status_code)
            except httpx.TransportError:  # not listening yet
                pass
            if seen and seen[-1] == 200:
                return seen
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def info(self) -> dict:
        resp = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=30)
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its children die with it (parent-death signal)
                self.proc.wait()


def still_alive(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """The pids alive after `grace_s` (multiprocessing's resource tracker exits a moment after
    the launcher, when its pipe closes)."""
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid in pids if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
