"""The `triton` attention backend (the CUDA default): paged decode and extend kernels in Triton.

Once per step, `init_forward_metadata` lays the batch out on the host, from the batch's CPU
lists (no device sync), as one int32 array that is copied to the device once and read by
every layer: per request its table row, KV length, prefix length, extend length and first
token; for extend batches also the list of query tiles. The padded tail of an extend batch is
one more request with no keys, and padded decode requests have length 0, so the kernels
themselves zero the padded rows. The array's views go on the batch (`StepMetadata` in
`batch.attn_metadata`), where `forward` reads them.

For CUDA graphs (the protocol in base.py), `init_graph_state` allocates that array and the
decode scratch as static buffers sized for the largest bucket; the replay hook refills them in
place and gives the batch views of them, so a captured graph reads the live batch. Those
views show whatever the latest hook filled in, so a forward refuses them once a hook has run
for another batch (`static_fill`). Every launch grid depends only on the bucket: tokens and
the bound on query tiles for extend, batch size and split count for decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from srt.batch_layout import ForwardMode
from srt.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend, AttentionInputs
from srt.layers.attention.triton_ops.decode_attention import (
    decode_attention,
    num_decode_splits,
)
from srt.layers.attention.triton_ops.extend_attention import (
    count_extend_tiles,
    extend_attention,
    extend_tiles,
    max_extend_tiles,
)

NUM_FIELDS = 5  # table row, seq len, prefix len, extend len, first token
# Every row of the metadata starts on a 16-byte boundary (a multiple of 4 int32s): Triton
# compiles a kernel variant per pattern of 16-byte-aligned pointer arguments, so rows that fell
# differently with the request and tile counts would compile new variants while serving.
ROW_ALIGN = 4


def aligned(n: int) -> int:
    """`n` ints rounded up to a whole number of 16-byte units."""
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass
class StepLayout:
    """The shape of one step's metadata: fixed per bucket when captured."""

    decode: bool
    num_tokens: int  # padded token count T
    num_reqs: int  # R: T for decode; real requests + 1 (the padded tail) or more for extend
    num_tiles: int  # N: query tiles of an extend step (0 for decode)
    num_splits: int  # KV chunks per decode request (0 for extend)

    @property
    def num_ints(self) -> int:
        return NUM_FIELDS * aligned(self.num_reqs) + 2 * aligned(self.num_tiles)

    def scratch_numel(self, num_heads: int, head_dim: int) -> int:
        return self.num_tokens * num_heads * self.num_splits * (head_dim + 1)


@dataclass
class StepMetadata:
    """One batch's `attn_metadata`: its own tensors (eager) or views of the static buffers."""

    layout: StepLayout
    out_cache_loc: torch.Tensor  # [T] int64
    fields: torch.Tensor  # [NUM_FIELDS, R] int32, rows `aligned(R)` apart
    tiles: torch.Tensor  # [2, N] int32, rows `aligned(N)` apart
    part_out: torch.Tensor  # [T, Hq, S, D] float32 (decode)
    part_lse: torch.Tensor  # [T, Hq, S] float32 (decode)
    arrivals: torch.Tensor  # [>= T * Hkv] int32 zeros the decode kernel counts on (decode)
    static_fill: int | None = None  # which fill of the static buffers it views (None: eager)


