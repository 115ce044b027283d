"""The benchmarks end to end on the tiny model (CPU): each runs, and its JSON has the documented
keys with sane values (token counts exact). No timing assertions."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from server_helpers import ServerProcess

from srt.bench import (
    attention,
    cold_start,
    frontend,
    hf_baseline,
    one_batch,
    runner_ceiling,
    serving,
)
from srt.bench.runner_ceiling import RunnerFigures
from srt.bench.serving import RequestRecord, RequestSpec, metrics, run_load
from srt.model_config import ModelConfig
from srt.model_executor.model_loader import load_model
from srt.profiling import summarize_trace
from srt.tools import make_random_checkpoint, model_shapes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- one_batch -----------------------------------------------------------------------------


def test_one_batch_with_profile(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    results = tmp_path / "ob.jsonl"
    one_batch.main(
        [
            "--model-path",
            str(tiny_llama),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batch-size",
            "1",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--runs",
            "1",
            "--profile",
            str(tmp_path / "prof"),
            "--result-file",
            str(results),
        ]
    )
    rows = read_jsonl(results)
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_backend"] == "disabled" and r["device"] == "cpu"
        assert r["decode_ms_per_step"] > 0 and r["prefill_ms"] > 0
        assert r["decode_ms_overlapped"] > 0  # its ids were checked against the steps'
        assert r["decode_tok_s"] == pytest.approx(
            r["batch_size"] * 1000 / r["decode_ms_per_step"], rel=1e-2
        )
        prof = r["profile"]
        assert prof["steps"] == 4  # output_len - 1 decode steps, each annotated
        assert Path(prof["trace"]).is_file()
        assert prof["wall_ms_per_step"] > 0
        assert prof["kernels_per_step"] == 0  # no device on the CPU
        assert 0 < prof["host_ms_per_step"] <= prof["wall_ms_per_step"]
        assert r["machine"]["torch"] == torch.__version__
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[0].split()[:3] == ["model", "decode", "bs"]
    assert "profile of the warm decode steps" in out


# ---- frontend ------------------------------------------------------------------------------


def test_frontend_against_the_stand_in_scheduler(tmp_path: Path, capsys) -> None:
    """The main process alone: every request streams exactly its tokens from the stand-in's
    steps, and the figures add up (no more delivered than offered, an event per step at
    most, CPU per token and per event that agree with tokens per event)."""
    output = tmp_path / "frontend.json"
    frontend.main(
        ["--step-ms", "2", "--max-concurrency", "2", "4", "--min-requests", "8"]
        + ["--input-len", "16", "--output-len", "12", "--output-file", str(output)]
    )
    runs = json.loads(output.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [2, 4]
    for run in runs:
        assert run["errors"] == 0 and run["completed"] == run["num_requests"] >= 8
        assert run["total_output_tokens"] == 12 * run["num_requests"]
        assert 0 < run["of_offered"] <= 1.05
        assert run["num_requests"] <= run["events"] <= run["total_output_tokens"]
        per_event = run["front_cpu_us_per_token"] * run["tokens_per_event"]
        assert per_event == pytest.approx(run["front_cpu_us_per_event"], rel=0.02)
    assert "of offered" in capsys.readouterr().out


# ---- attention -----------------------------------------------------------------------------


def test_attention_on_the_cpu(tmp_path: Path, capsys) -> None:
    output = tmp_path / "attention.json"
    attention.main(
        [
            *("--device", "cpu", "--dtype", "float32", "--backends", "torch_native"),
            *("--model-shape", "llama-3.2-1b", "--decode-batch", "1", "2"),
            *("--decode-context", "4", "9", "--prefill-tokens", "3", "--runs", "2"),
            *("--warmup", "1", "--compile-cache-dir", str(tmp_path / "cache")),
            *("--output", str(output)),
        ]
    )
    data = json.loads(output.read_text())
    rows = data["rows"]
    keys = ("phase", "batch_size", "context", "prefix", "new_tokens")
    assert [tuple(r[k] for k in keys) for r in rows] == [
        ("decode", 1, 4, 3, 1),
        ("decode", 1, 9, 8, 1),
        ("decode", 2, 4, 3, 1),
        ("decode", 2, 9, 8, 1),
        ("prefill", 1, 3, 0, 3),  # from scratch
        ("prefill", 1, 6, 3, 3),  # over a prefix as long
    ]
    for r in rows:
        assert r["model_shape"] == "llama-3.2-1b" and r["backend"] == "torch_native"
        assert r["op_ms"] > 0 and r["op_ms_p90"] >= r["op_ms"] and r["plan_ms"] >= 0
        assert r["first_call_s"] > 0
        kv_bytes = 2 * r["batch_size"] * r["context"] * 8 * 64 * 4  # K and V, 8 heads of 64, fp32
        assert r["kv_gb_s"] == pytest.approx(kv_bytes / r["op_ms"] / 1e6, abs=0.051)
        assert (r["max_diff_vs"], r["max_diff"]) == ("torch_native", 0.0)  # itself
    assert data["machine"]["torch"] == torch.__version__
    assert capsys.readouterr().out.splitlines()[0].split()[:3] == ["shape", "backend", "phase"]


def test_attention_cases() -> None:
    decode, prefill = attention.ForwardMode.DECODE, attention.ForwardMode.EXTEND
    got = attention.cases([1, 8], [128], [64], "both")
    assert got == [
        attention.Case(decode, 1, 127, 1),
        attention.Case(decode, 8, 127, 1),
        attention.Case(prefill, 1, 0, 64),
        attention.Case(prefill, 1, 64, 64),
    ]
    assert [c.kv_tokens for c in got] == [128, 1024, 64, 128]
    assert attention.cases([1], [16], [8], "none")[-1] == attention.Case(prefill, 1, 0, 8)


def test_trace_summary_counts_kernels_and_waits() -> None:
    def event(name: str, cat: str, dur_us: float) -> dict:
        return {"ph": "X", "name": name, "cat": cat, "ts": 0, "dur": dur_us}

    steps = [event(one_batch.STEP_ANNOTATION, "user_annotation", 1000)] * 2
    kernels = [event("gemm", "kernel", 300)] * 4 + [event("rmsnorm", "kernel", 50)] * 6

    def linked(event_: dict, correlation: int) -> dict:
        return {**event_, "args": {"correlation": correlation}}

    copies = [
        linked(event("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 10), 7),
        linked(event("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 10), 8),
    ]
    waits = [
        event("cudaStreamSynchronize", "cuda_runtime", 100),
        linked(event("cudaMemcpyAsync", "cuda_runtime", 300), 7),  # waits for the result
        linked(event("cudaMemcpyAsync", "cuda_runtime", 20), 8),  # an upload: host work
        event("cudaLaunchKernel", "cuda_runtime", 5),
    ] * 2
    summary = summarize_trace(
        {"traceEvents": steps + kernels + copies + waits}, 10, one_batch.STEP_ANNOTATION
    )
    assert summary["steps"] == 2
    assert summary["wall_ms_per_step"] == 1.0
    assert summary["device_span_ms"] == 0.3  # all begin at 0; the longest lasts 300 us
    assert summary["kernels_per_step"] == 5  # memcpys are device time, not kernels
    assert summary["gpu_ms_per_step"] == pytest.approx((1200 + 300 + 20) / 2 / 1000)
    assert summary["wait_ms_per_step"] == pytest.approx(0.4)
    assert summary["host_ms_per_step"] == pytest.approx(0.6)  # the wall less the waits
    top = summary["top_kernels"]
    assert [k["name"] for k in top][:2] == ["gemm", "rmsnorm"]
    assert top[0]["calls_per_step"] == 2 and top[0]["ms_per_step"] == 0.6
    calls = summary["top_runtime_calls"]
    assert [c["name"] for c in calls] == [
        "cudaMemcpyAsync",
        "cudaStreamSynchronize",
        "cudaLaunchKernel",
    ]
    assert calls[0] == {"name": "cudaMemcpyAsync", "ms_per_step": 0.32, "calls_per_step": 2.0}
    assert summary["top_host_ops"] == []  # no torch ops in this trace


# ---- serving -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    srv = ServerProcess(["--model-path", str(tiny_llama), "--context-length", "64"], log)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def runner_results(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """one_batch's rows for the server fixture's configuration, from the subprocess the bench
    runs before a server it starts."""
    workdir = tmp_path_factory.mktemp("runner")
    flags = ["--model-path", str(tiny_llama), "--context-length", "64"]
    figures = runner_ceiling.measure(flags, [1, 3], 12, 6, workdir, timeout_s=300)
    assert figures.error is None, figures.error
    assert [r["batch_size"] for r in figures.rows] == [1, 3]
    assert all(r["prefill_ms"] > 0 and r["decode_ms_overlapped"] > 0 for r in figures.rows)
    return workdir / "one_batch.jsonl"


def test_serving_against_a_running_server(
    server: ServerProcess, runner_results: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "serving.json"
    serving.main(
        [
            "--base-url",
            server.url,
            "--num-prompts",
            "5",
            "3",
            "--max-concurrency",
            "1",
            "3",
            "--input-len",
            "12",
            "--range-ratio",
            "0.5",
            "--output-len",
            "6",
            "--runner-results",
            str(runner_results),
            "--output-file",
            str(out),
            *("--profile-steps", "3", "--profile-delay", "0", "--profile-dir", str(tmp_path)),
        ]
    )
    result = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 3]
    # The runner profiled three steps of each run, from the window's opening.
    for run in result["runs"]:
        profile = run["runner_profile"]
        assert profile["steps"] == 3 and profile["summary"]["steps"] == 3, profile
        assert Path(profile["trace"]).parent == tmp_path and profile["error"] is None
    assert len({run["runner_profile"]["trace"] for run in result["runs"]}) == 2  # one each
    # A burst per run, all in flight, before the first (the CPU server has no graph buckets).
    assert result["warmup"]["bursts"] == [1, 3] and result["warmup"]["errors"] == 0
    assert result["prompts"]["count"] == 1 + 3 + 5 + 3
    assert result["prompts"]["longest_shared_prefix"] < serving.DISTINCT_HEAD
    assert [r["batch_size"] for r in result["runner"]["rows"]] == [1, 3]
    for run, num in zip(result["runs"], [5, 3], strict=True):
        assert run["num_requests"] == run["completed"] == num and run["errors"] == 0
        assert run["total_output_tokens"] == num * 6
        assert 6 <= run["total_input_tokens"] <= 12 * num
        assert run["request_rate"] is None  # all at once
        assert run["output_throughput"] > 0 and run["duration_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "itl_token_ms", "e2e_ms"):
            s = run[key]
            assert 0 < s["p50"] <= s["p99"], (key, s)
        # One event per decode step, or fewer: a stream that fell behind gets the tokens of
        # several steps in one event. Per token: one gap for each token after the first.
        assert 0 < run["itl_ms"]["n"] <= num * 5
        assert run["itl_ms"]["n"] <= run["itl_token_ms"]["n"] <= num * 5
        assert run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"]
        assert run["kv_slots_held_after"] == 0  # every finished request gave its slots back
        # Distinct prompts: the prefix cache serves at most a few leading tokens of each.
        assert 0 <= run["cached_tokens_in_window"] < serving.DISTINCT_HEAD * num
        assert run["captures_in_window"] == 0  # nothing to capture on the CPU
        assert run["jit_misses_in_window"] >= 0
        timeline = run["timeline"]  # where the server's step time went, per process
        assert timeline["scheduler"]["steps"] > 0 and timeline["runner"]["period_ms"] > 0
        assert "received_to_routed" in timeline["tokenizer"]["gaps_ms"]
        # The time to first token in the server: no more than the client saw.
        server_ttft = timeline["tokenizer_requests"]["gaps_ms"]["sent_to_first_token"]
        assert 0 < server_ttft < run["ttft_ms"]["p99"]
        # Every request was prefilled in some extend step and decoded in decode steps.
        assert timeline["scheduler"]["kinds"]["extend"]["steps"] >= 1
        batch = timeline["scheduler"]["kinds"]["decode"]["requests_mean"]
        assert batch >= 1
        # CPU shares: seconds on a CPU per second of the load window (a process may use
        # threads), which lasts no longer than the server's view of it.
        assert set(run["cpu_busy"]) == {"scheduler", "runner", "tokenizer"}
        assert all(0 <= share < 16 for share in run["cpu_busy"].values()), run["cpu_busy"]
        assert run["client_cpu_busy"] > 0
        assert 0 < run["load_window_s"] <= run["server_window_s"]
        ceiling = run["runner_ceiling"]
        assert ceiling["batch"] == batch and ceiling["measured_batches"] == [1, 3]
        assert ceiling["tok_s"] > 0
        assert run["of_ceiling"] == round(run["output_throughput"] / ceiling["tok_s"], 3)
    steady = result["runs"][0]["steady"]  # one in flight: from the first send to the last end
    assert steady["requests"] == 5 and steady["output_tokens"] == 5 * 6
    assert steady["of_ceiling"] > 0 and steady["tpot_ms"]["n"] == 5
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4].split()[0] == "conc"
    for title in ("of ceiling", "steady tok/s", "captures in window", "JIT misses in window"):
        assert title in lines[-4]
    assert any(line.startswith("runner ceiling: from ") for line in lines[:-4])
    assert any(line.startswith("runner profile at concurrency 1: 3 steps") for line in lines)


def test_serving_counts_refused_and_short_requests(server: ServerProcess) -> None:
    vocab = serving.server_info(server.url)["model"]["vocab_size"]
    specs = [RequestSpec([1, 2, 3], 4), RequestSpec([1] * 100, 4)]  # the second is too long
    records = asyncio.run(run_load(server.url, specs, max_concurrency=2, progress=False))
    assert records[0].ok and records[0].output_tokens == 4
    assert not records[1].ok and records[1].error.startswith("HTTP 400")
    figures = metrics(records)
    assert (figures["completed"], figures["errors"]) == (1, 1)
    assert vocab == ModelConfig.from_path(server_model(server)).vocab_size


def server_model(server: ServerProcess) -> Path:
    return Path(server.info()["model"]["path"])


def test_serving_from_two_client_processes_with_a_shared_prefix(
    server: ServerProcess, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "serving.json"
    serving.main(
        [
            "--base-url",
            server.url,
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--shared-prefix-len",
            "4",
            "--client-processes",
            "2",
            "--no-warmup",
            "--output-file",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["num_requests"] == run["completed"] == 6 and run["errors"] == 0
    assert run["total_output_tokens"] == 6 * 5 and run["total_input_tokens"] == 6 * 8
    assert run["client_processes"] == 2
    assert 0 < run["client_cpu_busy_max"] <= run["client_cpu_busy"]
    assert 0 < run["load_window_s"] <= run["server_window_s"]
    # The prefix is cached once a request that computed it ends: the 3 sent after that.
    assert run["shared_prefix_len"] == 4 and run["cached_tokens_in_window"] >= 3 * 4
    prompts = result["prompts"]
    assert prompts["shared_prefix_len"] == 4 and prompts["count"] == 6
    assert 4 <= prompts["longest_shared_prefix"] < 4 + serving.DISTINCT_HEAD
    # No runner figures against a running server without --runner-results: no ceiling.
    assert result["runner"]["rows"] == [] and "--runner-results" in result["runner"]["error"]
    assert run["runner_ceiling"]["tok_s"] is None and run["of_ceiling"] is None
    assert result["warmup"]["bursts"] == []
    lines = capsys.readouterr().out.splitlines()
    notes = lines[lines.index(next(x for x in lines if x.startswith("prompts: "))) : -3]
    assert "every one starts with the same 4 tokens" in notes[0]
    assert notes[-1].startswith("runner ceiling: none (")
    # The prefills' own path through the scheduler and the runner (median ms per gap).
    (extend,) = [x for x in notes if x.startswith("extend steps at concurrency 3: ")]
    assert "scheduler " in extend and "runner received_to_launched " in extend
    header, row = lines[-3], lines[-1]
    assert header.split()[:3] == ["conc", "rate", "prefix"] and row.split()[2] == "4"


def test_client_processes_return_records_in_order(server: ServerProcess) -> None:
    # Prompt lengths tell the requests apart; a Poisson rate split across the processes.
    specs = [RequestSpec(list(range(1, 2 + i)), 3 + i % 2) for i in range(7)]
    load = serving.client_load(
        server.url,
        specs,
        2,
        max_concurrency=None,
        request_rate=50.0,
        seed=0,
        timeout_s=60.0,
        max_duration_s=math.inf,
        headers=None,
    )
    assert [(r.input_len, r.output_len) for r in load.records] == [
        (len(s.input_ids), s.output_len) for s in specs
    ]
    assert all(r.ok and r.output_tokens == r.output_len for r in load.records)
    assert len(load.cpu_s) == 2 and all(cpu > 0 for cpu in load.cpu_s)
    figures = load.figures()
    assert figures["client_processes"] == 2 and figures["client_cpu_busy"] > 0


def test_a_failing_client_process_fails_the_run() -> None:
    with pytest.raises(RuntimeError, match=r"client process \d failed:(.|\n)*TypeError"):
        serving.client_load(
            "http://127.0.0.1:1",
            [RequestSpec([1], 1)] * 2,
            2,
            max_concurrency=2,
            request_rate=math.inf,
            seed=0,
            timeout_s=1.0,
            max_duration_s=math.inf,
            headers={"X-Bad": 1},  # the client refuses it
        )


@pytest.mark.parametrize(
    ("requested", "max_concurrency", "num_requests", "cpus", "expected"),
    [
        (None, 8, 100, 16, 1),  # up to 8 streams: this process
        (None, 9, 100, 16, 2),
        (None, 32, 1000, 16, 4),
        (None, 64, 1000, 16, 8),
        (None, 128, 1000, 16, 8),  # at most half the CPUs
        (None, 64, 1000, 2, 1),
        (None, 64, 1000, None, 1),  # CPU count unknown
        (None, None, 40, 16, 5),  # no cap: all 40 may be in flight
        (None, 64, 5, 16, 1),  # only 5 requests
        (4, 64, 100, 2, 4),  # asked for: the CPUs do not cap it
        (4, 3, 100, 16, 3),  # but the requests in flight do
    ],
)
def test_client_processes_auto_rule(
    requested: int | None,
    max_concurrency: int | None,
    num_requests: int,
    cpus: int | None,
    expected: int,
) -> None:
    assert (
        serving.client_processes_for_run(requested, max_concurrency, num_requests, cpus) == expected
    )


def test_serving_refuses_zero_client_processes(capsys) -> None:
    with pytest.raises(SystemExit):
        serving.main(["--base-url", "http://x", "--client-processes", "0"])
    assert "--client-processes: must be a positive integer or 'auto', not '0'" in (
        capsys.readouterr().err
    )


def test_serving_metrics_from_known_times() -> None:
    r = RequestRecord(
        input_len=4,
        output_len=3,
        sent=10.0,
        token_times=[10.1, 10.3, 10.6],
        chunk_times=[10.1, 10.3, 10.6],
        done=10.6,
    )
    bad = RequestRecord(input_len=4, output_len=3, sent=10.0, done=10.2, error="HTTP 400: x")
    m = metrics([r, bad])
    assert m["completed"] == 1 and m["errors"] == 1 and m["error_samples"] == ["HTTP 400: x"]
    assert m["ttft_ms"]["p50"] == pytest.approx(100)
    assert m["itl_ms"]["n"] == 2 and m["itl_ms"]["mean"] == pytest.approx(250)
    assert m["tpot_ms"]["p50"] == pytest.approx(250)
    assert m["e2e_ms"]["p50"] == pytest.approx(600)
    assert m["output_throughput"] == pytest.approx(3 / 0.6, rel=1e-3)


def test_tpot_against_itl_per_event_and_per_token() -> None:
    # Events of 1, 3 and 1 tokens: the middle one brings three steps' tokens after 600 ms.
    r = RequestRecord(
        input_len=4,
        output_len=5,
        sent=10.0,
        token_times=[10.1, 10.7, 10.7, 10.7, 10.8],
        chunk_times=[10.1, 10.7, 10.8],
        done=10.8,
    )
    assert r.tpot_s == pytest.approx(0.7 / 4)  # per token after the first
    assert r.itl_s == pytest.approx([0.6, 0.1])  # per event gap
    assert r.itl_token_s == pytest.approx([0.2, 0.2, 0.2, 0.1])  # SGLang's: per token
    m = metrics([r])
    assert m["tpot_ms"]["p50"] == pytest.approx(175)
    assert m["itl_ms"]["n"] == 2 and m["itl_ms"]["mean"] == pytest.approx(350)
    assert m["itl_token_ms"]["n"] == 4 and m["itl_token_ms"]["p50"] == pytest.approx(200)
    # Split evenly over its tokens, the gaps average to the TPOT when the stream ends with
    # its last event.
    assert m["itl_token_ms"]["mean"] == pytest.approx(m["tpot_ms"]["mean"])


def timed_record(sent: float, done: float, token_times: list[float]) -> RequestRecord:
    return RequestRecord(
        len(token_times), len(token_times), sent, token_times, list(token_times), done
    )


# Cap 2: in flight 1 from 0, 2 from 1 (r2 sent), 2 through the ends at 5 and 10 (each
# followed by a send at once), 1 from 12 (r3 ends after the last send), 0 at 14.
STEADY_RECORDS = [
    timed_record(100.0, 110.0, [100.5, 110.0]),
    timed_record(101.0, 105.0, [101.5, 105.0]),
    timed_record(105.0, 112.0, [105.5, 112.0]),
    timed_record(110.0, 114.0, [110.5, 114.0]),
]


def test_requests_by_worker_asks_until_each_worker_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new connection reaches whichever worker the kernel picks: the bench asks again until
    every worker's own requests are in, and not at all with one worker."""
    answers = iter([0, 0, 2, 0, 1, 2])
    calls = []

    def fake_info(base_url: str, headers: object, since: float) -> dict:
        calls.append(since)
        worker = next(answers)
        return {"tokenizer": {"worker": worker, "requests": {"window_steps": worker}}}

    monkeypatch.setattr(serving, "server_info", fake_info)
    workers = {"tokenizer": 1.0, "tokenizer1": 1.0, "tokenizer2": 1.0}
    first = {"tokenizer": {"worker": 1, "requests": {"window_steps": 1}, "workers_cpu_s": workers}}
    by_worker = serving.requests_by_worker("http://x", None, 5.0, first)
    assert by_worker == {str(w): {"window_steps": w} for w in range(3)}
    assert calls == [5.0, 5.0, 5.0]  # workers 0, 0 again, then 2: all three seen
    calls.clear()
    alone = {"tokenizer": {"worker": 0, "requests": None, "workers_cpu_s": {"tokenizer": 1.0}}}
    assert serving.requests_by_worker("http://x", None, 5.0, alone) == {"0": None}
    assert calls == []


