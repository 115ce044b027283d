"""A step's inputs, from the plan's host arrays to the device in one upload.

The scheduler's plan is a few small numpy arrays. The runner lays them out on the host, in one
pinned buffer, as the tensors a forward reads: per token its id, position and KV slot, per
request its table row, KV length, prefix length, new tokens and first token, each padded to
the step's bucket (the one padding rule: padded tokens take id 0, position 0 and the dummy
slot; padded requests read table row 0 with no prefix and one token (decode) or none
(prefill)). One copy moves the buffer to the device, where the batch's tensors are views of it;
the same copy carries the step's request-to-token table writes and, under overlap, which input
ids are a table row's latest sampled id (still on the device), which two device ops then
apply.

`upload_step` puts a step in fresh device memory, at its own size (an uncaptured step); a
captured phase's `StaticBatch` (graphs/static_batch.py) keeps one device buffer whose
per-bucket views its graphs read, the same addresses for every step of a bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from srt.batch_layout import DUMMY_SLOT, ForwardMode
from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan

_I64, _I32 = 8, 4


def _aligned(nbytes: int) -> int:
    """Byte offsets stay multiples of 8, so that every field can be viewed as int64."""
    return -(-nbytes // _I64) * _I64


@dataclass(frozen=True)
class InputsLayout:
    """Where each field of a step of `tokens` tokens and `requests` requests lies in the
    buffer: the int64 token fields and table rows, then the int32 request fields."""

    tokens: int
    requests: int

    @property
    def i64_fields(self) -> int:  # input_ids, positions, out_cache_loc; req_pool_indices
        return 3 * self.tokens + self.requests

    @property
    def i32_offset(self) -> int:
        return self.i64_fields * _I64

    @property
    def nbytes(self) -> int:
        # seq_lens, prefix_lens, extend_lens, extend_start_loc
        return _aligned(self.i32_offset + 4 * self.requests * _I32)


@dataclass(frozen=True)
class ExtrasLayout:
    """What the same upload carries for the device ops before the forward: the table writes
    (flat index into the table, slot) and, under overlap, the table row whose latest sampled
    id is each token's input (-1: its id is in the plan)."""

    writes: int
    sources: int  # tokens with a source array (0: none)
    all_from_rows: bool = False  # every one of them is a row's latest id (a plain decode)

    @property
    def nbytes(self) -> int:
        return _aligned((self.writes + self.sources) * _I64 + self.writes * _I32)


def pack_inputs(plan: BatchPlan, layout: InputsLayout, out: np.ndarray) -> None:
    """Write `plan`'s inputs, padded to `layout`, into the bytes `out` (the padding rule)."""
    t, r = layout.tokens, layout.requests
    n, b = plan.num_tokens, plan.batch_size
    if n > t or b > r:
        raise ValueError(
            f"a batch of {b} requests and {n} tokens does not fit a bucket of {r} requests and "
            f"{t} tokens"
        )
    i64 = out[: layout.i32_offset].view(np.int64)
    i32 = out[layout.i32_offset : layout.i32_offset + 4 * r * _I32].view(np.int32)
    ids, pos, locs, rows = i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t], i64[3 * t :]
    seq, prefix, extend, start = i32[:r], i32[r : 2 * r], i32[2 * r : 3 * r], i32[3 * r :]
    ids[:n], ids[n:] = plan.input_ids, 0
    pos[:n], pos[n:] = plan.positions, 0
    locs[:n], locs[n:] = plan.out_cache_loc, DUMMY_SLOT
    rows[:b], rows[b:] = plan.req_pool_indices, 0
    prefix[:b], prefix[b:] = plan.prefix_lens, 0
    decode = plan.forward_mode == ForwardMode.DECODE
    extend[:b], extend[b:] = plan.extend_lens, 1 if decode else 0
    np.add(prefix, extend, out=seq)
    # Each request's first token: a padded decode request its own, a padded prefill request
    # (no tokens) the end of the real ones.
    np.cumsum(extend, out=start)
    start -= extend


