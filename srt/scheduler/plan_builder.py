"""A step's `BatchPlan` from its requests: the tokens' ids, positions and KV slots, the runner's
table writes, and the sampling parameters.

Building a plan takes the slots its tokens write and records, on each request, the slots and
table entries the plan sends; the caller commits the rest of the step (KV lengths, outputs
pending). A decode whose input is a token that a step still in flight samples says so in
`input_from_row` (overlap: that id stays on the device, in the runner's latest id of the
request's table row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from srt.batch_layout import ForwardMode
from srt.ipc.messages import BatchPlan
from srt.scheduler.req import Req

AllocSlots = Callable[[int], np.ndarray]  # n -> n fresh KV slots


class _Tokens(NamedTuple):
    """A plan's per-token arrays and its table writes."""

    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    table_rows: np.ndarray
    table_cols: np.ndarray
    table_slots: np.ndarray
    input_from_row: np.ndarray | None


class SamplingRows:
    """The sampling parameters of each table row's request, as a plan's arrays hold them:
    written when a request gets its row, so that a plan gathers its rows' with one index per
    array instead of reading every request's parameters (a Python loop per array per step)."""

    def __init__(self, num_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.temperatures = np.zeros(num_rows, np.float32)
        self.top_ps = np.ones(num_rows, np.float32)
        self.top_ks = np.zeros(num_rows, np.int64)
        self.min_ps = np.zeros(num_rows, np.float32)
        self.seeds = np.zeros(num_rows, np.int64)
        self.logprobs = np.zeros(num_rows, bool)
        self.top_logprobs_num = np.zeros(num_rows, np.int64)

    def write(self, req: Req) -> None:
        """Record the parameters of `req`, which holds its table row now."""
        p, row = req.params, req.row
        self.temperatures[row] = p.temperature
        self.top_ps[row] = p.top_p
        self.top_ks[row] = p.top_k if p.top_k > 0 else self.vocab_size
        self.min_ps[row] = p.min_p
        self.seeds[row] = req.seed
        self.logprobs[row] = p.logprobs
        self.top_logprobs_num[row] = p.top_logprobs_num


def build_plan(
    mode: ForwardMode,
    reqs: list[Req],
    extends: list[int],
    step: int,
    sampling: SamplingRows,
    alloc: AllocSlots,
) -> BatchPlan:
    """The plan of step number `step` for `reqs`, each computing as many tokens as its entry
    of `extends` says, its KV slots taken with `alloc`."""
    n = len(reqs)
    req_rows = np.fromiter((r.row for r in reqs), np.int32, n)
    kv_lens = np.fromiter((r.kv_len for r in reqs), np.int32, n)
    if mode is ForwardMode.DECODE:
        tokens = _decode_tokens(reqs, req_rows, kv_lens, alloc)
    else:
        tokens = _extend_tokens(reqs, extends, alloc)
    return BatchPlan(
        forward_mode=int(mode),
        input_ids=tokens.input_ids,
        positions=tokens.positions,
        out_cache_loc=tokens.out_cache_loc,
        req_pool_indices=req_rows,
        prefix_lens=kv_lens,
        extend_lens=np.array(extends, np.int32),
        table_rows=tokens.table_rows,
        table_cols=tokens.table_cols,
        table_slots=tokens.table_slots,
        temperatures=sampling.temperatures[req_rows],
        top_ps=sampling.top_ps[req_rows],
        top_ks=sampling.top_ks[req_rows],
        min_ps=sampling.min_ps[req_rows],
        seeds=sampling.seeds[req_rows],
        return_logprob=bool(sampling.logprobs[req_rows].any()),
        top_logprobs_num=int(sampling.top_logprobs_num[req_rows].max()),
        step=step,
        input_from_row=tokens.input_from_row,
    )


def _decode_tokens(
    reqs: list[Req],
    req_rows: np.ndarray,
    kv_lens: np.ndarray,
    alloc: AllocSlots,
) -> _Tokens:
    # One token each, and each row already holds [0, kv_len): built as whole arrays, since
    # this runs every step for every running request.
    n = len(reqs)
    new = alloc(n)
    for req, slot in zip(reqs, new.tolist(), strict=True):
        req.add_slot(slot)
        req.table_len = req.kv_len + 1
    pending = _pending(reqs)
    if pending.all():
        # Overlapped decoding's usual step: every input is a token a step in flight samples,
        # which stays on the device; none is read here.
        return _Tokens(np.zeros(n, np.int32), kv_lens, new, req_rows, kv_lens, new, req_rows)
    ids = np.fromiter(
        (0 if p else r.output_ids[-1] for r, p in zip(reqs, pending.tolist(), strict=True)),
        np.int32,
        n,
    )
    input_from_row = None
    if pending.any():
        input_from_row = np.where(pending > 0, req_rows, -1).astype(np.int32)
    return _Tokens(ids, kv_lens, new, req_rows, kv_lens, new, input_from_row)


def _extend_tokens(reqs: list[Req], extends: list[int], alloc: AllocSlots) -> _Tokens:
    pending = _pending(reqs).tolist()
    per_req = [
        _extend_one(req, extend, p, alloc)
        for req, extend, p in zip(reqs, extends, pending, strict=True)
    ]
    tokens = _Tokens(*(np.concatenate(part) for part in zip(*per_req, strict=True)))
    if not any(r.prompt_done and p for r, p in zip(reqs, pending, strict=True)):
        tokens = tokens._replace(input_from_row=None)
    return tokens


def _extend_one(req: Req, extend: int, pending: int, alloc: AllocSlots) -> _Tokens:
    """One request's tokens in an extend step: the next `extend` of its prompt, or its last
    output (a decode riding along in a mixed step; `pending`: the tokens steps in flight
    sample for it), with where each input id is, as `input_from_row`."""
    new = alloc(extend)
    start, end = req.kv_len, req.kv_len + extend
    req.add_slots(new)
    if req.prompt_done:
        ids = np.array([0 if pending else req.output_ids[-1]], np.int32)
        sources = np.array([req.row if pending else -1], np.int32)
    else:
        ids = np.asarray(req.input_ids[start:end], np.int32)
        sources = np.full(extend, -1, np.int32)
    # The runner's table row learns every slot it lacks (a prefix hit's too).
    tokens = _Tokens(
        ids,
        np.arange(start, end, dtype=np.int32),
        new,
        np.full(end - req.table_len, req.row, np.int32),
        np.arange(req.table_len, end, dtype=np.int32),
        req.slots[req.table_len : end],
        sources,
    )
    req.table_len = end
    return tokens


def _pending(reqs: list[Req]) -> np.ndarray:
    """How many tokens the steps in flight sample for each of `reqs`, not known here yet (an
    input that is one of them stays on the device)."""
    n = len(reqs)
    return np.fromiter([r.planned_outputs - len(r.output_ids) for r in reqs], np.int32, n)
