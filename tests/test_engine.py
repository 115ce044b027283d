"""The offline Engine on the tiny llama: batching, chunked prefill, prefix caching and a small
KV pool all give the ids each prompt gets alone; stop conditions; API shape and bad input."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from srt import Engine
from srt.server_args import ServerArgs
from srt.tools.make_tiny_model import CORPUS

PROMPTS = ["a", "The lighthouse keeper", "héllo ✓ 12345", CORPUS[:160]]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def make_engine(path: Path, **kwargs: Any) -> Engine:
    return Engine(model_path=str(path), device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[Engine]:
    """The reference: no prefix caching, prompts prefilled whole."""
    with make_engine(tiny_llama, enable_prefix_caching=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def alone(engine: Engine) -> dict[str, list[int]]:
    """Greedy ids of each prompt generated on its own."""
    return {p: engine.generate(prompt=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS}


@pytest.fixture(scope="module")
def full(engine: Engine) -> dict[str, Any]:
    """32 greedy tokens of one prompt, ignoring eos: the run the stop tests cut short."""
    return engine.generate(
        prompt="The lighthouse keeper", sampling_params={**GREEDY, "max_new_tokens": 32}
    )


def ids_of(results: list[dict[str, Any]]) -> dict[str, list[int]]:
    return {p: r["output_ids"] for p, r in zip(PROMPTS, results, strict=True)}


# ---- one prompt or many, chunked or not, cached or not: the same ids -------------------------


def test_batch_equals_alone(engine: Engine, alone: dict[str, list[int]]) -> None:
    assert len({len(engine.tokenizer.encode(p)) for p in PROMPTS}) == len(PROMPTS)
    results = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
    assert ids_of(results) == alone
    for prompt, result in zip(PROMPTS, results, strict=True):
        meta = result["meta_info"]
        assert meta["prompt_tokens"] == len(engine.tokenizer.encode(prompt))
        assert meta["completion_tokens"] == 16 and meta["finish_reason"] == "length"
        assert result["text"] == engine.tokenizer.decode(
            result["output_ids"], skip_special_tokens=True
        )


def test_chunked_prefill_equals_unchunked(tiny_llama: Path, alone: dict[str, list[int]]) -> None:
    with make_engine(tiny_llama, chunked_prefill_size=8, enable_prefix_caching=False) as eng:
        assert ids_of(eng.generate(prompt=PROMPTS, sampling_params=GREEDY)) == alone
        longest = max(len(eng.tokenizer.encode(p)) for p in PROMPTS)
        assert eng.scheduler.info().prefill_steps >= -(-longest // 8)


def test_prefix_hit_gives_the_same_ids(tiny_llama: Path, engine: Engine) -> None:
    base = CORPUS[:200]
    extended = base + " and the sea"
    expected = engine.generate(prompt=extended, sampling_params=GREEDY)["output_ids"]
    with make_engine(tiny_llama) as eng:
        first = eng.generate(prompt=base, sampling_params=GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
        hit = eng.generate(prompt=extended, sampling_params=GREEDY)
        assert hit["output_ids"] == expected
        shared = len(eng.tokenizer.encode(base)) - 2  # the last tokens may merge differently
        assert hit["meta_info"]["cached_tokens"] >= shared
        again = eng.generate(prompt=extended, sampling_params=GREEDY)
        n = len(eng.tokenizer.encode(extended))
        assert again["meta_info"]["cached_tokens"] == n - 1  # all but the last prompt token
        assert again["output_ids"] == expected
        assert eng.flush_cache()
        cold = eng.generate(prompt=extended, sampling_params=GREEDY)
        assert cold["meta_info"]["cached_tokens"] == 0 and cold["output_ids"] == expected


def test_small_kv_pool_queues_requests(tiny_llama: Path, alone: dict[str, list[int]]) -> None:
    """Twelve requests need ~5x the KV the pool holds: they wait their turn, none fails."""
    prompts = PROMPTS * 3
    with make_engine(tiny_llama, max_total_tokens=96, chunked_prefill_size=16) as eng:
        demand = sum(len(eng.tokenizer.encode(p)) + 16 for p in prompts)
        assert demand > 4 * eng.scheduler.kv.allocator.capacity
        results = eng.generate(prompt=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == [alone[p] for p in prompts]
        assert all(r["meta_info"]["finish_reason"] == "length" for r in results)
        info = eng.scheduler.info()
        assert info.running_requests == info.queued_requests == 0
        assert info.kv_slots_free + info.kv_slots_cached == 96


# ---- stop conditions ---------------------------------------------------------------------------


def test_stop_string(engine: Engine, full: dict[str, Any]) -> None:
    # A stop string from the middle of the text the model writes when not stopped.
    match = re.search(r"[A-Za-z]{2}", full["text"][4:])
    assert match is not None, full["text"]
    stop = match.group()
    out = engine.generate(
        prompt="The lighthouse keeper",
        sampling_params={**GREEDY, "max_new_tokens": 32, "stop": ["@@@", stop]},
    )
    assert out["text"] == full["text"][: full["text"].index(stop)]
    assert out["meta_info"]["finish_reason"] == "stop"
    assert out["meta_info"]["matched_stop"] == stop
    n = len(out["output_ids"])
    assert out["output_ids"] == full["output_ids"][:n] and n < 32
    assert stop in engine.tokenizer.decode(out["output_ids"])  # it ran until the stop appeared
    assert not engine.scheduler.reqs  # and no further: the scheduler was told to stop it


def test_stop_token_ids(engine: Engine, full: dict[str, Any]) -> None:
    token = full["output_ids"][10]
    at = full["output_ids"].index(token)
    out = engine.generate(
        prompt="The lighthouse keeper",
        sampling_params={**GREEDY, "max_new_tokens": 32, "stop_token_ids": [token]},
    )
    assert out["output_ids"] == full["output_ids"][: at + 1]
    assert (out["meta_info"]["finish_reason"], out["meta_info"]["matched_stop"]) == ("stop", token)


@pytest.fixture(scope="module")
def eos_engine(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, full: dict[str, Any]
) -> Iterator[Engine]:
    """The tiny llama whose generation_config.json adds the 6th greedy token as an eos."""
    path = Path(shutil.copytree(tiny_llama, tmp_path_factory.mktemp("eos") / "model"))
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], full["output_ids"][5]]
    gen_file.write_text(json.dumps(gen))
    with make_engine(path) as eng:
        yield eng


def test_eos_and_ignore_eos(eos_engine: Engine, full: dict[str, Any]) -> None:
    eos = full["output_ids"][5]
    at = full["output_ids"].index(eos)
    params = {"max_new_tokens": 32, "temperature": 0.0}
    out = eos_engine.generate(prompt="The lighthouse keeper", sampling_params=params)
    assert out["output_ids"] == full["output_ids"][: at + 1]
    assert (out["meta_info"]["finish_reason"], out["meta_info"]["matched_stop"]) == ("stop", eos)
    out = eos_engine.generate(
        prompt="The lighthouse keeper", sampling_params={**params, "ignore_eos": True}
    )
    assert out["output_ids"] == full["output_ids"]
    assert out["meta_info"]["finish_reason"] == "length"


def test_max_new_tokens_zero_and_one(engine: Engine, full: dict[str, Any]) -> None:
    zero = engine.generate(
        prompt="The lighthouse keeper", sampling_params={**GREEDY, "max_new_tokens": 0}
    )
    assert (zero["text"], zero["output_ids"]) == ("", [])
    assert zero["meta_info"]["finish_reason"] == "length"
    assert zero["meta_info"]["completion_tokens"] == 0
    one = engine.generate(
        prompt="The lighthouse keeper", sampling_params={**GREEDY, "max_new_tokens": 1}
    )
    assert one["output_ids"] == full["output_ids"][:1]
    assert one["meta_info"]["finish_reason"] == "length"


def test_context_length_clamps_and_rejects(tiny_llama: Path, full: dict[str, Any]) -> None:
    with make_engine(tiny_llama, context_length=24) as eng:
        ids = eng.tokenizer.encode("The lighthouse keeper")
        # Unset, max_new_tokens is the default (128) cut to what the context leaves; set, it
        # must fit, as on the HTTP API (one front end, one rule).
        unset = {k: v for k, v in GREEDY.items() if k != "max_new_tokens"}
        out = eng.generate(input_ids=ids, sampling_params=unset)
        with pytest.raises(
            ValueError,
            match=f"the context length is 24 tokens, but the request asks for {len(ids) + 100}",
        ):
            eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 100})
        assert out["meta_info"]["completion_tokens"] == 24 - len(ids)
        assert out["output_ids"] == full["output_ids"][: 24 - len(ids)]
        assert out["meta_info"]["finish_reason"] == "length"
        with pytest.raises(ValueError, match="the prompt has 24 tokens; the context length is 24"):
            eng.generate(input_ids=list(range(24)))
        assert eng.get_server_info()["runner"]["context_length"] == 24


# ---- API shape and bad input -------------------------------------------------------------------


def test_single_prompt_gives_a_dict_a_list_gives_a_list(engine: Engine) -> None:
    params = {"max_new_tokens": 2}
    assert isinstance(engine.generate(prompt="x", sampling_params=params), dict)
    assert isinstance(engine.generate(input_ids=[5, 6], sampling_params=params), dict)
    many = engine.generate(prompt=["x", "y"], sampling_params=params)
    assert isinstance(many, list) and len(many) == 2
    nested = engine.generate(input_ids=[[5, 6]], sampling_params=[params])
    assert isinstance(nested, list) and len(nested) == 1
    assert engine.generate(prompt=[], sampling_params=params) == []
    result = many[0]
    assert set(result) == {"text", "output_ids", "meta_info"}
    assert {"finish_reason", "prompt_tokens", "completion_tokens"} <= set(result["meta_info"])


def test_logprobs_in_meta_info(engine: Engine) -> None:
    out = engine.generate(
        prompt="The lighthouse keeper",
        sampling_params={**GREEDY, "max_new_tokens": 5, "logprobs": True, "top_logprobs_num": 3},
    )
    meta = out["meta_info"]
    assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["output_top_logprobs"]) == 5
    for (logprob, token), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert len(top) == 3 and logprob <= 0
        assert top[0] == pytest.approx((logprob, token))  # greedy picks the most likely
        assert [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)
    plain = engine.generate(prompt="x", sampling_params={"max_new_tokens": 2})
    assert "output_token_logprobs" not in plain["meta_info"]


def test_engine_kwargs_are_server_args(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="unknown option\\(s\\): bogus_option"):
        Engine(model_path=str(tiny_llama), bogus_option=1)
    # Every ServerArgs field is accepted as a keyword.
    args = ServerArgs(model_path=str(tiny_llama), device="cpu", max_total_tokens=64)
    with Engine(**dataclasses.asdict(args)) as eng:
        info = eng.get_server_info()
        assert info["server_args"] == dataclasses.asdict(args)
        json.dumps(info)  # plain data
        assert info["runner"]["kv_slots"] == 64
        assert info["model"]["architecture"] == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"top_p": 0}, "top_p must be in \\(0, 1\\], got 0"),
        ({"top_k": 0}, "top_k must be -1 or in \\[1, 512\\] \\(the vocabulary\\), got 0"),
        ({"top_k": 2**63}, "top_k must be -1 or in \\[1, 512\\]"),
        ({"top_k": 513}, "top_k must be -1 or in \\[1, 512\\]"),
        ({"temperature": float("inf")}, "temperature must be >= 0, got inf"),
        ({"ignore_eos": "false"}, "ignore_eos must be a boolean, got 'false'"),
        ({"skip_special_tokens": 0}, "skip_special_tokens must be a boolean, got 0"),
        ({"logprobs": "yes"}, "logprobs must be a boolean, got 'yes'"),
        ({"stop": ["x"] * 65}, "stop takes at most 64 strings, got 65"),
        ({"stop": ["x" * 1025]}, "stop strings must be at most 1024 characters"),
        ({"stop": ["\ud800"]}, "stop must be valid Unicode"),
        ({"min_p": 1.0}, "min_p must be in \\[0, 1\\), got 1.0"),
        ({"max_new_tokens": -1}, "max_new_tokens must be a non-negative integer, got -1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be a non-negative integer, got 2.5"),
        ({"stop": [""]}, "stop must be a non-empty string or a list of them"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids in \\[0, 512\\)"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids must be a list of token ids"),
        ({"seed": "x"}, "seed must be a 64-bit integer, got 'x'"),
        ({"seed": 2**64}, "seed must be a 64-bit integer"),
        ({"top_logprobs_num": 2}, "top_logprobs_num needs logprobs: true"),
        ({"logprobs": True, "top_logprobs_num": 21}, "top_logprobs_num must be in \\[0, 20\\]"),
        ({"temprature": 0.5}, "unknown sampling parameter\\(s\\): temprature"),
    ],
)
def test_invalid_sampling_params(engine: Engine, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt="x", sampling_params=params)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": []}, "the prompt is empty"),
        ({"input_ids": [1, -1]}, "invalid token id -1: ids must be in \\[0, 512\\)"),
        ({"input_ids": [[1], [512]]}, "invalid token id 512"),
        ({"input_ids": [[1, 2], 3]}, "input_ids mixes token ids and lists of token ids"),
        ({"input_ids": "1 2 3"}, "input_ids must be a list of token ids"),
        ({"prompt": [1, 2]}, "prompt must be a string or a list of strings"),
        ({"prompt": "ok \ud800"}, "the prompt is not valid Unicode"),
        ({"prompt": "x" * 10**7}, "the prompt has 10000000 characters; at most"),
        ({}, "give exactly one of prompt and input_ids"),
        ({"prompt": "x", "input_ids": [1]}, "give exactly one of prompt and input_ids"),
        ({"prompt": ["x", "y"], "sampling_params": [{}]}, "sampling_params list must match"),
    ],
)
def test_bad_input(engine: Engine, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


def test_a_failed_batch_leaves_nothing_behind(engine: Engine) -> None:
    with pytest.raises(ValueError, match="invalid token id"):
        engine.generate(input_ids=[[1, 2, 3], [4, 99999]])  # the first was already queued
    assert not engine.scheduler.reqs and not engine.scheduler.has_work
    info = engine.scheduler.info()
    assert info.kv_slots_free == info.kv_slots_total
    assert engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})


def test_stream_interval_changes_no_result(engine: Engine, tiny_llama: Path) -> None:
    """--stream-interval 3 sends tokens in threes: the same ids, text, logprobs and stop
    string cut as one token at a time."""
    requests = [
        {**GREEDY, "max_new_tokens": 11, "logprobs": True, "top_logprobs_num": 2},
        {**GREEDY, "max_new_tokens": 12},
    ]
    prompts = ["The lighthouse keeper", "A gull"]
    expected = [
        engine.generate(prompt=p, sampling_params=r) for p, r in zip(prompts, requests, strict=True)
    ]
    # A stop string from the text itself, where a chunk of three may carry past it.
    stop = expected[1]["text"][5:8]
    requests[1]["stop"] = [stop]
    expected[1] = engine.generate(prompt=prompts[1], sampling_params=requests[1])
    with make_engine(tiny_llama, enable_prefix_caching=False, stream_interval=3) as chunky:
        got = [
            chunky.generate(prompt=p, sampling_params=r)
            for p, r in zip(prompts, requests, strict=True)
        ]
    for g, e in zip(got, expected, strict=True):
        assert g["text"] == e["text"] and g["output_ids"] == e["output_ids"]
        assert g["meta_info"]["finish_reason"] == e["meta_info"]["finish_reason"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert (key in g["meta_info"]) == (key in e["meta_info"])
            if key in e["meta_info"]:
                got_flat = np.array(g["meta_info"][key], dtype=float).ravel()
                assert got_flat == pytest.approx(np.array(e["meta_info"][key], float).ravel())
    assert got[1]["meta_info"]["finish_reason"] == "stop"
