"""The scheduler against a fake runner that keeps a real paged 'KV cache' of (token, position).

The fake's next token is a hash of the whole context it reads back through the
request-to-token table, so a slot shared by two live requests, a slot evicted while in use, a
wrong table write or a wrong position all show up as a wrong token, and the right answer for
each request is computable alone. The fake also refuses a plan that reuses a slot or table
entry a step still in flight reads (what overlap scheduling must never do).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from srt.batch_layout import DUMMY_SLOT
from srt.ipc.messages import BatchPlan, BatchResult, GenerateReq, TokenOutput
from srt.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs

VOCAB = 50
EOS = 0


def next_token(context: np.ndarray) -> int:
    """The fake model: a deterministic function of every token in the context."""
    weights = np.arange(1, len(context) + 1, dtype=np.int64) * 7919
    return int((context.astype(np.int64) * weights).sum() + len(context) * 31) % (VOCAB - 1) + 1


def reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(next_token(np.array(prompt + out)))
    return out


class FakeRunner:
    """Runs a plan when it is launched (as the device would, in order) and checks that no
    plan reuses a KV slot or a table entry that a step still in flight reads."""

    def __init__(self, num_slots: int, rows: int, context_length: int) -> None:
        self.kv = np.full((num_slots, 2), -1, dtype=np.int64)  # slot -> (token, position)
        self.table = np.zeros((rows, context_length), dtype=np.int64)
        self.plans: list[BatchPlan] = []
        self.latest_ids = np.zeros(rows, np.int64)  # each table row's latest sampled id
        # Per step in flight: the KV slots it reads and writes, and the table entries it reads.
        self.in_flight: dict[int, tuple[set[int], set[tuple[int, int]]]] = {}

    def forward(self, plan: BatchPlan) -> BatchResult:
        return self.launch(plan)()

    def launch(self, plan: BatchPlan) -> Callable[[], BatchResult]:
        self.plans.append(plan)
        assert DUMMY_SLOT not in plan.out_cache_loc
        assert len(set(plan.out_cache_loc.tolist())) == plan.num_tokens
        for slots, entries in self.in_flight.values():
            assert not slots & set(plan.out_cache_loc.tolist()), "slot of a step in flight"
            writes = set(zip(plan.table_rows.tolist(), plan.table_cols.tolist(), strict=True))
            assert not entries & writes, "table entry of a step in flight"
        self.table[plan.table_rows, plan.table_cols] = plan.table_slots
        ids = plan.input_ids.astype(np.int64)
        if plan.input_from_row is not None:
            src = plan.input_from_row
            ids = np.where(src >= 0, self.latest_ids[np.maximum(src, 0)], ids)
        self.kv[plan.out_cache_loc] = np.stack([ids, plan.positions], axis=1)
        out = []
        slots, entries = set(plan.out_cache_loc.tolist()), set()
        for row, prefix, extend in zip(
            plan.req_pool_indices, plan.prefix_lens, plan.extend_lens, strict=True
        ):
            read = self.table[row, : prefix + extend]
            slots |= set(read.tolist())
            entries |= {(int(row), col) for col in range(prefix + extend)}
            kv = self.kv[read]
            assert (kv[:, 1] == np.arange(prefix + extend)).all(), "KV read at wrong positions"
            out.append(next_token(kv[:, 0]))
        sampled = np.array(out, dtype=np.int64)
        self.latest_ids[plan.req_pool_indices] = sampled
        result = BatchResult(next_token_ids=sampled, step=plan.step)
        self.in_flight[plan.step] = (slots, entries)

        def wait() -> BatchResult:
            del self.in_flight[plan.step]
            return result

        return wait


def make_scheduler(
    num_slots: int = 1024, context_length: int = 256, **kwargs
) -> tuple[Scheduler, FakeRunner]:
    args = ServerArgs(**kwargs)
    sched = Scheduler(
        args,
        num_slots=num_slots,
        context_length=context_length,
        vocab_size=VOCAB,
        eos_token_ids=[EOS],
    )
    return sched, FakeRunner(num_slots, args.max_running_requests, context_length)


def step(sched: Scheduler, runner: FakeRunner, overlap: int) -> list[TokenOutput]:
    """One step of the scheduler loop, overlapped `overlap` steps deep (0: not at all)."""
    if overlap:
        sched.overlap_depth = overlap
        outputs = sched.step_overlapped(runner.launch)
        return outputs.unpack() if outputs is not None else []
    return sched.step(runner.forward).unpack()


def run_all(
    sched: Scheduler,
    runner: FakeRunner,
    reqs: dict[str, tuple[list[int], dict]],
    overlap: int = 0,
) -> dict[str, dict]:
    """Submit every request, step until all finish; rid -> {ids, reason, matched, cached}."""
    for rid, (prompt, params) in reqs.items():
        sched.add_request(GenerateReq(rid, prompt, SamplingParams.from_dict(params)))
    done: dict[str, dict] = {}
    ids: dict[str, list[int]] = {rid: [] for rid in reqs}
    for _ in range(10_000):
        if not sched.has_work:
            break
        for out in step(sched, runner, overlap):
            assert out.rid not in done, "an output after the request finished"
            ids[out.rid] += out.new_token_ids
            if out.finished_reason is not None:
                done[out.rid] = {
                    "ids": ids[out.rid],
                    "reason": out.finished_reason,
                    "matched": out.matched_stop,
                    "cached": out.cached_tokens,
                    "completion_tokens": out.completion_tokens,
                }
    assert set(done) == set(reqs)
    return done


def assert_no_leak(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.allocator.available + kv.cached == kv.allocator.capacity
    assert kv.rows.available == sched.args.max_running_requests
    assert not sched.reqs and not sched.running and sched.chunked is None
    if kv.prefix_cache:
        assert kv.prefix_cache.locked_size == 0


def shared_prefix_workload(n: int, seed: int) -> dict[str, tuple[list[int], dict]]:
    rng = random.Random(seed)
    stems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    reqs = {}
    for i in range(n):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        reqs[f"r{i}"] = (
            rng.choice(stems) + tail,
            {"max_new_tokens": rng.randrange(1, 16), "ignore_eos": True},
        )
    return reqs