def test_steady_window_leaves_out_the_ramp_up_and_the_tail() -> None:
    assert serving.steady_window(STEADY_RECORDS, 2) == (101.0, 112.0)
    assert serving.steady_window(STEADY_RECORDS, None) == (101.0, 112.0)  # the peak: 2
    assert serving.steady_window(STEADY_RECORDS, 3) is None  # never 3 in flight
    assert serving.steady_window(STEADY_RECORDS[:1], 1) == (100.0, 110.0)  # all of it
    steady = serving.steady_figures(STEADY_RECORDS, 2)
    assert steady is not None
    assert (steady["start_s"], steady["duration_s"], steady["in_flight_mean"]) == (1.0, 11.0, 2.0)
    assert steady["requests"] == 2  # r2 and r3 were sent and ended inside
    assert steady["output_tokens"] == 6  # 110.0; 101.5, 105.0; 105.5, 112.0; 110.5
    assert steady["output_throughput"] == round(6 / 11, 1)
    assert steady["request_throughput"] == round(3 / 11, 3)  # r2, r1, r3 ended inside
    assert steady["e2e_ms"]["n"] == 2 and steady["e2e_ms"]["mean"] == pytest.approx(5500)
    whole = metrics(STEADY_RECORDS)
    assert whole["output_throughput"] == round(8 / 14, 1)  # ramp-up and tail included