def plan_step(batch: ForwardBatch, layout: StepLayout) -> np.ndarray:
    """The step's int32 metadata, flattened: [NUM_FIELDS, R] per-request fields, then [2, N]
    tiles, each row padded with zeros to `aligned` length."""
    bs, n = batch.batch_size, batch.num_tokens
    if bs + (not layout.decode) > layout.num_reqs or n > layout.num_tokens:
        raise ValueError(
            f"batch of {bs} requests and {n} tokens does not fit the {layout.num_reqs} "
            f"requests and {layout.num_tokens} tokens reserved for it"
        )
    fields = np.zeros((NUM_FIELDS, aligned(layout.num_reqs)), dtype=np.int32)
    fields[0, :bs] = batch.req_pool_indices_cpu
    fields[1, :bs] = batch.seq_lens_cpu
    fields[2, :bs] = batch.prefix_lens_cpu
    fields[3, :bs] = batch.extend_lens_cpu
    fields[4, :bs] = np.cumsum(batch.extend_lens_cpu) - fields[3, :bs]
    if layout.decode:
        # Padded requests keep seq_len 0: the decode kernel writes zeros for them.
        return fields.ravel()
    # The padded tail is one more request with no keys: the extend kernel zeroes its rows.
    fields[3, bs] = layout.num_tokens - n
    fields[4, bs] = n
    tiles = np.zeros((2, aligned(layout.num_tiles)), dtype=np.int32)
    tiles[:, : layout.num_tiles] = extend_tiles(fields[3, : layout.num_reqs], layout.num_tiles)
    return np.concatenate([fields.ravel(), tiles.ravel()])


