"""Reference attention in plain PyTorch: per request, gather its KV slots and run SDPA.

Runs anywhere (the CPU backend, and the reference the CUDA kernels are tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.forward_batch import ForwardBatch
from srt.layers.attention.base import AttentionBackend, AttentionInputs


class TorchNativeBackend(AttentionBackend):
    kv_write_kernel = False  # the reference of every kernel, the KV write's too

    def forward(self, batch: ForwardBatch, x: AttentionInputs) -> None:
        x = self.write_kv(batch.out_cache_loc, x)
        q, o = self.heads(x)
        k_cache, v_cache = x.k_cache, x.v_cache
        start = 0
        for row, prefix, extend in zip(
            batch.req_pool_indices_cpu.tolist(),
            batch.prefix_lens_cpu.tolist(),
            batch.extend_lens_cpu.tolist(),
            strict=True,
        ):
            slots = batch.req_to_token[row, : prefix + extend]
            o[start : start + extend] = attend(
                q[start : start + extend], k_cache[slots], v_cache[slots], prefix, x.scaling
            )
            start += extend
        o[batch.num_tokens :] = 0


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scaling: float
) -> torch.Tensor:
    """Causal attention of queries at positions prefix.. over keys 0..; q: [E, Hq, D],
    k, v: [prefix + E, Hkv, D] -> [E, Hq, D]."""
    e, s = q.shape[0], k.shape[0]
    query_pos = prefix + torch.arange(e, device=q.device)
    mask = torch.arange(s, device=q.device)[None, :] <= query_pos[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.transpose(0, 1)