def test_shares_over_the_load_window() -> None:
    def sample(clock: float, cpu: tuple[float, float, float], captures: int) -> dict:
        timelines = {
            proc: {"timeline": {"cpu_s": s}} for proc, s in zip(serving.PROCESSES, cpu, strict=True)
        }
        labels = [f"decode bucket {b}" for b in (1, 2, 4, 8, 16)[:captures]]
        timelines["runner"]["graph_pool"] = {"captures": captures, "captured": labels}
        timelines["runner"]["jit_misses"] = {"count": 1}
        timelines["scheduler"]["cached_tokens"] = 40
        return {"clock_s": clock, **timelines}

    before = sample(100.0, (10.0, 20.0, 5.0), 3)
    after = sample(104.0, (12.0, 24.0, 5.4), 5)
    figures = serving.window_figures(before, after)
    assert figures["server_window_s"] == 4.0
    assert figures["cpu_busy"] == {"scheduler": 0.5, "runner": 1.0, "tokenizer": 0.1}
    assert figures["timeline"]["runner"] == {"cpu_s": 24.0}
    assert figures["captures_in_window"] == 2
    assert figures["captured_in_window"] == ["decode bucket 8", "decode bucket 16"]
    assert figures["jit_misses_in_window"] == 0 and figures["cached_tokens_in_window"] == 0
    # With several tokenizer workers, the requests of the one that served the most.
    after["tokenizer"]["requests_by_worker"] = {
        "0": {"window_steps": 2},
        "1": {"window_steps": 9},
        "2": None,
    }
    timeline = serving.window_figures(before, after)["timeline"]
    assert timeline["tokenizer_requests"] == {"window_steps": 9}
    assert set(timeline["tokenizer_requests_by_worker"]) == {"0", "1", "2"}
    assert figures["timeline_kept"] == {}  # no step counts: nothing to say
    # A ring the window outgrew: the runner began 4,000 steps in it and kept 1,024.
    before["runner"]["timeline"] |= {"steps": 1000}
    after["runner"]["timeline"] |= {"steps": 5000, "window_steps": 1024}
    before["scheduler"]["timeline"] |= {"steps": 10}
    after["scheduler"]["timeline"] |= {"steps": 30, "window_steps": 20}
    assert serving.window_figures(before, after)["timeline_kept"] == {
        "scheduler": 1.0,
        "runner": 0.256,
    }
    del before["runner"]["graph_pool"]  # a server that does not report it: no figure
    assert serving.window_figures(before, after)["captures_in_window"] is None
    assert serving.window_figures(before, after)["captured_in_window"] is None
    # The client's share: its CPU seconds over the load window, all processes and the busiest.
    load = serving.ClientLoad([], [0.5, 1.0], 2.0)
    assert load.figures() == {
        "load_window_s": 2.0,
        "client_processes": 2,
        "client_cpu_busy": 0.75,
        "client_cpu_busy_max": 0.5,
    }


