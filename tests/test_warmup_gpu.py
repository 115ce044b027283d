"""On CUDA with the Triton attention backend: the warm-up compiles the kernel variants every
batch runs, so requests compile nothing after ready; without it the compiles land after ready
and are logged as JIT misses. Each test first empties the kernels' in-process caches, so that
what an earlier test compiled cannot hide a compile (Triton's disk cache still serves the
binaries). With the FlashInfer backend (where it is installed), in fresh processes: its
modules build under the compile cache root before ready, and a restart compiles none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from srt import Engine, flashinfer_support

pytestmark = pytest.mark.gpu

PROMPT = list(range(3, 40))
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def fresh_kernels() -> None:
    pytest.importorskip("triton")
    from srt.layers.attention.triton_ops import decode_attention, extend_attention

    for kernel in (decode_attention._decode_kernel, extend_attention._extend_kernel):
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
    assert {"_extend_kernel", "_decode_kernel"} <= compiled
    assert all(m["ms"] > 0 and m["during"] for m in misses)


def flashinfer_start(model: Path, cache: Path) -> dict[str, Any]:
    """Start an engine on FlashInfer in a fresh interpreter (FlashInfer fixes its JIT
    directory at import, and keeps the modules it loaded for the life of the process) and
    serve one request: the runner's FlashInfer builds and JIT misses, and that directory."""
    code = (
        "import json, sys\n"
        "from srt import Engine\n"
        "with Engine(model_path=sys.argv[1], device='cuda', dtype='bfloat16',\n"
        "            attention_backend='flashinfer', compile_cache_dir=sys.argv[2],\n"
        "            max_total_tokens=4096) as eng:\n"
        f"    eng.generate(input_ids={PROMPT!r}, sampling_params={GREEDY!r})\n"
        "    runner = eng.get_server_info()['runner']\n"
        # Imported by the runner, once it had pointed the JIT directory under the root.
        "    import flashinfer.jit.env as jit_env\n"
        "print(json.dumps({'builds': runner['flashinfer_jit'], 'misses': runner['jit_misses'],\n"
        "                  'jit_dir': str(jit_env.FLASHINFER_JIT_DIR)}))\n"
    )
    # Where FlashInfer builds is the runner's choice here, not a location set at launch.
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_WORKSPACE_BASE"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model), str(cache)],
        cwd=Path(__file__).resolve().parents[1],  # the repository: `import srt` finds it
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,  # a cold start compiles FlashInfer's modules: minutes each
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(
    not flashinfer_support.installed(),
    reason="flashinfer is not installed (pip install 'srt[flashinfer]')",
)
def test_flashinfer_builds_under_the_cache_root_and_a_restart_compiles_none(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    # Head size 64, 4 query heads per KV head (decode on tensor cores, as the 1B and 8B run it).
    model = tiny_model_factory(
        "llama", dtype="bfloat16", hidden_size=256, num_heads=4, num_kv_heads=1
    )
    cache = tmp_path / "cache"
    cold = flashinfer_start(model, cache)
    assert Path(cold["jit_dir"]).is_relative_to(cache / "flashinfer")
    # The FA2 module (decode, paged prefill) and, on Hopper, the FA3 one (ragged prefill).
    assert cold["builds"]["compiled"] >= 1
    flashinfer_misses = [m for m in cold["misses"]["listed"] if m["what"].startswith("flashinfer")]
    assert flashinfer_misses == []  # the warm-up built every module the request needed
    warm = flashinfer_start(model, cache)
    assert warm["builds"]["compiled"] == 0
    assert warm["builds"]["loaded"] == cold["builds"]["compiled"] + cold["builds"]["loaded"]
    assert warm["builds"]["s"] < cold["builds"]["s"]


def test_the_warmup_kernels_compile_ahead_and_change_no_id(
    bf16_llama: Path, tmp_path: Path, fresh_kernels: None
) -> None:
    """On an empty compile cache (Triton's disk cache is under it), the warm-up's kernels
    compile on the pool, each in a worker process, none fails, the warm-up after it and the
    first request compile no Triton kernel, and the ids are those of a start that compiles
    each kernel at its launch."""
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 140)]
    params = [{**GREEDY, "max_new_tokens": 6} for _ in prompts]
    runs = []
    for threads in (None, 0):
        with Engine(
            model_path=str(bf16_llama),
            device="cuda",
            attention_backend="triton",
            compile_cache_dir=str(tmp_path / f"cache-{threads}"),
            max_total_tokens=4096,
            compile_threads=threads,
        ) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            info = eng.get_server_info()["runner"]
        runs.append([o["output_ids"] for o in outs])
        if threads is None:
            ahead = info["compile_ahead"]
            assert ahead["kernels"] > 0 and ahead["failed"] == 0 and ahead["threads"] > 0
            assert ahead["missed"] == 0, ahead  # the warm-up compiled nothing at a launch
            # Each compiled in a worker process first (the threads then loaded it).
            assert ahead["processes"] > 0 and ahead["in_processes"] == ahead["kernels"], ahead
            # The last compile to end, inside the block; the weights filled between its steps
            # (the ids below: the same as a start that filled them before anything ran).
            assert ahead["last_kernel"], ahead
            assert 0 <= ahead["last_handed_s"] < ahead["last_done_s"] <= ahead["span_s"], ahead
            assert ahead["beside_s"] >= 0, ahead
            triton_misses = [m for m in info["jit_misses"]["listed"] if "triton" in m["what"]]
            assert not triton_misses, triton_misses
        else:
            assert info["compile_ahead"] is None
    assert runs[0] == runs[1]
    # Again on the first start's cache: warm, so nothing compiles ahead and nothing is missed.
    with Engine(
        model_path=str(bf16_llama),
        device="cuda",
        attention_backend="triton",
        compile_cache_dir=str(tmp_path / "cache-None"),
        max_total_tokens=4096,
    ) as eng:
        assert [
            o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
        ] == runs[0]
        info = eng.get_server_info()["runner"]
    assert info["compile_ahead"] is None and info["jit_misses"]["count"] == 0
