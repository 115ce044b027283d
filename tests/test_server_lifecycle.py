"""Server process lifecycle: readiness, signals, a dying child, a model that cannot load."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import (
    REPO,
    ServerProcess,
    assert_a_death_takes_it_down,
    child_pids,
    free_port,
    still_alive,
)


def _wait_exit(srv: ServerProcess, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = srv.proc.wait(timeout)
    return code, time.monotonic() - start


def _start(tiny_llama: Path, tmp_path: Path, script: bool = False) -> ServerProcess:
    return ServerProcess(["--model-path", str(tiny_llama)], tmp_path / "server.log", script=script)


def _read_stream(srv: ServerProcess, events: list[str], started: threading.Event) -> None:
    body = {"prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    started.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_shuts_down_cleanly(tiny_llama: Path, tmp_path: Path, sig: signal.Signals) -> None:
    srv = _start(tiny_llama, tmp_path, script=True)  # `python launch_server.py`
    try:
        # Whatever answered while the children were starting was a 503 (whether the loop sees
        # any depends on how fast this machine starts them; the app test below always does).
        starting = []
        health = None
        while health != 200:
            assert srv.proc.poll() is None, srv.log()
            time.sleep(0.05)
            if not _listening(srv):
                continue
            models = httpx.get(f"{srv.url}/v1/models", timeout=5)
            health = httpx.get(f"{srv.url}/health", timeout=5).status_code
            if health == 503:
                starting.append(models)
        for resp in starting:
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200
        info = srv.info()
        children = child_pids(srv.proc.pid)
        assert {
            info["processes"]["scheduler"]["pid"],
            info["processes"]["model_runner"]["pid"],
        } <= set(children)
        ok = httpx.post(
            f"{srv.url}/generate",
            timeout=30,
            json={"text": "hi", "sampling_params": {"max_new_tokens": 3}},
        )
        assert ok.json()["meta_info"]["completion_tokens"] == 3

        # Open streams at the signal each get a final error event and [DONE].
        streams = [([], threading.Event()) for _ in range(3)]
        readers = [threading.Thread(target=_read_stream, args=(srv, *s)) for s in streams]
        for reader in readers:
            reader.start()
        for _, started in streams:
            assert started.wait(60), srv.log()
        srv.proc.send_signal(sig)
        for reader in readers:
            reader.join(60)
        code, _ = _wait_exit(srv, 30)
        assert code == 0, srv.log()
        for events, _ in streams:
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["message"] == "the server is shutting down", error
            assert error["type"] == "server_error"
        assert not still_alive(children)
        assert not Path(info["ipc_dir"]).exists()
        log = srv.log()
        for line in (
            "model_runner ready after",
            "scheduler ready after",
            "server ready in",
            f"received {sig.name}",
            "server stopped",
        ):
            assert line in log, log
        # One line for the streams it ended, not a traceback each.
        assert log.count("shutting down: ended 3 sequence(s) in flight") == 1, log
        assert "Traceback" not in log, log
    finally:
        srv.stop()


def test_every_endpoint_answers_503_until_ready(tiny_llama: Path) -> None:
    """The app in this process, before and after `mark_ready`: no timing involved."""
    from srt.ipc.channels import Endpoints
    from srt.ipc.reports import ServerStartup
    from srt.model_config import ModelConfig
    from srt.server.http.app import create_app
    from srt.server.tokenizer_manager import TokenizerManager
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(tiny_llama))
    endpoints = Endpoints.create()
    manager = TokenizerManager(args, endpoints, ModelConfig.from_path(str(tiny_llama)))

    async def answers(ready: bool) -> list[int]:
        transport = httpx.ASGITransport(app=create_app(manager))
        async with httpx.AsyncClient(transport=transport, base_url="http://srt") as client:
            models = await client.get("/v1/models")
            health = await client.get("/health")
            if ready:  # a completion now would wait for a scheduler there is none of
                return [models.status_code, health.status_code]
            completion = await client.post("/v1/completions", json={"prompt": "hi"})
            assert models.json()["error"]["code"] == "unavailable", models.text
            return [models.status_code, health.status_code, completion.status_code]

    try:
        assert asyncio.run(answers(ready=False)) == [503, 503, 503]
        manager.load_tokenizer()
        manager.mark_ready(64, 64, ServerStartup(0.0, time.time(), endpoints.dir, {}))
        assert asyncio.run(answers(ready=True)) == [200, 200]
    finally:
        manager.close()
        endpoints.remove()


def _listening(srv: ServerProcess) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", srv.port)) == 0


def test_runner_death_takes_the_server_down(tiny_llama: Path, tmp_path: Path) -> None:
    srv = _start(tiny_llama, tmp_path)  # `python -m srt.launch_server`
    try:
        srv.wait_ready()
        assert_a_death_takes_it_down(srv, "model_runner")
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


def test_a_tokenizer_that_cannot_load_stops_the_server(tiny_llama: Path, tmp_path: Path) -> None:
    # The tokenizer loads while the children start (its files were checked before): a broken
    # one still ends the server, cleanly, with one error line naming the directory.
    model = Path(shutil.copytree(tiny_llama, tmp_path / "bad-tokenizer"))
    (model / "tokenizer.json").write_text("{not json")
    srv = ServerProcess(["--model-path", str(model)], tmp_path / "server.log")
    try:
        code, _ = _wait_exit(srv, 60)
        assert code == 1, srv.log()
        errors = [line for line in srv.log().splitlines() if " ERROR " in line]
        assert len(errors) == 1 and f"cannot load a tokenizer from {model}" in errors[0], errors
        assert "server stopped (exit code 1)" in srv.log() and "Traceback" not in srv.log()
    finally:
        srv.stop()


def test_tokenizing_does_not_hold_up_the_event_loop(tiny_llama: Path, tmp_path: Path) -> None:
    """A request whose prompt takes long to prepare (here a chat template that loops for a few
    seconds on one message, standing in for a huge prompt's tokenization) is prepared off the
    event loop: /health and other requests are answered meanwhile."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    template = model / "chat_template.jinja"
    slow = (
        "{% if messages[0]['content'] == 'slow' %}{% for i in range(100000) %}"
        "{% for j in range(300) %}{% endfor %}{% endfor %}{% endif %}"
    )
    template.write_text(slow + template.read_text())
    srv = ServerProcess(["--model-path", str(model)], tmp_path / "server.log")
    try:
        srv.wait_ready()
        done = threading.Event()
        slow_status: list[int] = []

        def slow_request() -> None:
            # Refused once prepared (it asks for more than the context), so that its answer
            # follows the slow part at once, with no generation to wait for.
            resp = httpx.post(
                f"{srv.url}/v1/chat/completions",
                timeout=120,
                json={"messages": [{"role": "user", "content": "slow"}], "max_tokens": 10**6},
            )
            slow_status.append(resp.status_code)
            done.set()

        thread = threading.Thread(target=slow_request)
        thread.start()
        answered_meanwhile = 0
        while not done.is_set():
            ok = httpx.get(f"{srv.url}/health", timeout=120).status_code == 200
            answered_meanwhile += ok and not done.is_set()
        thread.join()
        assert slow_status == [400]
        # Round trips one after another while the slow one was being prepared: with the
        # template run on the event loop, none could have been answered after it began.
        assert answered_meanwhile >= 5, answered_meanwhile
    finally:
        srv.stop()


# ---- flags checked before anything starts ------------------------------------------------------


def _launch(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "srt.launch_server", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-total-tokens", "0"],
            "argument --max-total-tokens: must be a positive integer, got 0",
        ),
        (
            ["--context-length", "-5"],
            "argument --context-length: must be a positive integer, got -5",
        ),
        (["--max-running-requests", "0"], "argument --max-running-requests: must be a positive"),
        (["--port", "70000"], "argument --port: must be in [1, 65535], got 70000"),
        (["--busy-poll-ms", "-1"], "argument --busy-poll-ms: must be in [0, 10000] ms, got -1"),
        (
            ["--compile-threads", "-2"],
            "argument --compile-threads: must be a non-negative integer, got -2",
        ),
        (["--port", "0"], "argument --port: must be in [1, 65535], got 0"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--device", "tpu"], "argument --device: must be cpu, cuda or auto, got 'tpu'"),
        pytest.param(
            ["--device", "cuda"],
            "argument --device: cuda: CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
        ),
    ],
)
def test_a_bad_flag_fails_before_anything_starts(args: list[str], message: str) -> None:
    result = _launch(["--port", str(free_port()), *args])
    assert result.returncode == 2, result.stderr
    assert f"error: {message}" in result.stderr, result.stderr
    assert "[tokenizer]" not in result.stderr  # no log line: nothing was started