def test_the_load_window_opens_at_the_go_and_closes_at_the_last_end(server: ServerProcess) -> None:
    samples: list[tuple[float, float | None]] = []

    def sample(since: float | None) -> dict:
        now = time.perf_counter()
        samples.append((now, since))
        return {"clock_s": now}

    for processes in (1, 2):
        samples.clear()
        window = serving.LoadWindow(sample)
        called = time.perf_counter()
        load = serving.client_load(
            server.url,
            [RequestSpec([1, 2, 3, i + 1], 3) for i in range(4)],
            processes,
            max_concurrency=2,
            request_rate=math.inf,
            seed=0,
            timeout_s=60.0,
            max_duration_s=math.inf,
            headers=None,
            window=window,
        )
        (opened_at, first_since), (closed_at, second_since) = samples
        assert first_since is None and second_since == opened_at  # the timeline's start
        first_send = min(r.sent for r in load.records)
        last_end = max(r.done or 0.0 for r in load.records)
        assert called < opened_at <= window.opened <= first_send  # every process was up
        assert last_end <= window.closed <= closed_at
        assert load.wall_s == window.closed - window.opened


def test_table_rows_read_the_timeline_of_new_and_older_results() -> None:
    kinds = {
        "extend": {"steps": 4, "requests_mean": 2.0, "tokens_mean": 64.0, "ms_total": 30.0},
        "decode": {"steps": 90, "requests_mean": 7.5, "tokens_mean": 7.5, "ms_total": 90.0},
    }
    flat = {f"{kind}_{k}": v for kind, figures in kinds.items() for k, v in figures.items()}
    for scheduler in ({"steps": 94, "kinds": kinds}, {"steps": 94, **flat}):
        row = serving.table_row({"timeline": {"scheduler": scheduler}})
        assert (row["decode_bs"], row["extend_steps"], row["extend_share"]) == (7.5, 4, 25.0)
        assert row["ceiling_tok_s"] is None and row["steady_output_throughput"] is None
        assert row["server_step_ms"] is None and row["steps_kept"] is None
    # The server's step: the device's period where the runner measured it, its loop turns
    # beside it; without the device's, the turns' median.
    kinds["decode"]["periods_ms"] = {"p10": 1.0, "p50": 2.2, "p90": 2.4}
    runner = {"kinds": {"decode": {"medians_ms": {"device_period": 1.6, "device_busy": 1.59}}}}
    row = serving.table_row(
        {"timeline": {"scheduler": {"kinds": kinds}, "runner": runner}, "timeline_kept": {"a": 1}}
    )
    assert (row["server_step_ms"], row["turn_p10_ms"], row["turn_p50_ms"]) == (1.6, 1.0, 2.2)
    assert row["steps_kept"] == 1
    assert serving.table_row({"timeline": {"scheduler": {"kinds": kinds}}})["server_step_ms"] == 2.2


