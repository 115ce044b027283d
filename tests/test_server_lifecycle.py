"""Server process lifecycle: readiness, signals, a dying child, a model that cannot load."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import httpx
from server_helpers import ServerProcess, child_pids, still_alive


def _wait_exit(srv: ServerProcess, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = srv.proc.wait(timeout)
    return code, time.monotonic() - start


def _start(tiny_llama: Path, tmp_path: Path, script: bool = False) -> ServerProcess:
    return ServerProcess(["--model-path", str(tiny_llama)], tmp_path / "server.log",
                         script=script)


def test_sigterm_shuts_down_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    srv = _start(tiny_llama, tmp_path, script=True)  # `python launch_server.py`
    try:
        statuses = srv.wait_ready()
        assert statuses[0] == 503  # answering before the children are ready
        info = srv.info()
        children = child_pids(srv.proc.pid)
        assert {info["processes"]["scheduler"]["pid"],
                info["processes"]["model_runner"]["pid"]} <= set(children)
        ok = httpx.post(f"{srv.url}/generate", timeout=30,
                        json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        assert ok.json()["meta_info"]["completion_tokens"] == 3

        srv.proc.send_signal(signal.SIGTERM)
        code, _ = _wait_exit(srv, 30)
        assert code == 0, srv.log()
        assert not still_alive(children)
        assert not Path(info["ipc_dir"]).exists()
        log = srv.log()
        for line in ("model_runner ready after", "scheduler ready after", "server ready in",
                     "received SIGTERM", "server stopped"):
            assert line in log, log
    finally:
        srv.stop()


def test_runner_death_takes_the_server_down(tiny_llama: Path, tmp_path: Path) -> None:
    srv = _start(tiny_llama, tmp_path)  # `python -m srt.launch_server`
    try:
        srv.wait_ready()
        info = srv.info()
        runner = info["processes"]["model_runner"]["pid"]
        children = child_pids(srv.proc.pid)
        os.kill(runner, signal.SIGKILL)
        code, took = _wait_exit(srv, 30)
        assert code != 0
        assert took < 5, f"took {took:.1f} s to notice"
        assert not still_alive(children)
        assert not Path(info["ipc_dir"]).exists()
        assert f"model_runner process (pid {runner}) died" in srv.log()
    finally:
        srv.stop()


def test_child_startup_failure_is_reported(tiny_llama: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_llama, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # the runner cannot load this
    srv = ServerProcess(["--model-path", str(broken)], tmp_path / "server.log")
    try:
        code, _ = _wait_exit(srv, 60)
        assert code == 1
        assert "model_runner failed to start" in srv.log(), srv.log()
    finally:
        srv.stop()
