"""Tensor parallelism on the CPU (gloo): two ranks give the same greedy ids as one, through
the Engine and the server; a dying rank takes the server down; bad --tp-size values are
refused naming the flag. The 2-GPU check (NCCL, `full` decode graphs) is marked gpu."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from compile_helpers import PROMPTS, greedy_ids, tc_engine
from server_helpers import ServerProcess, assert_a_death_takes_it_down

from srt import Engine
from srt.launch_server import main
from srt.model_config import ModelConfig
from srt.server_args import ServerArgs, ServerArgsError

CPU = {"device": "cpu", "dtype": "float32", "skip_warmup": True}


def _ids(model: Path, **options: Any) -> list[list[int]]:
    with Engine(model_path=str(model), **{**CPU, **options}) as engine:
        ids = greedy_ids(engine)
        if options.get("tp_size", 1) > 1:
            ranks = engine.get_server_info()["runner"]["tp_ranks"]
            assert [r["rank"] for r in ranks] == list(range(options["tp_size"]))
            assert len({r["pid"] for r in ranks}) == options["tp_size"]  # one process each
        return ids


@pytest.mark.parametrize(
    ("arch", "num_kv_heads"),
    [("llama", 2), ("llama", 1), ("qwen2", 1), ("qwen3", 2)],
    ids=["llama-kv-split", "llama-kv-replicated", "qwen2-kv-replicated", "qwen3-kv-split"],
)
def test_two_ranks_give_the_same_ids_as_one(
    tiny_model_factory: Callable[..., Path], arch: str, num_kv_heads: int
) -> None:
    # An odd vocabulary: the last rank's part of the embedding and LM head is padded.
    model = tiny_model_factory(arch, num_kv_heads=num_kv_heads, vocab_size=509)
    assert _ids(model, tp_size=2) == _ids(model)


def test_tied_embeddings_shard_once(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama", tie_word_embeddings=True)
    assert _ids(model, tp_size=2) == _ids(model)


def test_two_ranks_compiled_piecewise_give_the_same_ids(tiny_llama: Path, tmp_path: Path) -> None:
    """The collectives stay whole ops inside the Inductor-compiled pieces, and each rank
    compiles (and caches) its own shard's graph: a second start hits both ranks' entries."""
    expected = _ids(tiny_llama)
    for start in ("cold", "warm"):
        with tc_engine(tiny_llama, tmp_path, "inductor", tp_size=2, skip_warmup=True) as engine:
            assert greedy_ids(engine) == expected, start
            compiled = engine.get_server_info()["compile"]
            assert compiled["cache_hit"] is (start == "warm"), compiled
    entries = {p.parent for p in tmp_path.rglob("computation_graph.py")}
    assert len(entries) == 2, entries  # one entry per rank


def test_a_rank_reads_its_region_of_a_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from srt.model_executor.model_loader import Copier, SafetensorsTensor, open_checkpoint

    weight = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    with open_checkpoint(tmp_path) as files:
        [(file, handle)] = files
        assert list(handle.keys()) == ["w"]
        tensor = SafetensorsTensor(file, handle, "w", Copier())
        assert tensor.shape == (6, 8)
        region = torch.empty(2, 4)
        tensor.copy_to(region, (slice(2, 4), slice(4, 8)))
        assert torch.equal(region, weight[2:4, 4:8])
        assert tensor.bytes_read == region.nbytes  # only the region
        whole = torch.empty(6, 8)
        tensor.copy_to(whole)
        assert torch.equal(whole, weight)


def test_server_with_two_ranks_serves_the_same_ids_and_dies_with_a_rank(
    tiny_llama: Path, tmp_path: Path
) -> None:
    expected = _ids(tiny_llama)
    srv = ServerProcess(["--model-path", str(tiny_llama), "--tp-size", "2"], tmp_path / "log")
    try:
        srv.wait_ready()
        for prompt, want in zip(PROMPTS, expected, strict=True):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            }
            resp = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
            assert resp.json()["output_ids"] == want, resp.text
        assert_a_death_takes_it_down(srv, "model_runner_rank1", notice_s=10)
    finally:
        srv.stop()


def test_one_batch_benchmark_runs_two_ranks(tiny_llama: Path, tmp_path: Path) -> None:
    from srt.bench import one_batch

    results = tmp_path / "ob.jsonl"
    flags = ["--model-path", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    steps = ["--batch-size", "2", "--input-len", "8", "--output-len", "4", "--runs", "1"]
    one_batch.main([*flags, *steps, "--tp-size", "2", "--result-file", str(results)])
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["tp_size"] == 2 and row["decode_ms_per_step"] > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "must be a positive integer, got 0"), ("-2", "must be a positive integer, got -2")],
)
def test_a_bad_tp_size_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--tp-size", value, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert f"argument --tp-size: {message}" in capsys.readouterr().err


def _config(tiny_llama: Path, **changes: int) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_path(str(tiny_llama)), **changes)


@pytest.mark.parametrize(
    ("tp_size", "changes", "message"),
    [
        (3, {}, "3 does not divide the model's num_attention_heads (4)"),
        (2, {"num_heads": 6, "num_kv_heads": 3}, "2 ranks cannot share the model's 3 KV heads"),
        (4, {"num_heads": 12, "num_kv_heads": 3}, "4 ranks cannot share the model's 3 KV heads"),
        (2, {"intermediate_size": 129}, "2 does not divide the model's intermediate_size"),
    ],
)
def test_a_model_that_cannot_be_sharded_is_refused(
    tiny_llama: Path, tp_size: int, changes: dict[str, int], message: str
) -> None:
    args = ServerArgs(tp_size=tp_size, device="cpu")
    with pytest.raises(ServerArgsError, match=r"^argument --tp-size: ") as error:
        args.check_model(_config(tiny_llama, **changes))
    assert message in str(error.value)


def test_shardable_shapes_pass(tiny_llama: Path) -> None:
    ServerArgs(tp_size=4, device="cpu").check_model(_config(tiny_llama, num_kv_heads=2))
    ServerArgs(tp_size=2, device="cpu").check_model(_config(tiny_llama, num_kv_heads=1))


def test_the_server_refuses_an_unshardable_model(tiny_llama: Path, tmp_path: Path) -> None:
    srv = ServerProcess(["--model-path", str(tiny_llama), "--tp-size", "3"], tmp_path / "log")
    try:
        assert srv.proc.wait(60) == 1
        assert "argument --tp-size: 3 does not divide" in srv.log(), srv.log()
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()


def test_a_rank_device_index_is_refused() -> None:
    with pytest.raises(ServerArgsError, match="argument --device: cuda:1: with --tp-size"):
        ServerArgs(tp_size=2, device="cuda:1")._check_tp_devices()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_full_decode_graphs_give_the_same_ids(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = tiny_model_factory("llama", num_kv_heads=2, dtype="bfloat16")
    options = {
        "device": "cuda",
        "dtype": "float32",
        "cuda_graph_backend_decode": "full",
        "cuda_graph_bs_decode": [1, 2, 4],
        "max_total_tokens": 4096,
    }
    with Engine(model_path=str(model), **options) as engine:
        expected = greedy_ids(engine)
    with Engine(model_path=str(model), tp_size=2, **options) as engine:
        assert greedy_ids(engine) == expected
        assert engine.get_server_info()["graphs"]["decode"]["backend"] == "full"
