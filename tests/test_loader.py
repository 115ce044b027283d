"""Loading Hugging Face directories: clear errors for broken ones, sharded/tied/dtype/dummy."""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from srt import Engine
from srt.model_config import ModelConfig, ModelLoadError
from srt.model_executor import model_loader
from srt.model_executor.model_loader import load_model

CPU = torch.device("cpu")


def load(path: Path, dtype: str = "auto", **kwargs) -> nn.Module:
    model, _ = load_model(ModelConfig.from_path(path, dtype), CPU, **kwargs)
    return model


@pytest.fixture
def copy_of(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy of a shared checkpoint that a test may break."""

    def copy(src: Path) -> Path:
        return Path(shutil.copytree(src, tmp_path / src.name))

    return copy


def edit_json(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def edit_tensors(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read by safetensors itself, one file after another."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def shard_holding(path: Path, file_name: str, suffix: str) -> str:
    """The first tensor (by name) ending in `suffix` that the index puts in `file_name`."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return min(n for n, f in weight_map.items() if f == file_name and n.endswith(suffix))


# ---- errors ------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"model directory {tmp_path / 'nope'} does not"):
        ModelConfig.from_path(tmp_path / "nope")


def test_engine_reports_the_missing_directory_first(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"), device="cpu")


def test_missing_config(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=f"{path / 'config.json'} is missing"):
        ModelConfig.from_path(path)


def test_malformed_config(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match=f"{path / 'config.json'} is not valid JSON"):
        ModelConfig.from_path(path)


def test_config_without_required_key(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="config.json lacks required key 'hidden_size'"):
        ModelConfig.from_path(path)


def test_unsupported_architecture(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    edit_json(path / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ModelLoadError, match=f"{path / 'config.json'}: unsupported architecture 'GPT2LMHeadModel'"
    ):
        load(path)


def test_unsupported_rope_scaling(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    edit_json(path / "config.json", rope_scaling=yarn, rope_parameters=yarn)
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_path(path)


def test_unsupported_dtype(tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported dtype 'float64'"):
        ModelConfig.from_path(tiny_llama, "float64")


def test_weight_shape_mismatch(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    name = "model.layers.1.self_attn.k_proj.weight"

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1]

    edit_tensors(path / "model.safetensors", shrink)
    with pytest.raises(
        ModelLoadError,
        match=f"model.safetensors: tensor {name} has shape \\(31, 64\\), expected \\(32, 64\\)",
    ):
        load(path)


def test_config_disagrees_with_weights(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    edit_json(path / "config.json", intermediate_size=96)
    with pytest.raises(
        ModelLoadError,
        match="tensor model.layers.0.mlp.down_proj.weight has shape \\(64, 128\\), "
        "expected \\(64, 96\\) \\(from config.json\\)",
    ):
        load(path)


@pytest.mark.parametrize(
    "name", ["model.layers.1.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight"]
)
def test_missing_tensor(tiny_llama: Path, copy_of, name: str) -> None:
    path = copy_of(tiny_llama)
    edit_tensors(path / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=f"{path}: checkpoint lacks 1 tensor\\(s\\): {name}$"):
        load(path)


def test_unexpected_tensor(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    edit_tensors(
        path / "model.safetensors",
        lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
    )
    with pytest.raises(
        ModelLoadError,
        match="model.safetensors: tensor model.layers.0.mlp.extra.weight has no matching",
    ):
        load(path)


def test_sharded_index_names_a_missing_file(tiny_model_factory, copy_of) -> None:
    path = copy_of(tiny_model_factory("llama", num_shards=3))
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        ModelLoadError,
        match="model.safetensors.index.json names "
        "model-00002-of-00003.safetensors, which is missing",
    ):
        load(path)


def test_malformed_index(tiny_model_factory, copy_of) -> None:
    path = copy_of(tiny_model_factory("llama", num_shards=3))
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json is malformed"):
        load(path)


def test_no_weight_files(tiny_llama: Path, copy_of) -> None:
    path = copy_of(tiny_llama)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=f"no \\*.safetensors weight files in {path}"):
        load(path)


def test_a_bad_shard_fails_the_load_while_the_others_read(tiny_model_factory, copy_of) -> None:
    """The readers take the five shards' tensors at once: the one that meets the bad tensor
    stops them all, and the load raises, naming it (no model comes back, no reader is left)."""
    path = copy_of(tiny_model_factory("llama", num_shards=5))
    bad = "model-00003-of-00005.safetensors"
    name = shard_holding(path, bad, "proj.weight")

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1]

    edit_tensors(path / bad, shrink)
    with pytest.raises(ModelLoadError, match=f"{bad}: tensor {re.escape(name)} has shape"):
        load(path)
    assert not [t for t in threading.enumerate() if t.name.startswith("srt-load")]


def test_a_tensor_in_two_shards_is_refused(tiny_model_factory, copy_of) -> None:
    """Read at once, the two copies would race for the parameter."""
    path = copy_of(tiny_model_factory("llama", num_shards=3))
    first, last = "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"
    name = shard_holding(path, first, "weight")
    tensor = load_file(path / first)[name]
    edit_tensors(path / last, lambda t: t.update({name: tensor}))
    with pytest.raises(ModelLoadError, match=f"{last}: tensor {re.escape(name)} is in {first} too"):
        load(path)


@pytest.mark.parametrize("corrupt", ["truncated", "garbage header", "empty"])
def test_corrupted_safetensors(tiny_llama: Path, copy_of, corrupt: str) -> None:
    path = copy_of(tiny_llama)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        {
            "truncated": data[: len(data) // 2],
            "garbage header": data[:8] + b"#" * 40 + data[48:],
            "empty": b"",
        }[corrupt]
    )
    with pytest.raises(ModelLoadError, match=f"cannot read weights from {file}"):
        load(path)


# ---- what loads ------------------------------------------------------------------------------


def test_sharded_equals_single_file(tiny_model_factory, tiny_llama: Path) -> None:
    single = state(load(tiny_llama))
    sharded = state(load(tiny_model_factory("llama", num_shards=3)))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_the_parallel_load_equals_a_sequential_read(tiny_model_factory) -> None:
    """More shards than readers; each parameter holds the checkpoint's tensors (a packed one,
    its parts in order), bit for bit."""
    path = tiny_model_factory("llama", num_shards=5)
    model = load(path)
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in checkpoint_tensors(path).items():
        target, shard = name, 0
        for ckpt_name, (ours, shard_id) in model.packed_modules.items():
            if f".{ckpt_name}." in name:
                target, shard = name.replace(f".{ckpt_name}.", f".{ours}."), shard_id
        parts.setdefault(target, {})[shard] = tensor
    params = dict(model.named_parameters())
    assert params.keys() == parts.keys()
    for name, param in params.items():
        expected = torch.cat([parts[name][i] for i in sorted(parts[name])])
        assert torch.equal(param.detach(), expected), name


@pytest.mark.parametrize(
    "options", [{"num_shards": 3}, {"tie_word_embeddings": True}], ids=["sharded", "tied"]
)
def test_the_load_reports_the_bytes_it_read(tiny_model_factory, options) -> None:
    path = tiny_model_factory("llama", **options)
    _, read = load_model(ModelConfig.from_path(path), CPU)
    assert read == sum(t.nbytes for t in checkpoint_tensors(path).values())


@pytest.mark.gpu
@pytest.mark.parametrize("staging", [None, 1024, 128], ids=["default", "chunks", "row-by-row"])
def test_weights_load_straight_to_the_gpu(tiny_model_factory, monkeypatch, staging) -> None:
    """Through the pinned staging buffers: whole tensors, in many chunks, or row by row where a
    row (256 bytes) does not fit a buffer; with a cast on the way (float16) or without."""
    if staging is not None:
        monkeypatch.setattr(model_loader, "_STAGING_BYTES", staging)
    path = tiny_model_factory("llama", num_shards=3)
    for dtype in ("auto", "float16"):
        on_cpu = state(load(path, dtype))
        model, read = load_model(ModelConfig.from_path(path, dtype), torch.device("cuda"))
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        assert all(torch.equal(v.cpu(), on_cpu[k]) for k, v in model.state_dict().items())
        assert read == sum(t.nbytes for t in checkpoint_tensors(path).values())


def test_tied_embeddings_share_one_tensor(tiny_model_factory) -> None:
    model = load(tiny_model_factory("llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0


def test_dtype_from_config_or_override(tiny_model_factory, tiny_llama: Path) -> None:
    bf16 = tiny_model_factory("qwen3", dtype="bfloat16")
    assert {p.dtype for p in load(bf16).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load(bf16, "float32").parameters()} == {torch.float32}
    fp16 = load(tiny_llama, "float16")
    assert {p.dtype for p in fp16.parameters()} == {torch.float16}
    fp32 = load(tiny_llama)
    assert torch.equal(fp16.model.norm.weight, fp32.model.norm.weight.half())


def test_eos_ids_from_generation_config(tiny_llama: Path, copy_of) -> None:
    eos = json.loads((tiny_llama / "config.json").read_text())["eos_token_id"]
    assert ModelConfig.from_path(tiny_llama).eos_token_ids == [eos]
    path = copy_of(tiny_llama)
    edit_json(path / "generation_config.json", eos_token_id=[eos, 7])  # wins over config.json
    assert ModelConfig.from_path(path).eos_token_ids == [eos, 7]


@pytest.fixture
def config_only(tiny_llama: Path, copy_of) -> Path:
    """config.json and the tokenizer, no weight file at all."""
    path = copy_of(tiny_llama)
    (path / "model.safetensors").unlink()
    return path


def test_dummy_weights_deterministic_from_seed(config_only: Path) -> None:
    a = state(load(config_only, load_format="dummy", seed=1))
    b = state(load(config_only, load_format="dummy", seed=1))
    c = state(load(config_only, load_format="dummy", seed=2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))


def test_dummy_weights_read_nothing(config_only: Path) -> None:
    _, read = load_model(ModelConfig.from_path(config_only), CPU, load_format="dummy")
    assert read == 0


def test_dummy_engine_serves_without_weight_files(config_only: Path) -> None:
    def run(seed: int) -> list[int]:
        with Engine(
            model_path=str(config_only), device="cpu", load_format="dummy", seed=seed
        ) as engine:
            out = engine.generate(
                prompt="Hi", sampling_params={"max_new_tokens": 4, "temperature": 0}
            )
        assert out["meta_info"]["completion_tokens"] == 4
        return out["output_ids"]

    assert run(seed=3) == run(seed=3)


def test_unknown_load_format(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="unknown format 'pt'"):
        load(tiny_llama, load_format="pt")
