"""The per-step messages: a step's outputs packed into arrays and back, frames with out-of-band
arrays, and outputs of one sequence folded together when a consumer falls behind."""

from __future__ import annotations

import numpy as np

from srt.ipc.channels import dumps, loads
from srt.ipc.messages import BatchPlan, StepOutputs, StepOutputsBuilder, TokenOutput
from srt.server.seq_outputs import coalesce


def outputs() -> list[TokenOutput]:
    return [
        TokenOutput("a", [5], prompt_tokens=3, completion_tokens=1),
        TokenOutput(
            "b",
            [7, 8],
            finished_reason="stop",
            matched_stop=8,
            prompt_tokens=4,
            completion_tokens=9,
            cached_tokens=2,
            logprobs=[-0.5, -1.25],
            top_logprobs=[[(7, -0.5), (1, -2.0)], [(8, -1.25), (2, -3.0)]],
        ),
        TokenOutput("c", [], finished_reason="abort", error="refused"),
        TokenOutput("d", [9], logprobs=[-0.75], top_logprobs=[[(9, -0.75)]]),
        TokenOutput("e", [1], matched_stop="end"),
    ]


def test_step_outputs_round_trip() -> None:
    packed = StepOutputs.pack(outputs())
    assert packed.token_ids.tolist() == [5, 7, 8, 9, 1]
    assert packed.top_ids.shape == (5, 2)  # padded to the most any request asked
    assert packed.unpack() == outputs()
    assert loads(dumps(packed)).unpack() == outputs()
    assert StepOutputs.pack([]).unpack() == []


def test_outputs_added_in_parts_keep_their_logprobs() -> None:
    """Columns added in several parts (the outputs of several steps in one message) keep each
    request's logprobs on its own tokens."""
    a, b, _, d, _ = outputs()
    builder = StepOutputsBuilder()
    builder.add(["a"], [1], [5], [None], [None], [3], [1], [0], {})
    builder.add(
        ["b", "d"],
        [2, 1],
        [7, 8, 9],
        ["stop", None],
        [8, None],
        [4, 0],
        [9, 0],
        [2, 0],
        {0: (b.logprobs, b.top_logprobs), 1: (d.logprobs, d.top_logprobs)},
    )
    assert builder.build().unpack() == [a, b, d]


def test_large_arrays_travel_out_of_band() -> None:
    n = 10_000
    ids, positions, locs = (np.arange(n, dtype=np.int32) + k for k in range(3))
    plan = BatchPlan(
        0, ids, positions, locs, *(np.zeros(1, np.int32),) * 6, *(np.zeros(1, np.float32),) * 2,
        np.ones(1, np.int64), np.zeros(1, np.float32), np.zeros(1, np.int64),
    )  # fmt: skip
    frames = dumps(plan)
    assert len(frames) == 2  # the pickle, then every array of the plan in one buffer
    assert len(frames[0]) < 2000  # which is not in the pickle
    back = loads([bytes(f) for f in frames])
    for name in ("input_ids", "positions", "out_cache_loc", "top_ks", "seeds"):
        want = getattr(plan, name)
        got = getattr(back, name)
        assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all()
    assert back.input_from_row is None and back.forward_mode == 0
    assert len(dumps(TokenOutput("a", [1]))) == 1  # small messages stay one frame


def test_coalesce_folds_each_sequence_in_order() -> None:
    got = coalesce(
        [
            TokenOutput("a", [1], logprobs=[-1.0], completion_tokens=1),
            TokenOutput("b", [5], completion_tokens=1),
            TokenOutput("a", [2], logprobs=[-2.0], completion_tokens=2),
            TokenOutput("a", [3], logprobs=[-3.0], completion_tokens=3, finished_reason="length"),
        ]
    )
    assert [o.rid for o in got] == ["a", "b"]
    a = got[0]
    assert (a.new_token_ids, a.logprobs, a.completion_tokens) == ([1, 2, 3], [-1.0, -2.0, -3.0], 3)
    assert a.finished_reason == "length"


def test_a_receiver_drains_what_arrived_in_one_wake() -> None:
    """On an event loop, a receiver returns every message waiting at once, in order, and an
    await with nothing waiting wakes when the next one comes (the descriptor is
    edge-triggered: a lost edge would hang here)."""
    import asyncio

    import zmq

    from srt.ipc.channels import Endpoints, Receiver, Sender, to_tokenizer
    from srt.ipc.messages import Replies

    endpoints = Endpoints.create()
    ctx = zmq.Context()
    channel = to_tokenizer(0)
    inbox, outbox = Receiver(ctx, endpoints, channel), Sender(ctx, endpoints, channel)

    async def scenario() -> list[list[int]]:
        got = []
        for i in range(3):
            outbox.send(Replies([TokenOutput(f"r{i}", [i])]))
        while sum(map(len, got)) < 3:
            got.append([len(m.items) for m in await inbox.recv_all_async()])
        later = asyncio.get_running_loop().call_later(
            0.05, outbox.send, Replies([TokenOutput("late", [9])])
        )
        woke = await asyncio.wait_for(inbox.recv_all_async(), timeout=5)
        later.cancel()
        assert [m.items[0].rid for m in woke] == ["late"]
        return got

    try:
        got = asyncio.run(scenario())
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
        endpoints.remove()
    assert sum(map(len, got)) == 3


def test_a_receiver_polls_awhile_before_it_sleeps() -> None:
    """`poll(timeout_ms, busy_s)`: a message that comes while it polls, or after, while it
    sleeps, is seen; none within the timeout is none."""
    import threading

    import zmq

    from srt.ipc.channels import Endpoints, Receiver, Sender, to_tokenizer
    from srt.ipc.messages import Replies

    endpoints = Endpoints.create()
    ctx = zmq.Context()
    channel = to_tokenizer(0)
    inbox, outbox = Receiver(ctx, endpoints, channel), Sender(ctx, endpoints, channel)
    try:
        assert not inbox.poll(0, busy_s=0.02)  # nothing: the timeout ends the polling
        assert not inbox.poll(30, busy_s=0.01)  # nothing: polled, then asleep till the end
        for busy_s in (0.5, 0.001):  # the message comes while it polls; while it sleeps
            timer = threading.Timer(0.05, outbox.send, (Replies([TokenOutput("r", [1])]),))
            timer.start()
            assert inbox.poll(None, busy_s)
            assert inbox.recv().items[0].rid == "r"
            timer.join()
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
        endpoints.remove()
