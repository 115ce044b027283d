"""Overlap scheduling with the real model runner on the tiny llama (CPU, in process): the same
ids, greedy and seeded, as planning each step after the last one's result, for streaming
requests that start, stop and are aborted at different steps; every KV slot free afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from graph_emulation import EmulatedCapturer

import srt.model_executor.graphs.pool as graph_pool
from srt import Engine
from srt.ipc.messages import BatchPlan, BatchResult, GenerateReq
from srt.sampling_params import SamplingParams


@dataclass
class Job:
    prompt: list[int]
    params: dict[str, Any]
    start_after: int = 0  # submitted once this many tokens have streamed out (all requests)
    abort_after: int | None = None  # aborted once it has streamed this many tokens


@dataclass
class Stream:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    reason: str | None = None


# Small prefill budgets: long prompts are chunked and new requests split across steps.
ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "chunked_prefill_size": 8,
    "max_prefill_tokens": 16,
}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[Engine]:
    with Engine(model_path=str(tiny_llama), **ENGINE_ARGS) as eng:
        yield eng


def drive(engine: Engine, jobs: dict[str, Job], overlap: int) -> dict[str, Stream]:
    """Run `jobs` through the engine's scheduler and runner, as the scheduler process does,
    with `overlap` steps launched ahead of the one processed (0: each step in turn)."""
    sched, runner = engine.scheduler, engine.runner
    sched.overlap_depth = max(overlap, 1)
    plans: list[BatchPlan] = []

    def launch(plan: BatchPlan) -> Callable[[], BatchResult]:
        plans.append(plan)
        return runner.launch(plan).wait

    streams = {rid: Stream() for rid in jobs}
    unsent = list(jobs)
    streamed = 0
    for _ in range(10_000):
        while unsent and jobs[unsent[0]].start_after <= streamed:
            rid = unsent.pop(0)
            params = SamplingParams.from_dict(jobs[rid].params)
            sched.add_request(GenerateReq(rid, jobs[rid].prompt, params, stream=True))
        if not unsent and not sched.has_work:
            break
        outputs = (
            sched.step_overlapped(launch) if overlap else sched.step(launch_sync(runner, plans))
        )
        for out in outputs.unpack() if outputs is not None else []:
            s = streams[out.rid]
            assert s.reason is None, f"{out.rid}: an output after its end"
            s.ids += out.new_token_ids
            s.logprobs += out.logprobs
            s.top += out.top_logprobs
            streamed += len(out.new_token_ids)
            s.reason = out.finished_reason
            limit = jobs[out.rid].abort_after
            if s.reason is None and limit is not None and len(s.ids) >= limit:
                aborted = sched.abort(out.rid)
                assert aborted is not None and aborted.new_token_ids == []
                s.reason = aborted.finished_reason
    assert all(s.reason is not None for s in streams.values())
    assert not sched.has_work and not sched.reqs
    if overlap:
        assert any(p.input_from_row is not None for p in plans), "no decode took a device id"
    else:
        assert all(p.input_from_row is None for p in plans)
    # Every slot back: held by no request, and free once the prefix cache is flushed.
    assert sched.kv.rows.available == sched.args.max_running_requests
    assert sched.flush_cache()
    assert sched.kv.allocator.available == sched.kv.allocator.capacity
    return streams


def launch_sync(runner: Any, plans: list[BatchPlan]) -> Callable[[BatchPlan], BatchResult]:
    def forward(plan: BatchPlan) -> BatchResult:
        plans.append(plan)
        return runner.forward(plan)

    return forward


def traffic(engine: Engine) -> tuple[dict[str, Job], int]:
    """Streaming requests that start, stop (length, stop token, EOS) and are aborted at
    different steps, greedy and seeded, one with logprobs; and the EOS token they assume."""
    vocab = engine.model_config.vocab_size
    prompts = [
        [(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(n)]
        for i, n in enumerate([3, 21, 9, 40, 5, 14, 30, 2])
    ]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    # Tokens the stop conditions are set to: ones a first run shows each request will produce.
    probe = drive(
        engine,
        {
            "stop": Job(prompts[2], {**greedy, "max_new_tokens": 12}),
            "eos": Job(prompts[3], {**greedy, "max_new_tokens": 12}),
        },
        overlap=0,
    )
    stop_token, eos_token = probe["stop"].ids[4], probe["eos"].ids[6]
    jobs = {
        "greedy": Job(prompts[0], {**greedy, "max_new_tokens": 17}),
        "long": Job(prompts[1], {**greedy, "max_new_tokens": 9}, start_after=3),
        "stop": Job(prompts[2], {**greedy, "max_new_tokens": 12, "stop_token_ids": [stop_token]}),
        "eos": Job(prompts[3], {"temperature": 0.0, "max_new_tokens": 12}, start_after=1),
        "seeded": Job(
            prompts[4],
            {
                "temperature": 0.9,
                "top_p": 0.9,
                "seed": 11,
                "max_new_tokens": 15,
                "ignore_eos": True,
            },
        ),
        "seeded_late": Job(
            prompts[5],
            {
                "temperature": 1.2,
                "top_k": 20,
                "seed": 2**40 + 5,
                "max_new_tokens": 10,
                "ignore_eos": True,
            },
            start_after=12,
        ),
        "aborted": Job(prompts[6], {**greedy, "max_new_tokens": 30}, abort_after=4),
        "aborted_early": Job(
            prompts[7], {**greedy, "max_new_tokens": 30}, start_after=5, abort_after=1
        ),
        "logprobs": Job(
            prompts[0],
            {**greedy, "max_new_tokens": 6, "logprobs": True, "top_logprobs_num": 3},
            start_after=2,
        ),
        "one": Job(prompts[4], {**greedy, "max_new_tokens": 1}, start_after=4),
    }
    return jobs, eos_token


@contextmanager
def eos_and_mixing(engine: Engine, eos_token: int, mixed: bool = False) -> Iterator[None]:
    saved = engine.scheduler.eos_token_ids, engine.scheduler.args.enable_mixed_chunk
    engine.scheduler.eos_token_ids = {eos_token}
    engine.scheduler.args.enable_mixed_chunk = mixed
    try:
        yield
    finally:
        engine.scheduler.eos_token_ids, engine.scheduler.args.enable_mixed_chunk = saved


def assert_same_streams(got: dict[str, Stream], want: dict[str, Stream]) -> None:
    for rid in want:
        assert got[rid].ids == want[rid].ids, rid
        assert got[rid].reason == want[rid].reason, rid
        assert got[rid].logprobs == pytest.approx(want[rid].logprobs, abs=1e-5), rid
        assert [[t for t, _ in row] for row in got[rid].top] == [
            [t for t, _ in row] for row in want[rid].top
        ], rid


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_overlap_gives_the_ids_of_one_step_at_a_time(engine: Engine, depth: int) -> None:
    """Steps launched 1-3 deep ahead of the result processed: the ids of planning each step
    after the last one's result (inputs from the rows' latest ids on the device)."""
    jobs, eos_token = traffic(engine)
    with eos_and_mixing(engine, eos_token):
        sync = drive(engine, jobs, overlap=0)
        overlapped = drive(engine, jobs, overlap=depth)
    assert_same_streams(overlapped, sync)
    stop_token = jobs["stop"].params["stop_token_ids"][0]
    assert sync["stop"].reason == "stop" and sync["stop"].ids[-1] == stop_token
    assert sync["eos"].reason == "stop" and sync["eos"].ids[-1] == eos_token
    assert (sync["aborted"].reason, len(sync["aborted"].ids)) == ("abort", 4)
    assert (sync["aborted_early"].reason, len(sync["aborted_early"].ids)) == ("abort", 1)
    assert sync["greedy"].reason == "length" and len(sync["greedy"].ids) == 17
    assert len(sync["one"].ids) == 1 and len(sync["seeded_late"].ids) == 10
    assert len(sync["logprobs"].logprobs) == 6 and len(sync["logprobs"].top[0]) == 3


@pytest.mark.parametrize("overlap", [0, 2], ids=["sync", "overlap"])
def test_mixed_steps_give_the_ids_of_separate_steps(engine: Engine, overlap: int) -> None:
    """Decodes riding along in prefill steps (`--enable-mixed-chunk`), their input ids from
    the host or, overlapped, from the device: the same streams as prefill and decode apart."""
    jobs, eos_token = traffic(engine)
    with eos_and_mixing(engine, eos_token):
        separate = drive(engine, jobs, overlap=0)
    before = engine.scheduler.info().mixed_decode_tokens
    with eos_and_mixing(engine, eos_token, mixed=True):
        mixed = drive(engine, jobs, overlap=overlap)
    assert engine.scheduler.info().mixed_decode_tokens > before, "no decode rode along"
    assert_same_streams(mixed, separate)


@pytest.mark.gpu
def test_overlap_on_cuda_gives_the_same_ids(tiny_llama: Path) -> None:
    """On CUDA a step's ids come back through pinned memory and an event while the next step
    runs. Requests that only stop at their length and all fit at once make the same batches
    with and without overlap, so the ids are equal bit for bit (greedy and seeded)."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    jobs = {
        f"r{i}": Job(
            [(11 * i + 5 * j) % 500 + 1 for j in range(3 + 7 * i)],
            {**greedy, "max_new_tokens": 4 + 3 * i}
            if i % 2
            else {"temperature": 0.8, "seed": i, "max_new_tokens": 4 + 3 * i, "ignore_eos": True},
        )
        for i in range(6)
    }
    with Engine(model_path=str(tiny_llama), device="cuda", dtype="float32") as eng:
        sync = drive(eng, jobs, overlap=0)
        overlapped = drive(eng, jobs, overlap=2)
    assert {r: s.ids for r, s in overlapped.items()} == {r: s.ids for r, s in sync.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["disabled", "full"])