def test_runner_ceiling_arithmetic() -> None:
    rows = [
        {"batch_size": 1, "input_len": 128, "prefill_ms": 10.0, "decode_ms_overlapped": 1.0},
        {"batch_size": 32, "input_len": 128, "prefill_ms": 40.0, "decode_ms_overlapped": 2.0},
    ]
    # Halfway between the measured batches: prefill 25 ms, decode 1.5 ms a step.
    c = runner_ceiling.ceiling(rows, 16.5, 64)
    assert (c["prefill_ms"], c["decode_ms"]) == (25.0, 1.5)
    assert c["tok_s"] == round(16.5 * 64 * 1000 / (25 + 64 * 1.5), 1) == 8727.3
    assert c["measured_batches"] == [1, 32] and c["input_len"] == 128
    # Beyond the largest measured batch: its figures (the nearest), at the run's own batch.
    c = runner_ceiling.ceiling(rows, 64, 64)
    assert (c["prefill_ms"], c["decode_ms"]) == (40.0, 2.0)
    assert c["tok_s"] == round(64 * 64 * 1000 / (40 + 128), 1)
    figures = RunnerFigures("file", rows)
    assert figures.ceiling(16.5, 64)["tok_s"] == 8727.3
    assert figures.ceiling(None, 64) == {
        "tok_s": None,
        "missing": "the server took no decode steps in the run",
    }
    assert RunnerFigures(None, error="why").ceiling(8, 64) == {"tok_s": None, "missing": "why"}


def test_runner_results_file(tmp_path: Path) -> None:
    def row(batch: int, backend: str = "full", input_len: int = 128, prefill: float = 5.0):
        return {
            "decode_backend": backend,
            "batch_size": batch,
            "input_len": input_len,
            "prefill_ms": prefill,
            "decode_ms_overlapped": 1.0,
        }

    path = tmp_path / "runner.jsonl"
    hf = {"method": "cublas-chain", "batch_size": 1, "input_len": 128, "prefill_ms": 1.0}
    lines = [row(8), row(1), row(8, prefill=7.0), row(4, input_len=64), hf]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = runner_ceiling.read_rows(path, 128)
    assert [(r["batch_size"], r["prefill_ms"]) for r in rows] == [(1, 5.0), (8, 7.0)]  # last wins
    with pytest.raises(ValueError, match="no one_batch rows at input length 32"):
        runner_ceiling.read_rows(path, 32)
    path.write_text(json.dumps(row(1)) + "\n" + json.dumps(row(8, backend="disabled")) + "\n")
    with pytest.raises(ValueError, match="measured 2 configurations"):
        runner_ceiling.read_rows(path, 128)
    with pytest.raises(SystemExit):  # refused before any load
        serving.main(["--base-url", "http://x", "--runner-results", str(path)])


def test_longest_shared_prefix() -> None:
    assert serving.longest_shared_prefix([[1, 2, 3], [5], [1, 2, 4, 4]]) == 2
    assert serving.longest_shared_prefix([[1, 2], [1, 2, 3]]) == 2  # one is the other's start
    assert serving.longest_shared_prefix([[7, 7]]) == 0


def call_plan(*args: str, buckets: tuple[int, ...] = ()) -> serving.CallPlan:
    ns = serving.build_parser().parse_args(list(args))
    return serving.plan_call(ns, vocab_size=512, buckets=buckets)


def test_prompts_are_distinct_across_runs_levels_and_the_warm_up() -> None:
    args = ["--max-concurrency", "1", "4", "32", "32", "--input-len", "16", "--range-ratio", "0.5"]
    plan = call_plan(*args, buckets=(1, 2, 4, 8, 16, 24, 32, 40))
    prompts = list(plan.prompts())
    # 64 requests a run, at least 1,024 where more than 16 can be in flight; the warm-up's.
    assert [len(run.specs) for run in plan.runs] == [64, 64, 1024, 1024]
    assert len(prompts) == 64 + 64 + 2048 + sum([1, 2, 4, 8, 16, 24, 32])
    assert serving.longest_shared_prefix(prompts) < serving.DISTINCT_HEAD
    assert all(8 <= len(p) <= 16 for p in prompts)
    assert plan.runs[2].seed != plan.runs[3].seed  # the same level twice: other arrivals too
    assert call_plan(*args, buckets=(1, 2, 4, 8, 16, 24, 32, 40)) == plan  # from --seed alone
    assert call_plan(*args, "--seed", "1").runs[0].specs != plan.runs[0].specs
    # Asked for: every prompt starts with the same tokens, and shares no more than those.
    shared = call_plan(*args, "--shared-prefix-len", "6")
    prompts = list(shared.prompts())
    assert len(shared.shared_prefix) == 6
    assert all(p[:6] == shared.shared_prefix for p in prompts)
    assert 6 <= serving.longest_shared_prefix(prompts) < 6 + serving.DISTINCT_HEAD


