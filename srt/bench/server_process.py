"""A real server in a subprocess, as the benchmarks (and the server tests) start it: launched
with `python -m srt.launch_server FLAGS`, timed from launch to its first `/health` 200."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from srt.tp_rank import free_port

_POLL_S = 0.02  # the resolution of the time to ready


def add_server_flags_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """Server flags after `--` on a benchmark's command line (`server_flags(ns)` reads them)."""
    parser.add_argument("server_flags", nargs=argparse.REMAINDER, help=help)


def server_flags(ns: argparse.Namespace) -> list[str]:
    rest: list[str] = ns.server_flags
    return rest[1:] if rest[:1] == ["--"] else rest


class ServerProcess:
    """`python -m srt.launch_server FLAGS --port P`, its output in `log_path`.

    `env` adds to (or, with a value of None, removes from) this process's environment."""

    def __init__(
        self,
        flags: list[str],
        log_path: Path,
        *,
        api_key: str | None = None,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        entry: tuple[str, ...] = ("-m", "srt.launch_server"),
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, *entry, "--port", str(self.port), *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = dict(os.environ)
        for name, value in (env or {}).items():
            if value is None:
                full_env.pop(name, None)
            else:
                full_env[name] = value
        self.health_codes: list[int] = []  # every /health status seen while waiting
        self.ready_s: float | None = None
        with open(log_path, "wb") as log:
            self.launched = time.perf_counter()
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Poll /health until 200; returns the seconds from launch to that answer."""
        deadline = self.launched + timeout_s
        with httpx.Client(timeout=2) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode}; its log "
                        f"({self.log_path}):\n{self.log()[-4000:]}"
                    )
                try:
                    self.health_codes.append(client.get(f"{self.url}/health").status_code)
                except httpx.TransportError:  # not listening yet
                    pass
                if self.health_codes and self.health_codes[-1] == 200:
                    self.ready_s = time.perf_counter() - self.launched
                    return self.ready_s
                time.sleep(_POLL_S)
        raise TimeoutError(
            f"server not ready after {timeout_s} s; its log ({self.log_path}):"
            f"\n{self.log()[-4000:]}"
        )

    def info(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=30)
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 30 s); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its children die with it (parent-death signal)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
