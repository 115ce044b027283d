"""The attention backends by name (`--attention-backend`)."""

from __future__ import annotations

from srt.layers.attention.base import AttentionBackend

ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")


def attention_backend_class(name: str) -> type[AttentionBackend]:
    # Imported on demand so that the CUDA-only backends never load on a CPU machine.
    if name == "torch_native":
        from srt.layers.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend
    if name == "triton":
        from srt.layers.attention.triton_backend import TritonBackend

        return TritonBackend
    if name == "flashinfer":
        from srt.layers.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend
    raise ValueError(
        f"--attention-backend: unknown backend {name!r}; choose one of {ATTENTION_BACKENDS}"
    )


def create_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionBackend:
    return attention_backend_class(name)(num_heads, num_kv_heads, head_dim)
