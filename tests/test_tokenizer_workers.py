"""Several tokenizer workers on one port (--tokenizer-worker-num): connections spread over
them, every request's outputs reach the worker that sent it, the metrics count every worker's
requests, and the workers live and die with the server."""

from __future__ import annotations

import argparse
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, assert_a_death_takes_it_down, child_pids, still_alive

from srt.server_args import ServerArgs, ServerArgsError, default_tokenizer_workers

WORKERS = 3


def _generate(url: str, max_new_tokens: int) -> int:
    """A request on a connection of its own (so that any worker may take it)."""
    with httpx.Client(timeout=60) as client:
        resp = client.post(
            f"{url}/generate",
            json={
                "text": "hello",
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
            },
        )
    resp.raise_for_status()
    count: int = resp.json()["meta_info"]["completion_tokens"]
    return count


def _stream(url: str, max_tokens: int, events: list[str], started: threading.Event) -> None:
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    started.set()


def _leave_early(url: str) -> bool:
    """A stream whose client goes away after two events; whether it got them."""
    body = {"prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    events = 0
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                return True  # leaving the block closes the connection
    return False


def _answering_worker(url: str) -> int:
    with httpx.Client(timeout=30) as client:
        worker: int = client.get(f"{url}/get_server_info").json()["tokenizer"]["worker"]
    return worker


def _finished_requests(url: str) -> float:
    with httpx.Client(timeout=30) as client:
        text = client.get(f"{url}/metrics").text
    match = re.search(r'^srt_requests_total\{finish_reason="length"\} (\S+)$', text, re.M)
    assert match, text
    assert text.count("# TYPE srt_running_requests gauge") == 1, text
    return float(match.group(1))


def test_workers_share_the_port_and_go_down_with_the_server(
    tiny_llama: Path, tmp_path: Path
) -> None:
    srv = ServerProcess(
        # The scheduler and the runner poll 2 ms before they sleep (CUDA's way, on a CPU).
        ["--model-path", str(tiny_llama), "--tokenizer-worker-num", str(WORKERS)]
        + ["--busy-poll-ms", "2"],
        tmp_path / "server.log",
    )
    try:
        srv.wait_ready()
        info = srv.info()
        assert info["server_args"]["busy_poll_ms"] == 2
        names = [f"tokenizer{w}" for w in range(1, WORKERS)]
        children = child_pids(srv.proc.pid)
        assert {info["processes"][name]["pid"] for name in names} <= set(children)
        assert set(info["tokenizer"]["workers_cpu_s"]) == {"tokenizer", *names}

        # Each request on its own connection: all come back whole, whichever worker took it.
        counts = [3 + i % 7 for i in range(24)]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda n: _generate(srv.url, n), counts))
        assert got == counts
        # The kernel spreads connections over the workers (three, 30 connections: the
        # chance that one took them all is 3 in 3**30).
        assert len({_answering_worker(srv.url) for _ in range(30)}) > 1
        # Whichever worker is scraped counts every worker's requests.
        assert {_finished_requests(srv.url) for _ in range(6)} == {len(counts)}

        # Streams that leave early are aborted by their own worker: no KV slot stays held.
        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(lambda _: _leave_early(srv.url), range(6)))
        deadline = time.monotonic() + 30
        while (scheduler := srv.info()["scheduler"])["running_requests"]:
            assert time.monotonic() < deadline, scheduler
            time.sleep(0.1)
        assert scheduler["kv_slots_used"] == scheduler["kv_slots_cached"], scheduler

        # A signal: the open streams on every worker end with the reason and [DONE].
        streams = [([], threading.Event()) for _ in range(6)]
        readers = [
            threading.Thread(target=_stream, args=(srv.url, 1900, *s), daemon=True) for s in streams
        ]
        for reader in readers:
            reader.start()
        for _, started in streams:
            assert started.wait(60), srv.log()
        srv.proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
        assert srv.proc.wait(30) == 0, srv.log()
        for events, _ in streams:
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["message"] == "the server is shutting down", error
        assert not still_alive(children)
        assert not Path(info["ipc_dir"]).exists()
        log = srv.log()
        for name in names:
            assert f"{name} ready after" in log, log
        assert "Traceback" not in log, log
    finally:
        srv.stop()


def test_a_dying_worker_takes_the_server_down(tiny_llama: Path, tmp_path: Path) -> None:
    srv = ServerProcess(
        ["--model-path", str(tiny_llama), "--tokenizer-worker-num", "2"],
        tmp_path / "server.log",
    )
    try:
        srv.wait_ready()
        assert_a_death_takes_it_down(srv, "tokenizer1")
    finally:
        srv.stop()


def test_the_flag_and_its_vllm_name() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag in ("--tokenizer-worker-num", "--api-server-count"):
        args = ServerArgs.from_cli_args(parser.parse_args([flag, "4"]))
        assert args.tokenizer_worker_num == 4
    with pytest.raises(ServerArgsError, match="--tokenizer-worker-num: must be a positive"):
        ServerArgs(tokenizer_worker_num=-1).check()


def test_the_default_count_follows_the_hosts_cpus() -> None:
    assert [default_tokenizer_workers(cpus) for cpus in (1, 2, 7, 8, 16)] == [1, 1, 1, 2, 2]
    # Resolved as the args are made, from this host's CPUs (0 asks for it); a count given stays.
    assert ServerArgs().tokenizer_worker_num == default_tokenizer_workers()
    assert ServerArgs(tokenizer_worker_num=0).tokenizer_worker_num == default_tokenizer_workers()
    assert ServerArgs(tokenizer_worker_num=3).tokenizer_worker_num == 3
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([]))
    assert args.tokenizer_worker_num == default_tokenizer_workers()