def test_requests_per_run() -> None:
    def counts(*args: str) -> list[int]:
        return serving.request_counts(serving.build_parser().parse_args(list(args)))

    levels = ["--max-concurrency", "1", "16", "17", "0"]
    assert counts(*levels) == [64, 64, 1024, 1024]  # no cap: every request may be in flight
    assert counts(*levels, "--min-requests-per-level", "200") == [64, 64, 200, 200]
    assert counts(*levels, "--num-prompts", "5") == [5, 5, 5, 5]  # given: as given
    assert counts(*levels, "--num-prompts", "1", "2", "3", "4") == [1, 2, 3, 4]


def test_warm_up_bursts() -> None:
    # A burst per run's in-flight count, and per decode bucket up to the largest of those.
    ladder = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72]
    assert serving.warmup_sizes([1, 32, 64], ladder) == ladder[:-1]
    assert serving.warmup_sizes([1, 20], []) == [1, 20]  # no graphs: the runs' counts
    plan = call_plan(
        "--max-concurrency", "2", "6", "--num-prompts", "3", "--output-len", "40", buckets=(1, 4, 8)
    )
    # At most as many in flight as a run has requests: 3 for the cap of 6.
    assert [len(burst) for burst in plan.warmup] == [1, 2, 3]
    assert {s.output_len for burst in plan.warmup for s in burst} == {40}  # at most its own
    plan = call_plan("--max-concurrency", "2", "--output-len", "400", buckets=(1, 4, 8))
    assert {s.output_len for burst in plan.warmup for s in burst} == {64}  # --warmup-output-len
    plan = call_plan("--max-concurrency", "2", "--output-len", "8")
    assert [[s.output_len for s in burst] for burst in plan.warmup] == [[8, 8]]  # at most its own
    assert call_plan("--max-concurrency", "2", "--no-warmup").warmup == []
    info = {"graphs": {"decode": {"buckets": [{"bucket": 4}, {"bucket": 1}]}}}
    assert serving.phase_buckets(info, "decode") == [1, 4]
    assert serving.phase_buckets(info, "prefill") == []
    assert serving.phase_buckets({"graphs": {"decode": {"buckets": []}}}, "decode") == []


def test_warm_up_meets_the_buckets_its_bursts_did_not() -> None:
    def phase(states: dict[int, str]) -> dict[str, Any]:
        return {"buckets": [{"bucket": b, "state": st} for b, st in states.items()]}

    info = {
        "graphs": {
            "decode": phase({1: "captured", 8: "unseen", 16: "unseen", 24: "unseen"}),
            "prefill": phase({128: "captured", 512: "unseen", 1024: "unseen", 2048: "unseen"}),
        }
    }
    # Runs of up to 20 in flight, 256-token prompts: bursts for decode 8 and 16 of as many
    # requests, for 24 of 20 (above the 16 of the bucket below); batches for prefill 512 of 2
    # prompts, 1,024 of 4, 2,048 of 8 (2,048 tokens, above 1,024).
    assert serving.unmet_buckets(info, 20, 256) == serving.Unmet([8, 16, 20], [2, 4, 8])
    # At most 3 in flight: decode 8 (above 1), prefill 512 (2) and 1,024 (3 prompts: 768
    # tokens, above 512); 2,048 is out of reach.
    assert serving.unmet_buckets(info, 3, 256) == serving.Unmet([3], [2, 3])
    # 600-token prompts: none fits 512; 1,024 takes one (600 > 512), 2,048 three (1,800).
    assert serving.unmet_buckets(info, 3, 600) == serving.Unmet([3], [1, 3])
    done = {"graphs": {"decode": phase({1: "captured"}), "prefill": phase({128: "skipped"})}}
    assert not serving.unmet_buckets(done, 20, 256)
    # Fresh prompts for a pass, distinct from the call's.
    plan = call_plan("--max-concurrency", "4", "--input-len", "16", buckets=(1, 2, 4))
    more = plan.draw_warmup(3, "pass0/batch3")
    assert len(more) == 3 and {s.output_len for s in more} == {64}
    prompts = [*plan.prompts(), *(s.input_ids for s in more)]
    assert serving.longest_shared_prefix(prompts) < serving.DISTINCT_HEAD


def test_a_warm_up_batch_is_one_call(server: ServerProcess) -> None:
    specs = serving.random_requests(3, 8, 4, 200, seed="batch")
    assert serving.send_batch(server.url, server.headers, specs, 30) == 0
    too_long = [RequestSpec([1] * 100_000, 1), *specs]  # refused: every prompt counts
    assert serving.send_batch(server.url, server.headers, too_long, 30) == 4


def test_serving_refuses_both_a_url_and_server_flags() -> None:
    with pytest.raises(SystemExit):
        serving.main(["--base-url", "http://x", "--", "--device", "cpu"])


def test_random_requests_lengths() -> None:
    specs = serving.random_requests(50, 20, 7, vocab_size=30, range_ratio=0.5, seed=1)
    assert all(10 <= len(s.input_ids) <= 20 and s.output_len == 7 for s in specs)
    assert all(0 <= t < 30 for s in specs for t in s.input_ids)
    assert len({len(s.input_ids) for s in specs}) > 1
    assert specs == serving.random_requests(50, 20, 7, vocab_size=30, range_ratio=0.5, seed=1)


# ---- cold_start ----------------------------------------------------------------------------


