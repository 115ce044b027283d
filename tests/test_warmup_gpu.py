"""On CUDA with the Triton attention backend: the warm-up compiles the kernel variants every
batch runs, so requests compile nothing after ready; without it the compiles land after ready
and are logged as JIT misses. Each test first empties the kernels' in-process caches, so that
what an earlier test compiled cannot hide a compile (Triton's disk cache still serves the
binaries)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from srt import Engine

pytestmark = pytest.mark.gpu

PROMPT = list(range(3, 40))
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def fresh_kernels() -> None:
    pytest.importorskip("triton")
    from srt.layers.attention.triton_ops import decode_attention, extend_attention

    for kernel in (
        decode_attention._decode_split_kernel,
        decode_attention._decode_merge_kernel,
        extend_attention._extend_kernel,
    ):
        kernel.device_caches.clear()


@pytest.fixture
def bf16_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", dtype="bfloat16")


def first_request_misses(path: Path, tmp_path: Path, **kwargs: Any) -> list[dict[str, Any]]:
    with Engine(
        model_path=str(path),
        device="cuda",
        attention_backend="triton",
        compile_cache_dir=str(tmp_path / "cache"),
        # A small KV cache: other GPU tests of the session may still hold device memory.
        max_total_tokens=4096,
        **kwargs,
    ) as eng:
        eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
        misses = eng.get_server_info()["runner"]["jit_misses"]
    assert misses["count"] == len(misses["listed"])
    return misses["listed"]


def test_after_warmup_a_first_request_compiles_no_triton_kernel(
    bf16_llama: Path, tmp_path: Path, fresh_kernels: None
) -> None:
    misses = first_request_misses(bf16_llama, tmp_path)
    assert not [m for m in misses if m["what"].startswith("triton")], misses


@pytest.mark.parametrize("graphs", ["disabled", "full"])
def test_after_warmup_batches_of_any_shape_compile_no_triton_kernel(
    bf16_llama: Path, tmp_path: Path, fresh_kernels: None, graphs: str
) -> None:
    """Prompts of 1 to 3 query tiles and decode batches of 1 to 7 requests (split counts 16
    down to 2, metadata rows of every length mod 4) all run the variants the warm-up built."""
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 140, 9, 64, 129, 33)]
    params = [{**GREEDY, "max_new_tokens": 2 + i} for i in range(len(prompts))]
    with Engine(
        model_path=str(bf16_llama),
        device="cuda",
        attention_backend="triton",
        compile_cache_dir=str(tmp_path / "cache"),
        # A small KV cache: other GPU tests of the session may still hold device memory.
        max_total_tokens=4096,
        cuda_graph_backend_decode=graphs,
    ) as eng:
        for n in range(1, len(prompts) + 1):
            eng.generate(input_ids=prompts[:n], sampling_params=params[:n])
        misses = eng.get_server_info()["runner"]["jit_misses"]
    assert not [m for m in misses["listed"] if m["what"].startswith("triton")], misses


def test_without_warmup_the_first_request_compiles_and_it_is_logged(
    bf16_llama: Path, tmp_path: Path, fresh_kernels: None
) -> None:
    misses = first_request_misses(bf16_llama, tmp_path, skip_warmup=True)
    triton = [m["what"].removeprefix("triton ") for m in misses if m["what"].startswith("triton")]
    compiled = {what.split("[")[0] for what in triton}
    assert {"_extend_kernel", "_decode_split_kernel", "_decode_merge_kernel"} <= compiled
    assert all(m["ms"] > 0 and m["during"] for m in misses)