def test_log_level_is_case_insensitive(tiny_llama: Path) -> None:
    # Gets past the flags (and fails on the model directory, which is quick).
    result = _launch(["--log-level", "WARNING", "--model-path", str(tiny_llama / "missing")])
    assert result.returncode == 1 and "does not exist" in result.stderr, result.stderr


def test_a_port_in_use_fails_at_once_naming_it(tiny_llama: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = _launch(["--model-path", str(tiny_llama), "--port", str(port)])
        took = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert (
        f"error: argument --port: cannot listen on 127.0.0.1:{port}: Address already in use"
        in result.stderr
    ), result.stderr
    # The port is bound before torch or the model are loaded: it fails in well under a second
    # on an idle machine (5 s leaves room for a loaded CI runner, and is still less than what
    # importing torch, spawning the children and loading the tokenizer took before).
    assert took < 5, took
    assert "model_runner" not in result.stderr


def test_a_model_without_tokenizer_files_fails_in_one_line(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = Path(shutil.copytree(tiny_llama, tmp_path / "no-tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    # A context past the model's positions is a warning, given before that failure.
    result = _launch(
        ["--model-path", str(model), "--port", str(free_port()), "--context-length", "4096"]
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1 and f"{model} has no tokenizer files" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "model_runner" not in result.stderr
    assert any(
        "--context-length 4096 is larger than the model's max_position_embeddings 2048" in line
        for line in lines
    ), result.stderr


def test_busy_polling_is_on_with_a_cuda_runner_only() -> None:
    from srt.server_args import DEFAULT_BUSY_POLL_S, ServerArgs

    assert ServerArgs().busy_poll_s("cuda", cpus=16) == DEFAULT_BUSY_POLL_S
    assert ServerArgs().busy_poll_s("cuda", cpus=2) == 0.0  # no core left for the main process
    assert ServerArgs().busy_poll_s("cpu", cpus=16) == 0.0  # it would take the model's cores
    assert ServerArgs(busy_poll_ms=3).busy_poll_s("cpu") == 0.003
    assert ServerArgs(busy_poll_ms=0).busy_poll_s("cuda") == 0.0