def test_launching_a_decode_step_never_waits_for_the_device(tiny_llama: Path, decode: str) -> None:
    """Overlap needs a launch that returns while the device still computes: no upload that
    blocks (a blocking host-to-device copy synchronises the stream), no read of a device value.
    CUDA's sync debug mode turns any synchronising call inside the launch into an error."""
    import numpy as np
    import torch

    from srt.batch_layout import ForwardMode
    from srt.bench.one_batch import Requests

    with Engine(
        model_path=str(tiny_llama),
        device="cuda",
        dtype="bfloat16",
        cuda_graph_backend_decode=decode,
        cuda_graph_backend_prefill="disabled",
    ) as eng:
        runner = eng.runner
        reqs = Requests(4, 9, 8, runner.config.vocab_size, seed=0)
        runner.forward(reqs.plan(ForwardMode.EXTEND, 0, reqs.prompts))
        placeholder = np.zeros((4, 1), np.int64)
        # The first decode step captures its bucket (that may synchronise); the rest launch.
        pending = runner.launch(reqs.plan(ForwardMode.DECODE, 9, placeholder, 1, from_prev=True))
        for step in range(2, 7):
            plan = reqs.plan(ForwardMode.DECODE, 8 + step, placeholder, step, from_prev=True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                launched = runner.launch(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            pending.wait()
            pending = launched
        pending.wait()


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
@pytest.mark.parametrize("prefill", ["disabled", "full", "breakable"])
def test_captured_steps_give_the_ids_of_eager_steps(
    engine: Engine,
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prefill: str,
    mixed: bool,
) -> None:
    """The same traffic, overlapped, through captured graphs (CUDA capture emulated on the
    CPU): every step of a captured bucket is uploaded once into its static buffer, padded, its
    table writes and its ids from the rows' latest samples applied on the device, with prefill
    captured or not and decodes riding along in prefill steps or not."""
    jobs, eos_token = traffic(engine)
    with eos_and_mixing(engine, eos_token, mixed=mixed):
        eager = drive(engine, jobs, overlap=2)
    monkeypatch.setattr(graph_pool, "default_capturer", lambda device: EmulatedCapturer())
    with Engine(
        model_path=str(tiny_llama),
        **ENGINE_ARGS,
        compile_cache_dir=str(tmp_path / "cache"),
        cuda_graph_backend_decode="full",
        cuda_graph_backend_prefill=prefill,
        cuda_graph_bs_decode=[1, 2, 4, 8],
        cuda_graph_bs_prefill=[4, 8, 16],
    ) as captured:
        with eos_and_mixing(captured, eos_token, mixed=mixed):
            graphed = drive(captured, jobs, overlap=2)
        graphs = captured.get_server_info()["graphs"]
    assert graphs["decode"]["replays"] > 0
    assert (graphs["prefill"]["replays"] > 0) == (prefill != "disabled")
    assert_same_streams(graphed, eager)
