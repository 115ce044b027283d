"""The scheduler, one step at a time and overlapped, against the fake runner of
scheduler_helpers: outputs, KV pressure, stop conditions, aborts, bad requests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scheduler_helpers import (
    VOCAB,
    assert_no_leak,
    make_scheduler,
    reference,
    run_all,
    shared_prefix_workload,
    step,
)

from srt.ipc.channels import dumps, loads
from srt.ipc.messages import FlushCacheOutput, GenerateReq, Replies, StepOutputs, TokenOutput
from srt.sampling_params import SamplingParams
from srt.scheduler.req import Req
from srt.scheduler.scheduler_process import OutputRoutes, SchedulerLoop


@pytest.mark.parametrize("overlap", [0, 1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunk", [4, 2048])
def test_outputs_correct_under_kv_pressure(prefix_caching: bool, chunk: int, overlap: int) -> None:
    """A KV pool far smaller than the workload queues requests; all finish, all correct."""
    reqs = shared_prefix_workload(40, seed=1)
    sched, runner = make_scheduler(
        num_slots=65,
        max_running_requests=8,
        chunked_prefill_size=chunk,
        max_prefill_tokens=48,
        enable_prefix_caching=prefix_caching,
    )
    done = run_all(sched, runner, reqs, overlap)
    for rid, (prompt, params) in reqs.items():
        assert done[rid]["ids"] == reference(prompt, params["max_new_tokens"]), rid
        assert done[rid]["reason"] == "length"
    assert max(p.batch_size for p in runner.plans) > 1  # requests did share steps
    if prefix_caching:
        assert sum(d["cached"] for d in done.values()) > 0
    else:
        assert all(d["cached"] == 0 for d in done.values())
    if chunk == 4:
        assert all(p.extend_lens.max() <= 4 for p in runner.plans)
    assert_no_leak(sched)


def test_request_waits_until_kv_frees() -> None:
    sched, runner = make_scheduler(num_slots=21, enable_prefix_caching=False)
    for rid in "ab":
        sched.add_request(GenerateReq(rid, [1, 2, 3, 4], SamplingParams(max_new_tokens=12)))
    sched.step(runner.forward)
    assert list(sched.running) == ["a"] and [r.rid for r in sched.waiting] == ["b"]
    assert sched.info().queued_requests == 1
    while "a" in sched.reqs:
        sched.step(runner.forward)
    sched.step(runner.forward)
    assert list(sched.running) == ["b"]


def test_prefill_and_decode_are_separate_steps() -> None:
    sched, runner = make_scheduler()
    run_all(
        sched,
        runner,
        {
            "a": ([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True}),
            "b": ([4, 5], {"max_new_tokens": 3, "ignore_eos": True}),
        },
    )
    modes = [(p.forward_mode, p.batch_size, p.num_tokens) for p in runner.plans]
    assert modes == [(0, 2, 5), (1, 2, 2), (1, 2, 2)]
    info = sched.info()
    assert info.prefill_steps == 1 and info.decode_steps == 2


@pytest.mark.parametrize("overlap", [0, 1, 2])
def test_stop_conditions(overlap: int) -> None:
    prompt = [3, 1, 4, 1, 5]
    full = reference(prompt, 12)
    sched, runner = make_scheduler(enable_prefix_caching=False)
    eos_at = full.index(full[4])  # eos is the 5th token (or an earlier copy of it)
    stop_at = full.index(full[6])
    sched.eos_token_ids = {full[4]}
    done = run_all(
        sched,
        runner,
        {
            "eos": (prompt, {"max_new_tokens": 12}),
            "ignore_eos": (prompt, {"max_new_tokens": 12, "ignore_eos": True}),
            "stop_token": (
                prompt,
                {"max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [full[6]]},
            ),
            # Stop strings are the tokenizer side's (the scheduler sees ids): no effect here.
            "stop_str": (prompt, {"max_new_tokens": 12, "ignore_eos": True, "stop": ["zzz"]}),
            "zero": (prompt, {"max_new_tokens": 0}),
            "one": (prompt, {"max_new_tokens": 1, "ignore_eos": True}),
        },
        overlap,
    )
    assert done["eos"] == {
        "ids": full[: eos_at + 1],
        "reason": "stop",
        "matched": full[4],
        "cached": 0,
        "completion_tokens": eos_at + 1,
    }
    assert done["ignore_eos"]["ids"] == full and done["ignore_eos"]["reason"] == "length"
    assert done["stop_token"]["ids"] == full[: stop_at + 1]
    assert (done["stop_token"]["reason"], done["stop_token"]["matched"]) == ("stop", full[6])
    assert done["stop_str"]["ids"] == full and done["stop_str"]["reason"] == "length"
    assert done["zero"]["ids"] == [] and done["zero"]["reason"] == "length"
    assert done["one"]["ids"] == full[:1] and done["one"]["reason"] == "length"
    assert_no_leak(sched)


def test_max_new_tokens_past_the_context_rejected() -> None:
    # The front end resolves an unset max_new_tokens to what the context leaves; one that is
    # set and does not fit is refused, here as there (the same check_seq).
    sched, _ = make_scheduler(num_slots=17, context_length=16)
    with pytest.raises(
        ValueError, match="the context length is 16 tokens, but the request asks for 110"
    ):
        sched.add_request(GenerateReq("a", list(range(1, 11)), SamplingParams(max_new_tokens=100)))
    assert not sched.has_work


@pytest.mark.parametrize(
    ("input_ids", "message"),
    [
        ([], "the prompt is empty"),
        ([1, VOCAB], f"invalid token id {VOCAB}: ids must be in \\[0, {VOCAB}\\)"),
        ([-1], "invalid token id -1"),
        ([1, 2.0], "invalid token id 2.0"),
        (list(range(1, 17)), "the prompt has 16 tokens; the context length is 16"),
    ],
)
def test_invalid_requests_rejected(input_ids: list, message: str) -> None:
    sched, _ = make_scheduler(context_length=16)
    with pytest.raises(ValueError, match=message):
        sched.add_request(GenerateReq("a", input_ids, SamplingParams(max_new_tokens=0)))
    assert not sched.has_work


def test_request_larger_than_kv_cache_rejected() -> None:
    sched, _ = make_scheduler(num_slots=9, context_length=64)
    with pytest.raises(ValueError, match="needs 12 KV slots; the KV cache holds 8"):
        sched.add_request(GenerateReq("a", [1] * 4, SamplingParams(max_new_tokens=8)))


def test_duplicate_rid_rejected() -> None:
    sched, _ = make_scheduler()
    sched.add_request(GenerateReq("a", [1], SamplingParams(max_new_tokens=1)))
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        sched.add_request(GenerateReq("a", [1], SamplingParams(max_new_tokens=1)))


@pytest.mark.parametrize("overlap", [0, 1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_abort_frees_everything(prefix_caching: bool, overlap: int) -> None:
    sched, runner = make_scheduler(chunked_prefill_size=4, enable_prefix_caching=prefix_caching)
    for rid in "abc":
        sched.add_request(GenerateReq(rid, list(range(1, 11)), SamplingParams(max_new_tokens=8)))
    step(sched, runner, overlap)  # "a" is half prefilled, the others wait
    assert sched.chunked is not None and sched.chunked.rid == "a"
    out = sched.abort("a")
    assert out is not None and out.finished_reason == "abort" and out.rid == "a"
    assert sched.abort("a") is None  # once
    for _ in range(4):
        for out in step(sched, runner, overlap):  # "b" is decoding, "c" waits or prefills
            assert out.rid != "a"
    for rid in "bc":
        out = sched.abort(rid)
        assert out is not None and out.finished_reason == "abort"
    assert sched.abort("nope") is None
    if overlap:  # the requests of the steps in flight wait for them to free their slots
        assert sched.in_flight
        assert set(sched.reqs) == {r.rid for step, _ in sched.in_flight for r in step.reqs}
        assert not sched.flush_cache()
        assert sched.drain().unpack() == []  # its tokens are dropped
    assert_no_leak(sched)
    assert sched.flush_cache()
    assert sched.kv.allocator.available == sched.kv.allocator.capacity


def test_overlap_runs_extra_steps_and_drops_their_tokens() -> None:
    """A stop token is only seen once its step is back, when the next steps (with the request
    in them, as many as the overlap depth) are already running: their tokens are dropped,
    their slots freed with the rest."""
    prompt = [3, 1, 4, 1, 5]
    full = reference(prompt, 12)
    stop_at = full.index(full[5])
    tokens: dict[int, list[int]] = {}
    steps: dict[int, int] = {}
    for overlap in (0, 1, 2, 3):
        sched, runner = make_scheduler(enable_prefix_caching=False)
        params = {"max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [full[5]]}
        done = run_all(sched, runner, {"r": (prompt, params)}, overlap)
        tokens[overlap], steps[overlap] = done["r"]["ids"], len(runner.plans)
        assert_no_leak(sched)
        assert tokens[overlap] == full[: stop_at + 1]
        assert steps[overlap] == steps[0] + overlap


@pytest.mark.parametrize("overlap", [1, 2])
def test_overlap_never_plans_past_max_new_tokens(overlap: int) -> None:
    sched, runner = make_scheduler(enable_prefix_caching=False)
    done = run_all(
        sched, runner, {"r": ([1, 2, 3], {"max_new_tokens": 5, "ignore_eos": True})}, overlap
    )
    assert len(done["r"]["ids"]) == 5
    assert len(runner.plans) == 5  # a prefill and four decodes, none extra
    assert_no_leak(sched)


def test_flush_cache_refused_while_busy() -> None:
    sched, runner = make_scheduler()
    sched.add_request(GenerateReq("a", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    sched.step(runner.forward)
    assert not sched.flush_cache()


def test_a_bad_request_is_finished_with_an_error_and_the_others_go_on() -> None:
    """Whatever reaches the scheduler loop, a request that cannot be admitted (a top_k past
    int64 would overflow the plan's arrays on the next step and kill the process) is answered
    with an error output at once; the requests around it are served."""
    sched, runner = make_scheduler()
    loop = SchedulerLoop.__new__(SchedulerLoop)  # its sockets are not needed here
    loop.scheduler = sched
    loop.routes = OutputRoutes([])
    good = [3, 1, 4, 1, 5]
    assert loop._handle(GenerateReq("before", good, SamplingParams(max_new_tokens=6))) is None
    bad = [
        GenerateReq("top_k", good, SamplingParams(max_new_tokens=6, top_k=2**63)),
        GenerateReq("seed", good, SamplingParams(max_new_tokens=6, seed=2**64)),
        GenerateReq("params", good, None),
    ]  # type: ignore[arg-type]
    for req in bad:
        out = loop._handle(req)
        assert out.rid == req.rid and out.finished_reason == "abort" and out.error, req.rid
    assert loop._handle(GenerateReq("after", good, SamplingParams(max_new_tokens=6))) is None
    ids: dict[str, list[int]] = {"before": [], "after": []}
    while sched.has_work:
        for out in sched.step(runner.forward).unpack():
            ids[out.rid] += out.new_token_ids
    assert ids == {"before": reference(good, 6), "after": reference(good, 6)}
    assert_no_leak(sched)


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def test_outputs_go_to_the_tokenizer_worker_that_sent_the_request() -> None:
    outboxes = [_Outbox(), _Outbox()]
    routes = OutputRoutes(outboxes)  # type: ignore[arg-type]
    routes.admit("a", 0)
    routes.admit("b", 1)
    routes.admit("c", 1)
    routes.send_outputs(
        StepOutputs.pack(
            [TokenOutput("a", [1]), TokenOutput("b", [2, 4], "length"), TokenOutput("c", [3])]
        )
    )
    assert [m.rids for m in outboxes[0].sent] == [["a"]]
    assert [m.rids for m in outboxes[1].sent] == [["b", "c"]]
    assert outboxes[1].sent[0].unpack() == [
        TokenOutput("b", [2, 4], "length"),
        TokenOutput("c", [3]),
    ]
    assert routes.worker_of == {"a": 0, "c": 1}  # a finished request is forgotten
    routes.forget("c")  # aborted: its answer is a reply
    routes.send_replies({1: [TokenOutput("c", [], "abort")], 0: [FlushCacheOutput(True)]})
    assert isinstance(outboxes[1].sent[-1], Replies) and outboxes[1].sent[-1].items[0].rid == "c"
    assert outboxes[0].sent[-1].items == [FlushCacheOutput(True)]
    assert routes.worker_of == {"a": 0}
    # One worker: everything to it, nothing recorded.
    single = OutputRoutes([_Outbox()])  # type: ignore[list-item]
    single.admit("x", 0)
    single.send_outputs(StepOutputs.pack([TokenOutput("x", [1])]))
    assert single.worker_of == {} and len(single.senders[0].sent) == 1  # type: ignore[attr-defined]


def test_outputs_split_by_worker_keep_every_field() -> None:
    """Two workers: each gets its requests' outputs, tokens, logprobs and top logprobs with
    them, as one worker would get them all."""
    outputs = [
        TokenOutput("a", [1, 2], None, None, 4, 2, 1, [-0.5, -1.0], [[(1, -0.5)], [(2, -1.0)]]),
        TokenOutput("b", [3], "stop", 3, 5, 7, 0),
        TokenOutput("c", [], "length", None, 6, 9, 2),
        TokenOutput("d", [4, 5, 6], None, None, 2, 3, 0, [-1.5, -2.0, -2.5]),
    ]
    outboxes = [_Outbox(), _Outbox()]
    routes = OutputRoutes(outboxes)  # type: ignore[arg-type]
    for rid, worker in zip("abcd", [1, 0, 1, 0], strict=True):
        routes.admit(rid, worker)
    routes.send_outputs(loads(dumps(StepOutputs.pack(outputs))))
    got = [loads(dumps(m)).unpack() for box in outboxes for m in box.sent]
    assert got == [[outputs[1], outputs[3]], [outputs[0], outputs[2]]]
    assert routes.worker_of == {"a": 1, "d": 0}


@pytest.mark.parametrize("overlap", [0, 2])
def test_stream_interval_sends_fewer_larger_outputs(overlap: int) -> None:
    """With --stream-interval 3 a request's outputs are its first token, then three at a time,
    then the rest with its end: the same ids and finish as one output per token."""
    reqs = {
        f"r{i}": ([5 + i, 9, 2 + i], {"max_new_tokens": n}) for i, n in enumerate([1, 2, 4, 8, 10])
    }
    chunks: dict[str, list[int]] = {rid: [] for rid in reqs}
    per_token = run_all(*make_scheduler(), reqs, overlap)
    sched, runner = make_scheduler(stream_interval=3)
    for rid, (prompt, params) in reqs.items():
        sched.add_request(GenerateReq(rid, prompt, SamplingParams.from_dict(params)))
    ids: dict[str, list[int]] = {rid: [] for rid in reqs}
    reasons: dict[str, str | None] = {}
    while sched.has_work:
        for out in step(sched, runner, overlap):
            chunks[out.rid].append(len(out.new_token_ids))
            ids[out.rid] += out.new_token_ids
            reasons[out.rid] = out.finished_reason
            assert out.completion_tokens == len(ids[out.rid])
    for rid, (_, params) in reqs.items():
        assert ids[rid] == per_token[rid]["ids"] and reasons[rid] == "length"
        n = params["max_new_tokens"]
        assert chunks[rid][0] == 1 and sum(chunks[rid]) == n
        assert all(c == 3 for c in chunks[rid][1:-1]) and 1 <= chunks[rid][-1] <= 3
    assert chunks["r4"] == [1, 3, 3, 3]
    assert_no_leak(sched)


def test_plans_carry_each_request_s_own_sampling_parameters() -> None:
    """A plan's sampling arrays are gathered from its requests' table rows: with two rows for
    six requests, each row is reused, and every plan's arrays are still those of the
    requests it holds."""
    sched, runner = make_scheduler(max_running_requests=2, enable_mixed_chunk=True)
    for i in range(6):
        params = SamplingParams(
            max_new_tokens=2 + i % 3,
            temperature=0.1 * i,
            top_p=1 - 0.1 * i,
            top_k=[-1, 3][i % 2],
            min_p=0.01 * i,
            seed=100 + i,
            logprobs=i == 3,
            top_logprobs_num=2 if i == 3 else 0,
        )
        sched.add_request(GenerateReq(f"r{i}", [1 + i, 2, 3], params))
    seen = set()
    while sched.has_work:
        scheduled = sched.schedule()
        assert scheduled is not None
        plan, reqs = scheduled.plan, scheduled.reqs
        params = [r.params for r in reqs]
        assert plan.temperatures.tolist() == pytest.approx([p.temperature for p in params])
        assert plan.top_ps.tolist() == pytest.approx([p.top_p for p in params])
        assert plan.top_ks.tolist() == [p.top_k if p.top_k > 0 else VOCAB for p in params]
        assert plan.min_ps.tolist() == pytest.approx([p.min_p for p in params])
        assert plan.seeds.tolist() == [r.seed for r in reqs] == [p.seed for p in params]
        assert plan.return_logprob == any(p.logprobs for p in params)
        assert plan.top_logprobs_num == max(p.top_logprobs_num for p in params)
        seen |= {(r.row, r.rid) for r in reqs}
        sched.process_result(scheduled, runner.forward(plan))
    assert len(seen) == 6 and {row for row, _ in seen} == {0, 1}
    assert_no_leak(sched)


def test_slots_added_one_at_a_time_survive_the_buffer_growing() -> None:
    req = Req("a", [1], SamplingParams(), 0)
    req.add_slots(np.arange(3, dtype=np.int32))
    for slot in range(3, 300):  # past 64, 128, 256: the buffer is replaced each time
        req.add_slot(slot)
    assert req.slots.tolist() == list(range(300))