def test_cold_start_two_configurations(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "cold.json", tmp_path / "cold.png"
    cold_start.main(
        [
            "--model-path",
            str(tiny_llama),
            "--configs",
            "nographs",
            "--config",
            "full-small=--cuda-graph-backend-decode full --cuda-graph-bs-decode 1 2 4",
            "--bursts",
            "1",
            "2",
            "--burst-output-len",
            "4",
            "--steady-concurrency",
            "1",
            "2",
            "--steady-rounds",
            "1",
            "--steady-output-len",
            "5",
            "--input-len",
            "8",
            "--attention-backends",
            "torch_native",
            "--cache-root",
            str(tmp_path / "caches"),
            "--output-file",
            str(out),
            "--plot",
            str(png),
            "--",
            "--device",
            "cpu",
        ]
    )
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["config"], r["cache"]) for r in runs] == [
        ("nographs+torch_native", "cold"),
        ("nographs+torch_native", "warm"),
        ("full-small+torch_native", "cold"),
        ("full-small+torch_native", "warm"),
    ]
    assert [(r["base_config"], r["attention"]) for r in runs[::2]] == [
        ("nographs", "torch_native"),
        ("full-small", "torch_native"),
    ]
    assert runs[2]["flags"][-8:] == [
        "--cuda-graph-backend-decode",
        "full",
        "--cuda-graph-bs-decode",
        "1",
        "2",
        "4",
        "--attention-backend",
        "torch_native",
    ]
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["ready_s"] > 0 and r["errors"] == 0
        assert r["ready_over_import_torch"] == round(r["ready_s"] / result["import_torch_s"], 2)
        minus = r["ready_s"] - result["import_torch_s"]
        assert r["ready_minus_import_torch_s"] == pytest.approx(minus, abs=1e-3)
        # the first request, bursts of 1 and 2 sent twice, steady at 1 and 2, a later one
        assert r["requests"] == 1 + (1 + 1 + 2 + 2) + (1 + 2) + 1
        b = r["breakdown"]
        assert b["launch_to_ready_s"] == r["ready_s"]
        assert all(v is not None and v >= 0 for v in b.values()), b
        for proc in ("tokenizer", "scheduler", "model_runner"):  # each one's parts, summed
            whole = (f"{proc}_total_s", f"{proc}_ready_after_s")
            parts = [v for k, v in b.items() if k.startswith(f"{proc}_") and k not in whole]
            assert len(parts) >= 2 and sum(parts) == pytest.approx(b[whole[0]], abs=0.01), b
        assert b["model_runner_ready_after_s"] <= b["launch_to_ready_s"]
        assert b["model_runner_load_s"] >= 0 and "model_runner_kv_alloc_s" in b
        assert r["load_bytes"] > 0 and r["load_gb_s"] > 0
        # The second token may come in the first's event (a stream that fell behind gets
        # the tokens of several steps at once).
        assert 0 < r["ttft_first_ms"] <= r["t2t_first_ms"]
        assert 0 < r["ttft_later_ms"] <= r["t2t_later_ms"]
        assert [x["batch"] for x in r["buckets"]] == [1, 2]
        for x in r["buckets"]:
            assert x["t2t_first_ms"] > 0 and x["t2t_again_ms"] > 0 and x["steady_tpot_ms"] > 0
            assert x["excess_ms"] == pytest.approx(x["t2t_first_ms"] - x["t2t_again_ms"], abs=1e-3)
            # captured on the CPU? no: there is nothing to capture, so no bucket records
            assert x["server_capture_ms"] is None
        assert set(r["steady"]) == {"1", "2"}
        assert r["steady"]["2"]["total_output_tokens"] == 2 * 5
        tl = r["timeline"]
        assert len(tl["t_s"]) == len(tl["ms"]) == len(tl["first_token"]) > 0
        assert sum(tl["first_token"]) == r["requests"]
        assert min(tl["t_s"]) >= 0
        assert r["flashinfer_jit"] == {"compiled": 0, "loaded": 0, "s": 0.0}
    assert Path(runs[0]["log"]).is_file()
    # its own cache root, the tools' caches in it
    own_root = tmp_path / "caches" / "full-small+torch_native"
    assert any(own_root.glob("*/factors.json")) and (own_root / "triton").is_dir()
    assert png.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "worst new-bucket excess ms" in printed and "ready - first backend's s" in printed


def test_cold_start_configurations_per_attention_backend() -> None:
    full = cold_start.Configuration("full", ["--cuda-graph-backend-decode", "full"])
    nographs = cold_start.Configuration("nographs", ["--disable-cuda-graph"])
    assert cold_start.per_attention_backend([full, nographs], []) == [full, nographs]
    assert (full.label, full.server_flags()) == ("full", full.flags)
    crossed = cold_start.per_attention_backend([full, nographs], ["triton", "flashinfer"])
    assert [c.label for c in crossed] == [
        "full+triton",
        "full+flashinfer",
        "nographs+triton",
        "nographs+flashinfer",
    ]
    assert crossed[1].server_flags() == [*full.flags, "--attention-backend", "flashinfer"]
    assert full.flags == ["--cuda-graph-backend-decode", "full"]  # the preset's list untouched
    for flags in (["--attention-backend", "triton"], ["--attention-backend=triton"]):
        assert cold_start.sets_attention_backend(["--port", "1", *flags])
    assert not cold_start.sets_attention_backend(["--attention-backends-x"])
    for argv in (
        ["--attention-backends", "triton", "--", "--attention-backend", "flashinfer"],
        ["--attention-backends", "triton", "--config", "x=--attention-backend=triton"],
    ):
        with pytest.raises(SystemExit):
            cold_start.main(["--model-shape", "llama-3.2-1b", *argv])


def test_cold_start_against_the_first_backend() -> None:
    def start(
        config: str, cache: str, attention: str | None, ready: float | None
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"base_config": config, "cache": cache, "attention": attention}
        if ready is not None:  # a start that became ready
            row["ready_s"] = ready
            row["breakdown"] = {"model_runner_flashinfer_jit_s": 0.0}
            row["flashinfer_jit"] = {"compiled": 0, "loaded": 0, "s": 0.0}
            if attention == "flashinfer":
                compiled = 2 if cache == "cold" else 0
                jit_s = 75.0 if cache == "cold" else 0.02
                row["breakdown"]["model_runner_flashinfer_jit_s"] = jit_s
                row["flashinfer_jit"] = {"compiled": compiled, "loaded": 2 - compiled, "s": jit_s}
        return row

    rows = [
        start("full", "cold", "triton", 9.5),
        start("full", "warm", "triton", 5.25),
        start("full", "cold", "flashinfer", 86.0),
        start("full", "warm", "flashinfer", 5.5),
        start("nographs", "cold", "triton", None),  # did not become ready
        start("nographs", "cold", "flashinfer", 80.0),
        start("lone", "warm", None, 4.0),  # run without --attention-backends
    ]
    got = cold_start.against_first_backend(rows, "triton")
    assert [(g["config"], g["cache"], g["attention"], g["ready_minus_first_s"]) for g in got] == [
        ("full", "cold", "triton", 0.0),
        ("full", "warm", "triton", 0.0),
        ("full", "cold", "flashinfer", 76.5),
        ("full", "warm", "flashinfer", 0.25),
        ("nographs", "cold", "triton", None),
        ("nographs", "cold", "flashinfer", None),
    ]
    assert [(g["flashinfer_compiled"], g["flashinfer_loaded"]) for g in got[2:4]] == [
        (2, 0),
        (0, 2),
    ]
    assert got[2]["flashinfer_jit_s"] == 75.0 and got[3]["ready_s"] == 5.5
    assert got[4]["ready_s"] is None and got[4]["flashinfer_compiled"] is None