class TritonBackend(AttentionBackend):
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.EXTEND})

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.max_bs = 0
        self.static_ints: torch.Tensor | None = None
        self.static_scratch: torch.Tensor | None = None
        self.static_arrivals: torch.Tensor | None = None
        # Eager decode steps' arrival counters: zeros, as every launch leaves them, so one
        # buffer serves every step (grown for a larger batch).
        self.arrivals = torch.zeros(0, dtype=torch.int32)
        self.static_fills = 0  # replay hooks run; only the latest one's views are current

    # ---- layouts ----

    def _decode_layout(self, num_tokens: int) -> StepLayout:
        splits = num_decode_splits(num_tokens, self.num_kv_heads)
        return StepLayout(True, num_tokens, num_tokens, 0, splits)

    def _extend_layout(self, num_tokens: int, num_reqs: int, num_tiles: int) -> StepLayout:
        return StepLayout(False, num_tokens, num_reqs, num_tiles, 0)

    def _eager_layout(self, batch: ForwardBatch) -> StepLayout:
        t = batch.padded_tokens
        if batch.mode == ForwardMode.DECODE:
            return self._decode_layout(t)
        lens = np.array([*batch.extend_lens_cpu, t - batch.num_tokens])
        return self._extend_layout(t, batch.batch_size + 1, count_extend_tiles(lens))

    def _graph_layout(self, mode: ForwardMode, num_tokens: int) -> StepLayout:
        if mode == ForwardMode.DECODE:
            return self._decode_layout(num_tokens)
        max_reqs = min(num_tokens, self.max_bs)
        return self._extend_layout(num_tokens, max_reqs + 1, max_extend_tiles(num_tokens, max_reqs))

    def _views(
        self,
        layout: StepLayout,
        ints: torch.Tensor,
        out_cache_loc: torch.Tensor,
        scratch: torch.Tensor,
        arrivals: torch.Tensor,
        static_fill: int | None = None,
    ) -> StepMetadata:
        r, n = layout.num_reqs, layout.num_tiles
        row, tile_row = aligned(r), aligned(n)
        t, h, s, d = layout.num_tokens, self.num_heads, layout.num_splits, self.head_dim
        tiles_at = NUM_FIELDS * row
        return StepMetadata(
            layout=layout,
            out_cache_loc=out_cache_loc,
            fields=ints[:tiles_at].view(NUM_FIELDS, row)[:, :r],
            tiles=ints[tiles_at : tiles_at + 2 * tile_row].view(2, tile_row)[:, :n],
            part_out=scratch[: t * h * s * d].view(t, h, s, d),
            part_lse=scratch[t * h * s * d : t * h * s * (d + 1)].view(t, h, s),
            arrivals=arrivals,
            static_fill=static_fill,
        )

    # ---- eager steps ----

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        layout = self._eager_layout(batch)
        device = batch.out_cache_loc.device
        # non_blocking: a blocking upload waits for the device to finish all earlier work,
        # which would stall a host that runs a step ahead (overlap scheduling).
        ints = torch.from_numpy(plan_step(batch, layout)).to(device, non_blocking=True)
        scratch = torch.empty(
            layout.scratch_numel(self.num_heads, self.head_dim),
            dtype=torch.float32,
            device=device,
        )
        need = layout.num_tokens * self.num_kv_heads
        if self.arrivals.numel() < need or self.arrivals.device != device:
            self.arrivals = torch.zeros(need, dtype=torch.int32, device=device)
        batch.attn_metadata = self._views(layout, ints, batch.out_cache_loc, scratch, self.arrivals)

    # ---- CUDA graphs ----

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        """Static buffers for every bucket up to `max_bs` requests and `max_tokens` tokens."""
        self.max_bs = max_bs
        layouts = [self._graph_layout(ForwardMode.DECODE, t) for t in range(1, max_bs + 1)]
        layouts.append(self._graph_layout(ForwardMode.EXTEND, max_tokens))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.static_ints = torch.zeros(
            max(x.num_ints for x in layouts), dtype=torch.int32, device=device
        )
        self.static_scratch = torch.zeros(
            max(x.scratch_numel(self.num_heads, self.head_dim) for x in layouts),
            dtype=torch.float32,
            device=device,
        )
        self.static_arrivals = torch.zeros(
            max_bs * self.num_kv_heads, dtype=torch.int32, device=device
        )

    def init_forward_metadata_replay(self, batch: ForwardBatch, bucket: int) -> None:
        """Lay the live batch out in the static buffers, in the bucket's fixed layout. The
        batch's token tensors (out_cache_loc) are the runner's static buffers already."""
        if self.static_ints is None or self.static_scratch is None or self.static_arrivals is None:
            raise RuntimeError("init_graph_state must run before graph capture")
        layout = self._graph_layout(batch.mode, bucket)
        if (
            layout.num_ints > self.static_ints.numel()
            or layout.scratch_numel(self.num_heads, self.head_dim) > self.static_scratch.numel()
        ):
            raise ValueError(f"bucket {bucket} exceeds the sizes given to init_graph_state")
        plan = torch.from_numpy(plan_step(batch, layout))
        # non_blocking, as in init_forward_metadata (a pageable source is staged at once).
        self.static_ints[: plan.numel()].copy_(plan, non_blocking=True)
        self.static_fills += 1
        batch.attn_metadata = self._views(
            layout,
            self.static_ints,
            batch.out_cache_loc,
            self.static_scratch,
            self.static_arrivals,
            self.static_fills,
        )

    # ---- the layer op ----

    def forward(self, batch: ForwardBatch, x: AttentionInputs) -> None:
        # Per-step data comes from the batch only (views of the static buffers when captured).
        step = batch.attn_metadata
        t = x.q.shape[0]
        if not isinstance(step, StepMetadata) or step.layout.num_tokens != t:
            raise RuntimeError(
                f"triton attention: no metadata for a step of {t} tokens "
                "(init_forward_metadata must run before the layers)"
            )
        if step.static_fill not in (None, self.static_fills):
            raise RuntimeError(
                "triton attention: the static metadata buffers were refilled for another batch "
                "since this one's (init_forward_metadata_replay must run for the batch that runs)"
            )
        x = self.write_kv(step.out_cache_loc, x)
        q, o = self.heads(x)
        req_rows, seq_lens, prefix_lens, extend_lens, extend_starts = step.fields
        if step.layout.decode:
            decode_attention(
                q,
                x.k_cache,
                x.v_cache,
                o,
                batch.req_to_token,
                req_rows,
                seq_lens,
                step.part_out,
                step.part_lse,
                step.arrivals,
                x.scaling,
            )
        else:
            extend_attention(
                q,
                x.k_cache,
                x.v_cache,
                o,
                batch.req_to_token,
                req_rows,
                prefix_lens,
                extend_lens,
                extend_starts,
                seq_lens,
                step.tiles,
                x.scaling,
            )
