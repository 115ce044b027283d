"""The server driven as SGLang's and vLLM's benchmark clients drive it (their `bench_serving`
scripts, written again here): their request bodies as they send them, the fields they read
from each stream event and, after a run, from `/v1/models` and `/get_server_info`. A change
that would break those clients fails here. And `/generate` with incremental streaming."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess

from srt.command import main as srt_command
from srt.engine import Engine

PROMPTS = ["The lighthouse keeper woke", "Rain on the tin roof", "Seven ships", "a"]
NEW_TOKENS = 12
CONCURRENCY = 3


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    with Engine(model_path=str(tiny_llama), device="cpu") as eng:
        yield eng


@pytest.fixture(scope="module")
def want(engine: Engine) -> list[dict[str, Any]]:
    """Each prompt's greedy output, `ignore_eos`, as the clients ask for it."""
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    return engine.generate(prompt=PROMPTS, sampling_params=params)


def start(tiny_llama: Path, log: Path, *flags: str) -> ServerProcess:
    srv = ServerProcess(["--model-path", str(tiny_llama), *flags], log)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start(tiny_llama, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


def events(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, as both clients parse it: `data: ` lines, `[DONE]`
    skipped."""
    out = []
    for line in lines:
        chunk = line.strip().removeprefix("data: ")
        if chunk and chunk != "[DONE]":
            out.append(json.loads(chunk))
    return out


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        return [line async for line in resp.aiter_lines()]


def sglang_generate_body(prompt: str) -> dict[str, Any]:
    """SGLang's `--backend sglang` body, with the fields it sends as None and -1."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def completions_body(model: str, prompt: str) -> dict[str, Any]:
    """`--backend sglang-oai` and `--backend vllm`: /v1/completions."""
    return {
        "model": model,
        "prompt": prompt,
        "temperature": 0.0,
        "best_of": 1,
        "max_tokens": NEW_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }


def chat_body(model: str, prompt: str) -> dict[str, Any]:
    """`--backend vllm-chat` and `sglang-oai-chat`: /v1/chat/completions, no ignore_eos."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": NEW_TOKENS,
        "stream": True,
    }


def read_sglang(lines: list[str]) -> tuple[str, int]:
    """What SGLang's client keeps of a /generate stream: the last event's `text` (the whole
    output, by default) and `meta_info.completion_tokens`, which must grow event by event."""
    text, tokens = "", 0
    for data in events(lines):
        if data.get("text"):
            assert data["meta_info"]["completion_tokens"] > tokens or tokens == 0
            text, tokens = data["text"], data["meta_info"]["completion_tokens"]
    return text, tokens


def read_completions(lines: list[str]) -> tuple[str, int | None]:
    """The texts of `choices[0].text` joined, and `usage.completion_tokens` if any event had
    it (the clients read `data.get("usage") or {}`)."""
    text, tokens = "", None
    for data in events(lines):
        text += data["choices"][0]["text"]
        tokens = (data.get("usage") or {}).get("completion_tokens", tokens)
    return text, tokens


def read_chat(lines: list[str]) -> str:
    return "".join(
        data.get("choices", [{}])[0].get("delta", {}).get("content") or "" for data in events(lines)
    )


async def run_clients(server: ServerProcess) -> dict[str, list[Any]]:
    """Every prompt through each backend's request, `CONCURRENCY` at a time, as the clients'
    semaphore does; then what they read after the run."""
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()
        model = models["data"][0]["id"]  # how both clients find the model name

        async def one(path: str, body: dict[str, Any]) -> list[str]:
            async with limit:
                return await stream(client, path, body)

        jobs = {
            "sglang": [one("/generate", sglang_generate_body(p)) for p in PROMPTS],
            "completions": [one("/v1/completions", completions_body(model, p)) for p in PROMPTS],
            "chat": [one("/v1/chat/completions", chat_body(model, p)) for p in PROMPTS],
        }
        out = {name: list(await asyncio.gather(*tasks)) for name, tasks in jobs.items()}
        info = (await client.get("/get_server_info")).json()
        flushed = await client.post("/flush_cache")
    # SGLang's client after a run: a disaggregated server's decode entry, else the top level.
    if "decode" in info:
        info = info["decode"][0]
    out["after"] = [info["internal_states"][0].get("avg_spec_accept_length"), flushed]
    out["info"] = [info]
    return out


def test_the_field_clients_run_to_the_end(server: ServerProcess, want: list[dict]) -> None:
    got = asyncio.run(run_clients(server))
    for lines, expected in zip(got["sglang"], want, strict=True):
        assert read_sglang(lines) == (expected["text"], NEW_TOKENS)
    for lines, expected in zip(got["completions"], want, strict=True):
        text, tokens = read_completions(lines)
        assert text == expected["text"]
        assert tokens in (None, NEW_TOKENS)
    assert all(read_chat(lines) for lines in got["chat"])  # a chat template around the prompt
    accept_length, flushed = got["after"]
    assert accept_length is None  # no speculative decoding
    assert flushed.status_code == 200
    state = got["info"][0]["internal_states"][0]
    assert state["last_gen_throughput"] > 0


def test_incremental_streaming_sends_what_each_event_adds(
    tiny_llama: Path, tmp_path: Path, want: list[dict]
) -> None:
    srv = start(tiny_llama, tmp_path / "server.log", "--incremental-streaming-output")
    try:

        async def run() -> list[list[str]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                return [await stream(client, "/generate", sglang_generate_body(p)) for p in PROMPTS]

        for lines, expected in zip(asyncio.run(run()), want, strict=True):
            evs = events(lines)
            assert "".join(e["text"] for e in evs) == expected["text"]
            assert [i for e in evs for i in e["output_ids"]] == expected["output_ids"]
            counts = [e["meta_info"]["completion_tokens"] for e in evs]
            assert counts == sorted(counts) and counts[-1] == NEW_TOKENS  # totals, not deltas
            assert evs[-1]["meta_info"]["finish_reason"] == "length"
        assert srv.info()["server_args"]["incremental_streaming_output"] is True
    finally:
        srv.stop()


def test_the_installed_command_runs_each_module_main(capsys: pytest.CaptureFixture[str]) -> None:
    """`srt serve`, `srt bench NAME`, `srt tool NAME` are the modules' own command lines."""
    for argv, prog in (
        (["serve", "--help"], "python -m srt.launch_server"),
        (["bench", "serving", "--help"], "python -m srt.bench.serving"),
        (["bench", "attention", "--help"], "python -m srt.bench.attention"),
        (["tool", "make_tiny_model", "--help"], "python -m srt.tools.make_tiny_model"),
    ):
        with pytest.raises(SystemExit) as done:
            srt_command(argv)
        assert done.value.code == 0 and f"usage: {prog}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        srt_command(["bench", "nope"])
    assert "unknown bench 'nope'" in str(done.value.code)
    with pytest.raises(SystemExit) as done:
        srt_command([])
    assert done.value.code == 2 and "srt serve" in capsys.readouterr().out
    # Declared in the package metadata, so that installing srt puts it on the PATH.
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert 'srt = "srt.command:main"' in pyproject.read_text()
