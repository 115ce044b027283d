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


def build_plan(
    mode: ForwardMode,
    items: list[tuple[Req, int]],
    step: int,
    vocab_size: int,
    alloc: AllocSlots,
) -> BatchPlan:
    """The plan of step number `step` for `items` (each request with how many tokens it
    computes), its KV slots taken with `alloc`."""
    n = len(items)
    req_rows = np.fromiter((r.row for r, _ in items), np.int32, n)
    kv_lens = np.fromiter((r.kv_len for r, _ in items), np.int32, n)
    if mode is ForwardMode.DECODE:
        tokens = _decode_tokens(items, req_rows, kv_lens, alloc)
    else:
        tokens = _extend_tokens(items, alloc)
    params = [r.params for r, _ in items]
    return BatchPlan(
        forward_mode=int(mode),
        input_ids=tokens.input_ids,
        positions=tokens.positions,
        out_cache_loc=tokens.out_cache_loc,
        req_pool_indices=req_rows,
        prefix_lens=kv_lens,
        extend_lens=np.array([e for _, e in items], np.int32),
        table_rows=tokens.table_rows,
        table_cols=tokens.table_cols,
        table_slots=tokens.table_slots,
        temperatures=np.array([p.temperature for p in params], np.float32),
        top_ps=np.array([p.top_p for p in params], np.float32),
        top_ks=np.array([p.top_k if p.top_k > 0 else vocab_size for p in params], np.int64),
        min_ps=np.array([p.min_p for p in params], np.float32),
        seeds=np.array([r.seed for r, _ in items], np.int64),
        return_logprob=any(p.logprobs for p in params),
        top_logprobs_num=max(p.top_logprobs_num for p in params),
        step=step,
        input_from_row=tokens.input_from_row,
    )


def _decode_tokens(
    items: list[tuple[Req, int]],
    req_rows: np.ndarray,
    kv_lens: np.ndarray,
    alloc: AllocSlots,
) -> _Tokens:
    # One token each, and each row already holds [0, kv_len): built as whole arrays, since
    # this runs every step for every running request.
    n = len(items)
    new = alloc(n)
    for (req, _), slot in zip(items, new.tolist(), strict=True):
        req.add_slot(slot)
        req.table_len = req.kv_len + 1
    pending = np.fromiter((r.pending_outputs for r, _ in items), np.int32, n)
    if pending.all():
        # Overlapped decoding's usual step: every input is a token a step in flight samples,
        # which stays on the device; none is read here.
        return _Tokens(np.zeros(n, np.int32), kv_lens, new, req_rows, kv_lens, new, req_rows)
    ids = np.fromiter(
        (r.output_ids[-1] if not r.pending_outputs else 0 for r, _ in items), np.int32, n
    )
    input_from_row = None
    if pending.any():
        input_from_row = np.where(pending > 0, req_rows, -1).astype(np.int32)
    return _Tokens(ids, kv_lens, new, req_rows, kv_lens, new, input_from_row)


def _extend_tokens(items: list[tuple[Req, int]], alloc: AllocSlots) -> _Tokens:
    per_req = [_extend_one(req, extend, alloc) for req, extend in items]
    tokens = _Tokens(*(np.concatenate(part) for part in zip(*per_req, strict=True)))
    if not any(r.prompt_done and r.pending_outputs for r, _ in items):
        tokens = tokens._replace(input_from_row=None)
    return tokens


def _extend_one(req: Req, extend: int, alloc: AllocSlots) -> _Tokens:
    """One request's tokens in an extend step: the next `extend` of its prompt, or its last
    output (a decode riding along in a mixed step), with where each input id is, as
    `input_from_row`."""
    new = alloc(extend)
    start, end = req.kv_len, req.kv_len + extend
    req.add_slots(new)
    if req.prompt_done:
        ids = np.array([0 if req.pending_outputs else req.output_ids[-1]], np.int32)
        sources = np.array([req.row if req.pending_outputs else -1], np.int32)
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
