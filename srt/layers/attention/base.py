"""The attention backend interface and the registry of backends by name."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes paged attention for one layer of a `ForwardBatch`.

    `forward` writes the new tokens' K and V at `batch.out_cache_loc`, attends each real token
    to its request's cached keys (causally), writes `out[:num_tokens]`, and zeroes the padded
    tail `out[num_tokens:]`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def init_forward_metadata(self, batch: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """Prepare per-step metadata, once per forward, before any layer runs."""

    @abstractmethod
    def forward(
        self,
        batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scaling: float,
    ) -> None: ...


ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")


def create_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, **kwargs: object
) -> AttentionBackend:
    # Imported on demand so that the CUDA-only backends never load on a CPU machine.
    if name == "torch_native":
        from srt.layers.attention.torch_native import TorchNativeBackend as cls
    elif name == "triton":
        from srt.layers.attention.triton_backend import TritonBackend as cls
    elif name == "flashinfer":
        from srt.layers.attention.flashinfer_backend import FlashInferBackend as cls
    else:
        raise ValueError(
            f"--attention-backend: unknown backend {name!r}; choose one of {ATTENTION_BACKENDS}"
        )
    return cls(num_heads, num_kv_heads, head_dim, **kwargs)
