"""The attention backend interface and the registry of backends by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from srt.batch_layout import ForwardMode
from srt.forward_batch import ForwardBatch
from srt.layers.rotary_embedding import Rope, rotary
from srt.op_selection import HAS_TRITON


class AttentionInputs(NamedTuple):
    """What the attention op gives a backend for one layer of a step."""

    q: torch.Tensor  # [T, Hq * D]
    k: torch.Tensor  # [T, Hkv * D]: the new tokens' keys, written into the cache at their slots
    v: torch.Tensor  # [T, Hkv * D]
    out: torch.Tensor  # [T, Hq * D], written
    k_cache: torch.Tensor  # [slots, Hkv, D], this layer's
    v_cache: torch.Tensor
    scaling: float
    rope: Rope | None = None  # q and k not rotated yet: `write_kv` rotates them


class AttentionBackend(ABC):
    """Computes paged attention for one layer of a `ForwardBatch`.

    `forward` writes the new tokens' K and V at `batch.out_cache_loc`, attends each real token
    to its request's cached keys (causally), writes `out[:num_tokens]`, and zeroes the padded
    tail `out[num_tokens:]`.

    Per-step metadata is a value on the batch: the `init_forward_metadata*` hooks set
    `batch.attn_metadata` and `forward` reads it from there, never from the backend, so a
    forward runs on its own batch's metadata whatever was prepared for others. The backend keeps
    only what outlives a step (static graph buffers, workspaces, what it learned).
    """

    # Whether `write_kv` may use its Triton kernel: not for the reference backend, whose
    # writes stay plain PyTorch so that it checks the kernels, that one included.
    kv_write_kernel = True
    # Whether a forward whose Triton launches are skipped (`srt.compilation.triton_ahead`: the
    # warm-up's kernels compiled side by side first) is safe to run: none of the backend's
    # other kernels reads what a Triton kernel would have written as an index or a size.
    compiles_ahead = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @classmethod  # noqa: B027 (an optional hook)
    def check_device(cls, device: torch.device) -> None:
        """Raise `ServerArgsError` (naming `--attention-backend`) if this backend cannot run
        on `device`: the runner asks once it has the device, before it loads the model."""

    @classmethod
    def kernel_versions(cls) -> dict[str, str]:
        """The kernel packages this backend runs beyond torch and triton, by name: their
        versions are part of the compile cache key."""
        return {}

    def write_kv(self, loc: torch.Tensor, x: AttentionInputs) -> AttentionInputs:
        """The one place a step's new K and V go into the cache, at the slots `loc` (`[T]`):
        one Triton launch for both on CUDA (where the backend allows it), indexed assignment
        otherwise. Where `x.rope` is set, q and k are rotated first, in the same launch on
        CUDA (the rotary reference otherwise). Returns the inputs to attend with (q and k
        rotated, no rope left)."""
        t = loc.shape[0]
        kernel = self.kv_write_kernel and x.k.is_cuda and HAS_TRITON
        if x.rope is not None and kernel:
            from srt.layers.attention.triton_ops.kv_write import rotary_write_kv

            q, k = rotary_write_kv(
                x.k_cache,
                x.v_cache,
                loc,
                x.rope.positions,
                x.q,
                x.k,
                x.v,
                x.rope.cos_cache,
                x.rope.sin_cache,
            )
            return x._replace(q=q, k=k, rope=None)
        if x.rope is not None:
            q, k = rotary(x.rope.positions, x.q, x.k, x.rope.cos_cache, x.rope.sin_cache)
            x = x._replace(q=q, k=k, rope=None)
        k = x.k.view(t, self.num_kv_heads, self.head_dim)
        v = x.v.view(t, self.num_kv_heads, self.head_dim)
        if kernel:
            from srt.layers.attention.triton_ops.kv_write import write_kv

            write_kv(x.k_cache, x.v_cache, loc, k, v)
        else:
            x.k_cache[loc] = k
            x.v_cache[loc] = v
        return x

    def heads(self, x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`q` and `out` as [T, Hq, D]."""
        t = x.q.shape[0]
        return (
            x.q.view(t, self.num_heads, self.head_dim),
            x.out.view(t, self.num_heads, self.head_dim),
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """Set `batch.attn_metadata` for its forward, once, before any layer runs."""

    # --- CUDA graph capture (the `full` graph backend) -------------------------------------
    # The `full` runner captures the whole forward, this backend's kernels included, once per
    # bucket and replays it for every later batch of that bucket. The protocol, per runner:
    #   init_graph_state(max_bs, max_tokens)      once, before the first capture, sized for
    #                                             both phases; never called again
    #   init_forward_metadata_capture(batch)      before warming up and capturing a bucket
    #   init_forward_metadata_replay(batch, bucket)  before every replay of that bucket
    # Each hook sets `batch.attn_metadata`, so the layers must run in the `forward_context` of
    # that same batch object; metadata in the static buffers is current until the next hook.
    # `batch` is padded to the bucket (`batch.padded_tokens == bucket`; for decode the bucket
    # is also the request count). Its device tensors are views of the runner's static
    # buffers, the same addresses at capture and at every replay of a bucket:
    #   tokens   (input_ids, positions, out_cache_loc) have `bucket` entries; padded tokens
    #            have id 0, position 0 and KV slot 0 (the dummy slot);
    #   requests (req_pool_indices, seq_lens, prefix_lens, extend_lens, extend_start_loc) have
    #            the bucket's request capacity (decode: bucket; prefill: min(bucket,
    #            max_running_requests)); padded requests use table row 0 with prefix 0 and
    #            extend_len = seq_len = 1 for decode (extend_start_loc = its token index) or
    #            0 for prefill (extend_start_loc = num_tokens).
    # `batch_size`, `num_tokens` and the `*_cpu` lists describe the real requests only; at
    # capture they are the capture batch's, so nothing captured may depend on them (no host
    # syncs, no shapes from them). Padded outputs are discarded by the runner. Everything
    # the graph reads must live in buffers from `init_graph_state`, the batch's static
    # tensors, `req_to_token` or the KV cache: nothing allocated in a replay hook.
    # Breakable and tc_piecewise runners never put attention inside a graph: they call the
    # eager `init_forward_metadata` + `forward` with the live batch, its token tensors padded.

    # Forward modes whose `forward` may run inside a `full` graph; on CUDA the runner rejects
    # `full` for any other mode at startup, naming the flag.
    graph_modes: frozenset[ForwardMode] = frozenset()

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:  # noqa: B027
        """Allocate the static metadata buffers for captured batches of up to `max_bs`
        requests and `max_tokens` tokens (optional hook)."""

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """`batch.attn_metadata` for a bucket about to be warmed up and captured, in the static
        buffers."""
        self.init_forward_metadata_replay(batch, batch.padded_tokens)

    def init_forward_metadata_replay(self, batch: ForwardBatch, bucket: int) -> None:
        """Refill the static buffers from the live, padded `batch` before a replay of the
        graph captured for `bucket`, and set `batch.attn_metadata` to views of them. Default:
        the eager metadata (right for a backend whose forward reads only `batch`)."""
        self.init_forward_metadata(batch)

    @abstractmethod
    def forward(self, batch: ForwardBatch, x: AttentionInputs) -> None: ...
