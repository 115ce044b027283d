"""The radix prefix cache: match, split, insert, evict, and the lock and slot accounting."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_helpers import (
    assert_no_leak,
    make_scheduler,
    reference,
    shared_prefix_workload,
    step,
)

from srt.ipc.messages import GenerateReq
from srt.sampling_params import SamplingParams
from srt.scheduler.kv_allocator import TokenSlotAllocator
from srt.scheduler.prefix_cache import PrefixCache
from srt.scheduler.req import Req

CAPACITY = 64


def setup() -> tuple[PrefixCache, TokenSlotAllocator]:
    alloc = TokenSlotAllocator(CAPACITY + 1)
    return PrefixCache(alloc), alloc


def start(cache: PrefixCache, alloc: TokenSlotAllocator, prompt: list[int]) -> Req:
    """Admit a request as the scheduler does: take its cached prefix, compute the rest."""
    req = Req("r", prompt, SamplingParams(), seed=0)
    cache.attach(req)
    req.slots = np.concatenate([req.slots, alloc.alloc(len(prompt) - req.kv_len)])
    req.kv_len = len(prompt)
    return req


def finish(cache: PrefixCache, req: Req) -> None:
    cache.release(req, req.input_ids, req.slots)


def check_accounting(cache: PrefixCache, alloc: TokenSlotAllocator) -> None:
    """Every slot is exactly once either free or in the tree; sizes agree with the nodes."""
    nodes = cache._nodes()
    tree_slots = np.concatenate([n.slots for n in nodes]) if nodes else np.zeros(0, np.int32)
    assert sum(len(n.key) for n in nodes) == cache.size == len(tree_slots)
    assert all(len(n.key) == len(n.slots) for n in nodes)
    assert cache.locked_size == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    everything = np.concatenate([tree_slots, alloc._stack[: alloc._top]])
    assert sorted(everything.tolist()) == list(range(1, CAPACITY + 1))


def test_match_splits_a_node_and_shares_its_slots() -> None:
    cache, alloc = setup()
    a = start(cache, alloc, [1, 2, 3, 4, 5, 6])
    finish(cache, a)
    assert cache.size == 6 and cache.evictable_size == 6

    b = start(cache, alloc, [1, 2, 3, 9, 9])
    assert b.cached_tokens == 3
    assert b.slots[:3].tolist() == a.slots[:3].tolist()
    (upper,) = cache.root.children.values()
    assert upper.key == [1, 2, 3] and [n.key for n in upper.children.values()] == [[4, 5, 6]]
    assert cache.locked_size == 3 and cache.evictable_size == 3
    finish(cache, b)
    assert cache.size == 8 and cache.locked_size == 0
    assert sorted(n.key[0] for n in upper.children.values()) == [4, 9]
    check_accounting(cache, alloc)


def test_never_matches_the_whole_prompt() -> None:
    cache, alloc = setup()
    finish(cache, start(cache, alloc, [1, 2, 3, 4]))
    again = start(cache, alloc, [1, 2, 3, 4])
    assert again.cached_tokens == 3  # the last token is recomputed for its logits
    finish(cache, again)
    assert cache.size == 4
    check_accounting(cache, alloc)  # the duplicate slot of token 4 went back to the allocator


def test_duplicates_computed_concurrently_are_freed() -> None:
    cache, alloc = setup()
    a = start(cache, alloc, [5, 6, 7, 8])
    b = start(cache, alloc, [5, 6, 7, 8, 9])  # admitted before a finished: no hit
    assert b.cached_tokens == 0
    finish(cache, a)
    finish(cache, b)
    assert cache.size == 5
    check_accounting(cache, alloc)


def test_locked_prefix_survives_eviction() -> None:
    cache, alloc = setup()
    finish(cache, start(cache, alloc, [1, 2, 3, 4]))
    finish(cache, start(cache, alloc, [7, 8, 9]))
    running = start(cache, alloc, [1, 2, 3, 5])  # locks [1, 2, 3]
    assert cache.evictable_size == 4  # [4] and [7, 8, 9]

    assert cache.evict(100) == 4
    assert cache.size == 3 and cache.evictable_size == 0
    assert [n.key for n in cache._nodes()] == [[1, 2, 3]]
    finish(cache, running)
    assert cache.evictable_size == 4  # [1, 2, 3] and [5]
    check_accounting(cache, alloc)
    assert cache.evict(1) == 1  # the leaf [5] goes first, its parent stays
    assert [n.key for n in cache._nodes()] == [[1, 2, 3]]
    assert cache.evict(1) == 3
    assert cache.size == 0
    check_accounting(cache, alloc)


def test_evicts_least_recently_used_first() -> None:
    cache, alloc = setup()
    for prompt in ([1, 1, 1], [2, 2, 2], [3, 3, 3]):
        finish(cache, start(cache, alloc, prompt))
    touched = start(cache, alloc, [1, 1, 1, 1])  # a hit refreshes [1, 1, 1]
    finish(cache, touched)
    cache.evict(3)
    assert sorted(n.key[0] for n in cache.root.children.values()) == [1, 3]
    cache.evict(3)
    assert sorted(n.key[0] for n in cache.root.children.values()) == [1]
    check_accounting(cache, alloc)


def test_shared_prefix_locked_twice_unlocked_twice() -> None:
    cache, alloc = setup()
    finish(cache, start(cache, alloc, [1, 2, 3, 4, 5]))
    a = start(cache, alloc, [1, 2, 3, 4, 6])
    b = start(cache, alloc, [1, 2, 7])  # splits the node a holds locked
    assert cache.locked_size == 4
    finish(cache, a)
    assert cache.locked_size == 2  # b still holds [1, 2]
    assert cache.evict(100) == 4  # [3, 4], [5] and a's [6], but not [1, 2]
    finish(cache, b)
    assert cache.locked_size == 0
    check_accounting(cache, alloc)


def test_detach_undoes_attach() -> None:
    cache, alloc = setup()
    finish(cache, start(cache, alloc, [1, 2, 3]))
    req = Req("r", [1, 2, 3, 4], SamplingParams(), seed=0)
    cache.attach(req)
    assert req.kv_len == req.cached_tokens == 3 and cache.locked_size == 3
    cache.detach(req)
    assert (req.kv_len, req.cached_tokens, len(req.slots), req.cache_node) == (0, 0, 0, None)
    assert cache.locked_size == 0
    check_accounting(cache, alloc)


def test_reset_returns_every_slot() -> None:
    cache, alloc = setup()
    for prompt in ([1, 2, 3], [1, 2, 4], [9]):
        finish(cache, start(cache, alloc, prompt))
    cache.reset()
    assert cache.size == 0 and not cache.root.children
    assert alloc.available == CAPACITY


@pytest.mark.parametrize("overlap", [False, True])
def test_accounting_after_a_scheduler_run_with_stops_and_aborts(overlap: bool) -> None:
    """Requests sharing prefixes end by length, by a stop token (one step later than it is
    sampled, under overlap) or by an abort while their steps are in flight: each caches what
    its KV really holds, every slot is once free or in the tree, and the ids are right."""
    sched, runner = make_scheduler(
        num_slots=CAPACITY + 1,
        max_running_requests=8,
        chunked_prefill_size=4,
        max_prefill_tokens=24,
        enable_prefix_caching=True,
    )
    reqs = shared_prefix_workload(30, seed=3)
    want = {
        rid: reference(prompt, params["max_new_tokens"]) for rid, (prompt, params) in reqs.items()
    }
    for i, (rid, (prompt, params)) in enumerate(reqs.items()):
        if i % 3 == 0 and len(want[rid]) >= 3:
            params["stop_token_ids"] = [want[rid][2]]
            want[rid] = want[rid][: want[rid].index(want[rid][2]) + 1]
        sched.add_request(GenerateReq(rid, prompt, SamplingParams.from_dict(params)))
    aborted = {rid for i, rid in enumerate(reqs) if i % 5 == 1}
    got: dict[str, list[int]] = {rid: [] for rid in reqs}
    while sched.has_work:
        for out in step(sched, runner, overlap):
            got[out.rid] += out.new_token_ids
            if out.rid in aborted and out.finished_reason is None and len(got[out.rid]) >= 2:
                assert sched.abort(out.rid) is not None
    for rid in reqs:
        if rid in aborted:
            assert got[rid] == want[rid][: len(got[rid])], rid
        else:
            assert got[rid] == want[rid], rid
    assert_no_leak(sched)
    assert sched.kv.prefix_cache is not None and sched.info().cached_tokens > 0
    check_accounting(sched.kv.prefix_cache, sched.kv.allocator)
