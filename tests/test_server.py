"""The HTTP API against a real three-process server on the tiny model (CPU)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file
from server_helpers import ServerProcess

openai = pytest.importorskip("openai")

from srt.engine import Engine  # noqa: E402
from srt.server.hf_tokenizer import load_tokenizer  # noqa: E402

API_KEY = "sk-test-key"
PROMPT = "The lighthouse keeper woke before the gulls"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # A tc compiler with no tc_piecewise phase is ignored with a warning (SGLang's way).
    srv = ServerProcess(
        ["--model-path", str(tiny_llama), "--cuda-graph-tc-compiler", "inductor"],
        log,
        api_key=API_KEY,
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    with Engine(model_path=str(tiny_llama), device="cpu") as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def post(
    server: ServerProcess, path: str, body: dict | None = None, content: bytes | None = None
) -> httpx.Response:
    if body is not None:  # JSON's \u escapes, so that lone surrogates can be sent
        content = json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        timeout=60,
        headers={**server.headers, "Content-Type": "application/json"},
    )


def chat_ids(tiny_llama: Path, messages: list[dict]) -> list[int]:
    tok = load_tokenizer(tiny_llama)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_models_health_and_api_key(server: ServerProcess, model: str, tiny_llama: Path) -> None:
    assert model == str(tiny_llama)
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    for path in ("/v1/models", "/get_server_info", "/metrics"):
        resp = httpx.get(f"{server.url}{path}")
        assert resp.status_code == 401, path
        assert resp.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401


def test_api_key_is_checked_first_and_everywhere(server: ServerProcess) -> None:
    # Before the body is parsed: a malformed body without the key is a 401, not a 400.
    bad_json = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": ',
        headers={"Content-Type": "application/json"},
    )
    assert bad_json.status_code == 401, bad_json.text
    assert bad_json.json()["error"]["code"] == "invalid_api_key"
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
        assert httpx.get(f"{server.url}{path}", headers=server.headers).status_code == 200, path
    # The scheme is case-insensitive (RFC 7235); the key is not.
    for scheme in ("bearer", "BEARER", "bEaReR"):
        resp = httpx.get(
            f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}
        )
        assert resp.status_code == 200, scheme
    wrong_case = httpx.get(
        f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY.upper()}"}
    )
    assert wrong_case.status_code == 401


def test_a_tc_compiler_no_phase_uses_is_only_a_warning(server: ServerProcess) -> None:
    assert "--cuda-graph-tc-compiler inductor is ignored" in server.log()
    assert (
        post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).json()[
            "meta_info"
        ]["completion_tokens"]
        == 2
    )


def test_the_scheduler_process_loads_no_tokenizer(server: ServerProcess) -> None:
    # Stop strings are matched where the text is: the scheduler works on ids alone.
    pid = server.info()["processes"]["scheduler"]["pid"]
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "tokenizers" not in maps and "numpy" in maps


def test_greedy_matches_engine(
    client: openai.OpenAI, model: str, engine: Engine, server: ServerProcess, tiny_llama: Path
) -> None:
    params = {"max_new_tokens": 16, "temperature": 0}
    want = engine.generate(prompt=PROMPT, sampling_params=params)
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == want["text"]
    assert got.usage.completion_tokens == want["meta_info"]["completion_tokens"]
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]

    native = post(server, "/generate", {"text": PROMPT, "sampling_params": params}).json()
    assert native["output_ids"] == want["output_ids"]
    assert native["text"] == want["text"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want_chat = engine.generate(input_ids=chat_ids(tiny_llama, messages), sampling_params=params)
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    assert chat.choices[0].message.content == want_chat["text"]
    assert chat.choices[0].message.role == "assistant"


def test_streaming_equals_non_streaming(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Tell me about the library"}]
    full_chat = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=20, temperature=0
    )
    stream = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full_chat.choices[0].message.content
    assert stream[-1].usage == full_chat.usage


def test_native_generate_stream_and_batch(server: ServerProcess, engine: Engine) -> None:
    params = {"max_new_tokens": 6, "temperature": 0}
    want = engine.generate(prompt=["a", "bb"], sampling_params=params)
    batch = post(server, "/generate", {"text": ["a", "bb"], "sampling_params": params}).json()
    assert [b["output_ids"] for b in batch] == [w["output_ids"] for w in want]
    ids = want[0]["output_ids"]
    by_ids = post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": params}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == 3

    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        headers=server.headers,
        timeout=60,
        json={"text": "a", "sampling_params": params, "stream": True},
    ) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])  # each event holds the text and ids so far, SGLang style
    assert last["output_ids"] == ids and last["meta_info"]["finish_reason"] == "length"


def test_a_batch_is_prefilled_in_one_step(server: ServerProcess) -> None:
    """A call's prompts reach the scheduler as one message: admitted in the same turn, one
    prefill step takes them all (one message each could be split over several)."""
    since = server.info()["clock_s"]
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(6)]
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    batch = post(server, "/generate", {"input_ids": prompts, "sampling_params": params})
    assert batch.status_code == 200 and len(batch.json()) == 6
    window = httpx.get(
        f"{server.url}/get_server_info", headers=server.headers, params={"timeline_since": since}
    ).json()
    extend = window["scheduler"]["timeline"]["kinds"]["extend"]
    assert (extend["steps"], extend["requests_mean"], extend["tokens_mean"]) == (1, 6, 24)


def test_n_seed_stop_and_logprobs(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 24

    greedy = (
        client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    start = next(
        k
        for k in range(2, len(greedy) - 3)
        if greedy[k : k + 3].isalpha() and greedy.index(greedy[k : k + 3]) == k
    )
    stop = greedy[start : start + 3]
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == greedy[:start]
    assert cut.choices[0].finish_reason == "stop"

    lp = (
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_a_stop_string_ends_the_request_in_the_scheduler_too(
    client: openai.OpenAI, model: str, server: ServerProcess
) -> None:
    # The scheduler sees ids only: the tokenizer side, which matched the stop string, aborts
    # the request there, which frees its KV slots long before max_tokens.
    greedy = (
        client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    stop = next(
        greedy[k : k + 3]
        for k in range(2, len(greedy) - 3)
        if greedy[k : k + 3].isalpha() and greedy.index(greedy[k : k + 3]) == k
    )
    before = server.info()["scheduler"]["generated_tokens"]
    cut = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=1900,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 24
    assert _wait_for(lambda: server.info()["scheduler"]["running_requests"] == 0)
    assert server.info()["scheduler"]["generated_tokens"] - before < 100


def test_64_concurrent_streams(server: ServerProcess, model: str) -> None:
    before = server.info()["scheduler"]
    asked = [4 + i % 13 for i in range(64)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=model,
            prompt=f"Story {i}: the garden",
            max_tokens=asked[i],
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return usage.completion_tokens, finish

    async def run() -> list[tuple[int, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert [r[0] for r in results] == asked
    assert all(r[1] == "length" for r in results)
    after = server.info()["scheduler"]
    assert after["generated_tokens"] - before["generated_tokens"] == sum(asked)
    assert after["decode_steps"] - before["decode_steps"] < sum(asked) / 2  # batched
    assert after["running_requests"] == after["queued_requests"] == 0


def mixed_streams_equal_the_engine(server: ServerProcess, engine: Engine) -> None:
    """Streams that start together and stop at different steps (lengths, a stop token,
    seeded sampling) get the Engine's ids (one step at a time, in process), while other
    streams are dropped mid-way; every KV slot comes back."""
    greedy = {"temperature": 0, "ignore_eos": True}
    probe = engine.generate(input_ids=[5, 6, 7], sampling_params={**greedy, "max_new_tokens": 8})
    stop_token = probe["output_ids"][3]
    jobs = [([5, 6, 7], {**greedy, "max_new_tokens": 8, "stop_token_ids": [stop_token]})]
    for i in range(11):
        prompt = [(13 * i + 7 * j) % 400 + 1 for j in range(2 + 5 * i)]
        params = {**greedy, "max_new_tokens": 3 + 2 * i}
        if i % 3 == 1:
            params = {**params, "temperature": 0.9, "top_k": 40, "seed": 1000 + i}
        jobs.append((prompt, params))
    want = engine.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs])
    dropped = [[(3 * i + j) % 300 + 1 for j in range(6)] for i in range(4)]

    async def stream(
        client: httpx.AsyncClient, prompt: list[int], params: dict, drop_after: int | None
    ) -> dict:
        body = {"input_ids": prompt, "sampling_params": params, "stream": True}
        last: dict = {}
        async with client.stream("POST", f"{server.url}/generate", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    last, events = json.loads(line[6:]), events + 1
                    if events == drop_after:
                        break  # the client goes away mid-stream
        return last

    async def run() -> list[dict]:
        async with httpx.AsyncClient(headers=server.headers, timeout=120) as client:
            finished = [stream(client, p, params, None) for p, params in jobs]
            left = [stream(client, p, {**greedy, "max_new_tokens": 500}, 3) for p in dropped]
            return await asyncio.gather(*finished, *left)

    got = asyncio.run(run())
    for i, w in enumerate(want):
        assert got[i]["output_ids"] == w["output_ids"], i
        assert got[i]["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], i
    assert want[0]["meta_info"]["finish_reason"] == "stop"
    assert all(len(g["output_ids"]) < 500 for g in got[len(jobs) :])
    assert _wait_for(lambda: server.info()["scheduler"]["running_requests"] == 0)
    after = server.info()["scheduler"]
    assert after["queued_requests"] == 0 and after["kv_slots_used"] == after["kv_slots_cached"]
    assert httpx.post(f"{server.url}/flush_cache", headers=server.headers).json()["success"]
    assert server.info()["scheduler"]["kv_slots_used"] == 0


def test_overlapped_streams_equal_the_engine(server: ServerProcess, engine: Engine) -> None:
    assert server.info()["server_args"]["disable_overlap_schedule"] is False  # the default
    mixed_streams_equal_the_engine(server, engine)


def test_one_step_at_a_time_streams_equal_the_engine(
    tiny_llama: Path, tmp_path: Path, engine: Engine
) -> None:
    srv = ServerProcess(
        ["--model-path", str(tiny_llama), "--disable-overlap-schedule"], tmp_path / "server.log"
    )
    try:
        srv.wait_ready()
        assert srv.info()["server_args"]["disable_overlap_schedule"] is True
        mixed_streams_equal_the_engine(srv, engine)
    finally:
        srv.stop()


def test_null_means_the_default(server: ServerProcess) -> None:
    # As in the OpenAI API: an optional field sent as null is as if not sent.
    plain = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 3,
            "stream": None,
            "temperature": None,
            "top_p": None,
            "n": None,
            "stop": None,
            "seed": None,
            "logprobs": None,
            "stream_options": None,
            "top_k": None,
        },
    )
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 3
    assert plain.json()["choices"][0]["logprobs"] is None
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "logprobs": None,
            "top_logprobs": None,
            "stream": None,
            "ignore_eos": None,
            "max_completion_tokens": None,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    native = post(
        server,
        "/generate",
        {
            "text": "hi",
            "stream": None,
            "sampling_params": {
                "max_new_tokens": 3,
                "temperature": None,
                "stop": None,
                "ignore_eos": None,
            },
        },
    )
    assert native.status_code == 200, native.text


def test_seeds_use_all_64_bits(server: ServerProcess) -> None:
    def ids(seed: int) -> list[int]:
        resp = post(
            server,
            "/generate",
            {
                "text": PROMPT,
                "sampling_params": {
                    "max_new_tokens": 12,
                    "temperature": 1.0,
                    "seed": seed,
                    "ignore_eos": True,
                },
            },
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["output_ids"]

    assert ids(0) == ids(0)
    assert ids(0) != ids(2**32)  # seeds that differ only in their high bits
    assert ids(5) != ids(5 - 2**63)


def test_choices_of_a_seed_near_the_top_of_the_range(server: ServerProcess) -> None:
    seed = 2**63 - 1  # seed + choice would not be a 64-bit integer
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.0,
        "ignore_eos": True,
        "seed": seed,
    }
    resp = post(server, "/v1/completions", {**body, "n": 3})
    assert resp.status_code == 200, resp.text
    texts = [c["text"] for c in resp.json()["choices"]]
    assert len(set(texts)) == 3  # each choice draws its own stream
    alone = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert texts[0] == alone  # the first choice is the seed's own
    again = post(server, "/v1/completions", {**body, "n": 3}).json()["choices"]
    assert [c["text"] for c in again] == texts


def test_a_body_over_the_limit_is_413_before_it_is_read(server: ServerProcess) -> None:
    # A 64 MiB body is announced and none of it sent: the answer comes from the headers alone.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: srt\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(64 << 20).encode() + b"\r\n\r\n{"
        )
        status_line = conn.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"413", status_line
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


HUGE_PROMPT = "word " * 40_000  # 200k characters: more than 2048 tokens could ever hold

BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', "malformed JSON"),
    ("/v1/completions", [], "the request body must be a JSON object"),
    ("/v1/completions", b"", "the request body must be a JSON object"),
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "context length"),
    ("/v1/completions", {"prompt": "word " * 3000}, "context length"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "does not exist"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "invalid token id"),
    ("/v1/completions", {"prompt": [1, -5]}, "invalid token id"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo is not supported"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9},
        "context length",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "model": "nope"},
        "does not exist",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
        "presence_penalty is not supported",
    ),
    ("/generate", {"input_ids": [-1]}, "invalid token id"),
    ("/generate", {"input_ids": [1, 2], "text": "hi"}, "exactly one"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    # Integers far out of range are bounded here (a top_k past int64 used to kill the
    # scheduler process, and the server with it).
    ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, "top_k must be -1 or in [1, 512]"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63},
        "top_k must be -1 or in [1, 512]",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**63}}, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 513}}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed must be a 64-bit integer"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**20}, "logprobs must be in [0, 20]"),
    ("/v1/completions", {"prompt": "hi", "n": 10**20}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, "context length"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 10**20, "logprobs": True},
        "top_logprobs",
    ),
    # Text that no tokenizer can encode.
    ("/v1/completions", {"prompt": "hi \ud800"}, "the prompt is not valid Unicode"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "the prompt is not valid Unicode"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a\ud800b"}]},
        "a message is not valid Unicode",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
        "a message is not valid Unicode",
    ),
    ("/generate", {"text": "\ud800"}, "the prompt is not valid Unicode"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop must be valid Unicode"),
    # Booleans are booleans on /generate as on /v1 (a string "false" acted as true).
    (
        "/generate",
        {"text": "hi", "sampling_params": {"skip_special_tokens": "false"}},
        "skip_special_tokens must be a boolean",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"ignore_eos": "false"}},
        "ignore_eos must be a boolean",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"logprobs": "false"}},
        "logprobs must be a boolean",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"logprobs": 1}}, "logprobs"),
    ("/generate", {"text": "hi", "sampling_params": "fast"}, "sampling_params"),
    ("/generate", {"text": "hi", "stream": "false"}, "stream"),
    # Size bounds: stop strings (count and length) and the prompt, counted in characters
    # before anything is tokenized.
    (
        "/v1/completions",
        {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]},
        "stop takes at most 64 strings",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "stop": ["x" * 1025]},
        "stop strings must be at most 1024 characters",
    ),
    ("/v1/completions", {"prompt": HUGE_PROMPT}, "the prompt has 200000 characters"),
    ("/generate", {"text": HUGE_PROMPT}, "the prompt has 200000 characters"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": HUGE_PROMPT}]},
        "a message has 200000 characters",
    ),
]


@pytest.mark.parametrize(
    "path,body,message", BAD_REQUESTS, ids=[f"{p}:{m}" for p, _, m in BAD_REQUESTS]
)
def test_bad_input_is_400_and_server_keeps_serving(
    server: ServerProcess,
    path: str,
    body: object,
    message: str,
) -> None:
    if isinstance(body, bytes):
        resp = post(server, path, content=body)
    else:
        resp = post(server, path, body)  # type: ignore[arg-type]
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert message in error["message"] or message == error["param"], error
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


SAME_RULES = [
    {"text": PROMPT, "sampling_params": {"top_k": 2**63}},
    {"text": PROMPT, "sampling_params": {"ignore_eos": "false"}},
    {"text": PROMPT, "sampling_params": {"stop": ["x"] * 65}},
    {"text": PROMPT, "sampling_params": {"max_new_tokens": 10**9}},
    {"text": PROMPT, "sampling_params": {"seed": 2**64}},
    {"text": PROMPT, "sampling_params": {"temperature": float("nan")}},
    {"text": PROMPT, "sampling_params": {"typo": 1}},
    {"text": [PROMPT, PROMPT], "sampling_params": [{}]},
    {"text": "\ud800"},
    {"input_ids": [[1, 2], [512]]},
    {"input_ids": list(range(1, 300)) * 7},
]


@pytest.mark.parametrize("request_body", SAME_RULES, ids=range(len(SAME_RULES)))
def test_engine_and_server_share_one_front_end(
    server: ServerProcess, engine: Engine, request_body: dict
) -> None:
    """Engine.generate and /generate refuse the same requests with the same words."""
    kwargs = dict(request_body)
    if "text" in kwargs:
        kwargs["prompt"] = kwargs.pop("text")
    with pytest.raises(ValueError) as refused:
        engine.generate(**kwargs)
    resp = post(server, "/generate", request_body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == str(refused.value)


def test_engine_and_server_resolve_an_unset_max_new_tokens_alike(
    server: ServerProcess, engine: Engine
) -> None:
    ids = list(range(1, 300)) * 6 + list(range(1, 200))  # 1993 of 2048 tokens: 55 are left
    params = {"temperature": 0, "ignore_eos": True}
    want = engine.generate(input_ids=ids, sampling_params=params)
    got = post(server, "/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert got["meta_info"]["completion_tokens"] == want["meta_info"]["completion_tokens"] == 55
    assert got["output_ids"] == want["output_ids"]


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_kv(server: ServerProcess) -> None:
    max_tokens = 1900  # far more than can finish in the test's lifetime of the stream
    before = server.info()["scheduler"]
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(5):
            next(line for line in lines if line.startswith("data: "))
        mid = server.info()["scheduler"]
        assert mid["running_requests"] == 1 and mid["kv_slots_used"] > mid["kv_slots_cached"]
    # The connection is closed here, with most of the tokens still to come.
    assert _wait_for(lambda: server.info()["scheduler"]["running_requests"] == 0)
    after = server.info()["scheduler"]
    assert after["generated_tokens"] - before["generated_tokens"] < max_tokens
    assert after["kv_slots_used"] == after["kv_slots_cached"]  # no slot held by a request
    flushed = httpx.post(f"{server.url}/flush_cache", headers=server.headers)
    assert flushed.json() == {"success": True}
    assert server.info()["scheduler"]["kv_slots_used"] == 0


def test_a_stream_whose_response_never_started_is_aborted() -> None:
    """A stream's sequences go to the scheduler before its response is made: a client gone
    before the response's first message still gets them aborted (the generation closed), and
    the events generator closed, though it never ran."""
    import asyncio

    from srt.server.http.common import EventStream

    class Sent:
        closes = 0

        def close(self) -> None:
            self.closes += 1

    started = []

    async def events():
        started.append(True)
        yield b"data: {}\n\n"

    async def gone(message: dict) -> None:
        raise OSError("the client went away")

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    generation = Sent()
    stream = EventStream(events(), generation)  # type: ignore[arg-type]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    with pytest.raises(OSError):
        asyncio.run(stream(scope, receive, gone))
    assert generation.closes == 1 and not started
    with pytest.raises(StopAsyncIteration):  # closed: it will never yield
        asyncio.run(stream.body_iterator.__anext__())


def test_startup_breakdown(server: ServerProcess, tiny_llama: Path) -> None:
    info = server.info()
    procs = info["processes"]
    parts = {name: list(p["breakdown"]) for name, p in procs.items()}
    assert parts == {
        "tokenizer": ["start_s", "imports_s", "app_s", "tokenizer_s", "other_s"],
        "scheduler": ["spawn_imports_s", "other_s"],
        "model_runner": [
            "spawn_imports_s",
            "device_init_s",
            "load_s",
            "custom_ops_s",
            "kv_alloc_s",
            "dynamo_s",
            "graph_load_s",
            "inductor_s",
            "flashinfer_jit_s",
            "compile_ahead_s",
            "warmup_s",
            "capture_s",
            "other_s",
        ],
    }
    for name, p in procs.items():
        assert all(v >= 0 for v in p["breakdown"].values()), (name, p)
        assert sum(p["breakdown"].values()) == pytest.approx(p["total_s"], abs=0.01), (name, p)
        assert p["total_s"] <= info["startup_s"], (name, p)
    # Each child's parts are the ones it reported.
    runner = procs["model_runner"]
    assert runner["breakdown"]["load_s"] == info["runner"]["load_s"]
    assert runner["breakdown"]["kv_alloc_s"] == info["runner"]["kv_alloc_s"]
    assert runner["breakdown"]["custom_ops_s"] == info["runner"]["custom_ops_s"]
    assert runner["breakdown"]["spawn_imports_s"] == runner["spawn_imports_s"] > 0
    assert procs["tokenizer"]["total_s"] == info["startup_s"]
    # Spawned before the launcher's own heavy imports, which come after its start.
    assert runner["spawned_after_s"] <= procs["tokenizer"]["breakdown"]["start_s"]
    assert procs["tokenizer"]["breakdown"]["tokenizer_s"] > 0
    # What the load read and its bandwidth, in the info and in the runner's ready line.
    weights = load_file(tiny_llama / "model.safetensors")
    assert info["runner"]["load_bytes"] == sum(t.nbytes for t in weights.values())
    assert info["runner"]["load_gb_s"] > 0
    ready = r"model_runner ready after .*; weights [\d.e-]+ GB at [\d.e-]+ GB/s;"
    assert re.search(ready, server.log()), server.log()


def test_server_info_and_metrics(server: ServerProcess) -> None:
    info = server.info()
    assert info["server_args"]["api_key"] == "<redacted>"
    procs = info["processes"]
    assert {"tokenizer", "scheduler", "model_runner"} <= set(procs)
    assert {"spawn_imports_s", "setup_s", "spawned_after_s", "ready_after_s"} <= set(
        procs["model_runner"]
    )
    assert {"load_s", "inductor_s", "capture_s"} <= set(procs["model_runner"]["breakdown"])
    assert info["runner"]["kv_slots"] == info["scheduler"]["kv_slots_total"]
    assert info["startup_s"] > 0 and Path(info["ipc_dir"]).is_dir()
    # Where a step's time goes, per process (earlier tests ran steps).
    scheduler = info["scheduler"]["timeline"]
    assert {"planned_to_sent", "sent_to_received"} <= set(scheduler["gaps_ms"])
    assert scheduler["period_ms"] > 0 and scheduler["kinds"]["decode"]["steps"] > 0
    assert {"received_to_launched", "launched_to_result_sent"} <= set(
        info["runner"]["timeline"]["gaps_ms"]
    )
    # Each step kind's own path, in the scheduler and the runner alike.
    for proc in ("scheduler", "runner"):
        kinds = info[proc]["timeline"]["kinds"]
        assert {"extend", "decode"} <= set(kinds), proc
        assert all(kinds[k]["gaps_ms"] for k in ("extend", "decode")), proc
    assert info["tokenizer"]["timeline"]["gaps_ms"]["received_to_routed"] >= 0
    # Each generate call's own marks: sent to the scheduler, its first token, its end.
    requests = info["tokenizer"]["requests"]
    assert requests["window_steps"] > 0
    gaps = requests["gaps_ms"]
    assert {"arrived_to_sent", "sent_to_first_token", "first_token_to_finished"} <= set(gaps)
    assert all(gap >= 0 for gap in gaps.values()), gaps
    # A window from a moment on: no step has begun since this answer's clock.
    later = httpx.get(
        f"{server.url}/get_server_info",
        headers=server.headers,
        params={"timeline_since": info["clock_s"] + 3600},
    ).json()
    for proc in ("scheduler", "runner", "tokenizer"):
        assert later[proc]["timeline"]["window_steps"] == 0, proc
        assert info[proc]["timeline"]["window_steps"] > 0, proc

    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['srt_requests_total{finish_reason="length"}'] > 0
    assert samples["srt_generation_tokens_total"] > 0
    assert samples["srt_prompt_tokens_total"] > 0
    assert samples["srt_time_to_first_token_seconds_count"] > 0
    assert samples["srt_inter_token_latency_seconds_count"] > 0
    for gauge in (
        "srt_running_requests",
        "srt_queued_requests",
        "srt_kv_cache_usage_ratio",
        "srt_captured_buckets",
        "srt_compile_seconds",
        "srt_startup_seconds",
    ):
        assert gauge in samples


def test_profile_the_runner(server: ServerProcess, tmp_path: Path) -> None:
    """SGLang's /start_profile and /stop_profile: the runner records its next steps, writes
    the trace, and says per step what it holds; bad values are 400 and it serves on."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    started = post(server, "/start_profile", {"output_dir": str(tmp_path), "num_steps": 4})
    assert started.status_code == 200, started.text
    assert started.json()["recording"] and started.json()["trace"].startswith(str(tmp_path))
    again = post(server, "/start_profile", {"num_steps": 2}).json()
    assert "already" in again["message"] and again["trace"] == started.json()["trace"]
    assert post(server, "/generate", body).status_code == 200  # 6 steps: the first 4 recorded
    done = post(server, "/stop_profile").json()  # it stopped itself after 4; this reads it
    assert not done["recording"] and done["steps"] == 4
    assert Path(done["trace"]).is_file() and done["trace"].endswith(".trace.json.gz")
    summary = done["summary"]
    assert summary["steps"] == 4 and summary["wall_ms_per_step"] > 0
    assert summary["top_host_ops"]  # the CPU's ops; on CUDA its kernels too
    # One that ended by its count is written by the next start, not lost.
    first = post(server, "/start_profile", {"output_dir": str(tmp_path / "a"), "num_steps": 2})
    assert post(server, "/generate", body).status_code == 200
    assert not Path(first.json()["trace"]).exists()  # written when asked for, not mid-run
    # Until /stop_profile: as many steps as ran.
    assert post(server, "/start_profile", {"output_dir": str(tmp_path / "b")}).status_code == 200
    assert Path(first.json()["trace"]).is_file()
    assert post(server, "/generate", body).status_code == 200
    open_ended = httpx.get(f"{server.url}/stop_profile", headers=server.headers).json()
    assert open_ended["steps"] == 6 and open_ended["summary"]["steps"] == 6
    for bad in ({"num_steps": 0}, {"activities": ["CPU"]}, {"output_dir": 5}):
        refused = post(server, "/start_profile", bad)
        assert refused.status_code == 400, (bad, refused.text)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    refused = post(server, "/start_profile", {"output_dir": str(blocked / "under")})
    assert refused.status_code == 400 and "directory" in refused.json()["error"]["message"]
    assert not post(server, "/stop_profile").json()["recording"]  # none was started
    assert post(server, "/generate", body).status_code == 200


def test_an_event_stays_one_line_whatever_the_text() -> None:
    """Text with the line breaks JSON leaves raw (NEL, U+2028, U+2029) and the ones it escapes
    still makes one event line for a line reader that splits as Python does (httpx's), and
    reads back as the same text."""
    from srt.server.http.common import sse_event

    text = "a\x85b\u2028c\u2029d\ne\rf\x1cg\x0bh"
    lines = [line for line in sse_event({"text": text}).decode().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == {"text": text}