def pack_extras(plan: BatchPlan, layout: ExtrasLayout, width: int, out: np.ndarray) -> None:
    w, s = layout.writes, layout.sources
    i64 = out[: (w + s) * _I64].view(np.int64)
    np.multiply(plan.table_rows, width, out=i64[:w])
    i64[:w] += plan.table_cols
    if s:
        assert plan.input_from_row is not None, "a layout with sources has them"
        i64[w:] = plan.input_from_row
    out[(w + s) * _I64 : (w + s) * _I64 + w * _I32].view(np.int32)[:] = plan.table_slots


def extras_layout(plan: BatchPlan) -> ExtrasLayout:
    sources = plan.input_from_row
    if sources is None:
        return ExtrasLayout(len(plan.table_rows), 0)
    return ExtrasLayout(len(plan.table_rows), len(sources), bool((sources >= 0).all()))


def batch_views(
    plan: BatchPlan, layout: InputsLayout, buffer: torch.Tensor, req_to_token: torch.Tensor
) -> ForwardBatch:
    """The padded batch whose device tensors view `buffer` laid out as `layout`; its counts
    and host arrays are those of the plan's real requests."""
    t, r = layout.tokens, layout.requests
    i64 = buffer[: layout.i32_offset].view(torch.int64)
    i32 = buffer[layout.i32_offset : layout.i32_offset + 4 * r * _I32].view(torch.int32)
    ids, pos, locs, rows = i64.split([t, t, t, r])
    seq, prefix, extend, start = i32.split(r)
    prefix_host = plan.prefix_lens
    return ForwardBatch(
        mode=ForwardMode(plan.forward_mode),
        batch_size=plan.batch_size,
        num_tokens=plan.num_tokens,
        input_ids=ids,
        positions=pos,
        out_cache_loc=locs,
        req_pool_indices=rows,
        seq_lens=seq,
        prefix_lens=prefix,
        extend_lens=extend,
        extend_start_loc=start,
        seq_lens_cpu=prefix_host + plan.extend_lens,
        prefix_lens_cpu=prefix_host,
        extend_lens_cpu=plan.extend_lens,
        req_pool_indices_cpu=plan.req_pool_indices,
        req_to_token=req_to_token,
    )


def apply_extras(
    batch: ForwardBatch,
    layout: ExtrasLayout,
    extras: torch.Tensor,
    latest_ids: torch.Tensor | None,
) -> None:
    """Apply the table writes the upload carried, and take the ids that are rows' latest
    samples from `latest_ids` (they are not on the host yet)."""
    w, s = layout.writes, layout.sources
    i64 = extras[: (w + s) * _I64].view(torch.int64)
    if w:
        slots = extras[(w + s) * _I64 : (w + s) * _I64 + w * _I32].view(torch.int32)
        batch.req_to_token.view(-1).index_copy_(0, i64[:w], slots)
    if s:
        assert latest_ids is not None, "ids from the rows need the rows' latest ids"
        src, ids = i64[w:], batch.input_ids[:s]
        if layout.all_from_rows:
            torch.index_select(latest_ids, 0, src, out=ids)
        else:
            from_rows = latest_ids.index_select(0, src.clamp(min=0))
            torch.where(src >= 0, from_rows, ids, out=ids)


def staging(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host buffer for one upload: pinned where the device is a GPU, so the copy runs
    behind the host. A fresh one per step: the pinned allocator hands a block back only once
    the copy that read it has run, so a step prepared ahead never overwrites one in flight."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def upload_step(
    plan: BatchPlan,
    req_to_token: torch.Tensor,
    latest_ids: torch.Tensor | None = None,
    layout: InputsLayout | None = None,
) -> ForwardBatch:
    """`plan` as a batch in fresh device memory (padded to `layout`, by default its own size),
    its table writes applied, in one upload."""
    layout = layout or InputsLayout(plan.num_tokens, plan.batch_size)
    extras = extras_layout(plan)
    host = staging(layout.nbytes + extras.nbytes, req_to_token.device)
    view = host.numpy()
    pack_inputs(plan, layout, view[: layout.nbytes])
    pack_extras(plan, extras, req_to_token.shape[1], view[layout.nbytes :])
    device = host.to(req_to_token.device, non_blocking=True)
    batch = batch_views(plan, layout, device, req_to_token)
    apply_extras(batch, extras, device[layout.nbytes :], latest_ids)
    return batch