def test_cold_start_config_syntax() -> None:
    assert cold_start.parse_config("x=--a 1 --b 'c d'") == ("x", ["--a", "1", "--b", "c d"])
    with pytest.raises(Exception, match="NAME=FLAGS"):
        cold_start.parse_config("--a 1")
    with pytest.raises(SystemExit):
        cold_start.main(["--configs", "no-such-preset"])


# ---- hf_baseline ---------------------------------------------------------------------------


def test_hf_baseline_on_the_tiny_model(tiny_llama: Path, tmp_path: Path) -> None:
    results = tmp_path / "hf.jsonl"
    hf_baseline.main(
        [
            "--model-path",
            str(tiny_llama),
            "--device",
            "cpu",
            "--batch-size",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--copy-mib",
            "16",
            "--result-file",
            str(results),
        ]
    )
    rows = {r["method"]: r for r in read_jsonl(results)}
    assert set(rows) == {
        "bandwidth-floor",
        "hf-eager",
        "hf-generate-static",
        "hf-compile-reduce-overhead",
        "cublas-chain",
    }
    assert all(r["decode_ms_per_step"] > 0 and r["batch_size"] == 2 for r in rows.values())
    assert rows["hf-compile-reduce-overhead"]["compile_s"] > 0
    config = ModelConfig.from_path(tiny_llama)
    model, _ = load_model(config, torch.device("cpu"))
    embed = model.model.embed_tokens.weight
    expected = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    assert rows["bandwidth-floor"]["weight_bytes"] == expected  # untied: no embedding table
    floor = rows["bandwidth-floor"]
    assert floor["decode_ms_per_step"] == pytest.approx(
        expected / (floor["copy_bandwidth_gbs"] * 1e9) * 1000, rel=1e-3
    )
    matmuls = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if p is not embed and not name.endswith("norm.weight")
    )
    assert rows["cublas-chain"]["weight_bytes"] == matmuls  # the same matrices, norms aside
    assert rows["cublas-chain"]["cuda_graph"] is False


# ---- checkpoints ---------------------------------------------------------------------------


@pytest.fixture
def small_shape(monkeypatch: pytest.MonkeyPatch) -> str:
    shape = dict(
        model_shapes.MODEL_SHAPES["llama-3.2-1b"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=600,
    )
    monkeypatch.setitem(model_shapes.MODEL_SHAPES, "small-test", shape)
    return "small-test"


def test_a_llama3_shape_carries_a_tokenizer_of_llama3s_size(tmp_path: Path) -> None:
    """A published shape's directory has a 128,256-token tokenizer in Llama 3's layout (the
    specials from 128,000, the config's bos and eos among them) that round-trips any text."""
    from srt.server.hf_tokenizer import load_tokenizer
    from srt.tools import llama3_tokenizer

    path = model_shapes.write_model_shape("llama-3.2-1b", tmp_path)
    config = json.loads((path / "config.json").read_text())
    tok = load_tokenizer(str(path))
    assert len(tok) == config["vocab_size"] == llama3_tokenizer.VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert tok.convert_ids_to_tokens(128009) == "<|eot_id|>"
    rng = random.Random(0)
    texts = ["héllo ✓ 日本語 🙂 naïve café\n\tthe end.", bytes(range(256)).decode("latin-1")]
    texts += ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(200)) for _ in range(5)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert max(ids) < llama3_tokenizer.REGULAR_TOKENS
        assert tok.decode(ids) == text
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    chat = tok.encode(text, add_special_tokens=False)
    assert chat[0] == llama3_tokenizer.BOS_ID and 128006 in chat and 128009 in chat


def test_model_shape_has_no_weights(small_shape: str, tmp_path: Path) -> None:
    path = model_shapes.write_model_shape(small_shape, tmp_path)
    assert not list(path.glob("*.safetensors*"))
    config = ModelConfig.from_path(path)
    assert (config.num_layers, config.vocab_size) == (3, 600)
    with pytest.raises(ValueError, match="unknown shape 'nope'"):
        model_shapes.write_model_shape("nope", tmp_path)


def test_random_checkpoint_loads_everywhere(small_shape: str, tmp_path: Path) -> None:
    import transformers

    path = make_random_checkpoint.make_random_checkpoint(
        tmp_path, small_shape, shard_bytes=40_000, device="cpu"
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert "lm_head.weight" not in index["weight_map"]  # tied, saved once
    ours, _ = load_model(ModelConfig.from_path(path), torch.device("cpu"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    theirs_state = theirs.state_dict()
    total, seen = 0, set()
    for name, tensor in ours.state_dict().items():
        if tensor.data_ptr() not in seen:  # the tied LM head is the embedding
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
        assert tensor.dtype == torch.bfloat16
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor))
        elif name in theirs_state:  # unpacked names match one to one
            assert torch.equal(tensor, theirs_state[name]), name
            assert math.isclose(tensor.float().std().item(), 0.02, rel_tol=0.3), name
    assert index["metadata"]["total_size"] == total


def test_one_batch_labels_keep_backends_and_op_selections_apart() -> None:
    """Rows of one results file that differ only in the attention backend, the custom ops or
    the skinny kernel's launch get their own rows in the tables (they were printed over one
    another)."""
    from srt.bench.one_batch import label

    base = {"decode_backend": "full", "prefill_backend": "disabled", "custom_ops": None}
    rows = [
        {**base, "attention_backend": "triton"},
        {**base, "attention_backend": "flashinfer"},
        {**base, "attention_backend": "triton", "custom_ops": "all,-skinny_matmul"},
        {**base, "attention_backend": "triton", "skinny_matmul_launch": "plain"},
        {**base, "attention_backend": "triton", "skinny_matmul_launch": "pdl"},
    ]
    assert [label(r) for r in rows] == [
        "full",
        "full, flashinfer",
        "full, ops all,-skinny_matmul",
        "full",
        "full, launch pdl",
    ]
    assert label({"decode_backend": "tc_piecewise", "tc_compiler": "inductor"}) == (
        "tc_piecewise-inductor"
    )


def test_the_tables_script_reads_gzipped_results_as_the_plain_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Committed results over 200 KB are gzipped; `scripts/bench_tables.py` prints the same
    tables from them (a one_batch `.jsonl` and a serving `.json` here)."""
    import gzip
    import importlib.util

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_tables", repo / "scripts/bench_tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    results = repo / "docs/results"
    for name in (
        "2026-12-01-h200-serving-llama-3.2-1b-full.json",
        "2026-12-03-h200-r15c-runner-llama-3.2-1b-ctx1024.jsonl",
    ):
        plain = results / name
        packed = tmp_path / f"{name}.gz"
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        printed = []
        for path in (plain, packed):
            tables.main([str(path)])
            printed.append(capsys.readouterr().out.split("\n", 1)[1])  # after the file's name
        assert "|---|" in printed[0] and printed[0] == printed[1]
