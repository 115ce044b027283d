"""Build a model and fill its weights from a Hugging Face directory, or randomly (dummy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from srt.layers.linear import LinearShapeError, check_shape
from srt.model_config import ModelConfig, ModelLoadError
from srt.models.llama import LlamaForCausalLM
from srt.models.registry import get_model_class

# Checkpoint tensors that carry no parameter of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    config: ModelConfig, device: torch.device, load_format: str = "auto", seed: int = 0
) -> LlamaForCausalLM:
    try:
        model_cls = get_model_class(config.architecture)
    except ModelLoadError as e:
        raise ModelLoadError(f"{config.path / 'config.json'}: {e}") from e
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        load_weights(model, config.path, device)
        if device.type == "cuda":
            # Return the freed checkpoint tensors' blocks: KV sizing reads the free memory.
            torch.cuda.empty_cache()
    else:
        raise ValueError(f"--load-format: unknown format {load_format!r}; use auto or dummy")
    return model.eval()


def dummy_values(
    name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """The random value of the parameter (or checkpoint tensor) `name`: N(0, 0.02) matrices,
    unit norms, zero biases. Drawn where it will live, in its dtype: an 8B model's weights take
    a minute to draw on the CPU and copy over, well under a second on the GPU."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(0.02)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights without reading any file (`dummy_values`), the same for the same seed
    on the same device."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = gens.get(param.device)
        if gen is None:
            gen = gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.copy_(dummy_values(name, param.shape, param.dtype, param.device, gen))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {path}")
    return files


class SafetensorsTensor:
    """One tensor of an open safetensors file, read on demand to `device`: in full, or only
    the region a rank holds (a tensor-parallel rank never copies the rest)."""

    def __init__(self, path: Path, file: Any, name: str, device: torch.device) -> None:
        self._path = path
        self._file = file
        self._name = name
        self._device = device
        self._slice = file.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        whole = all(
            s.indices(dim) == (0, dim, 1) for s, dim in zip(index, self.shape, strict=False)
        )
        try:
            if whole:
                return self._file.get_tensor(self._name)
            return self._slice[index].to(self._device)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {self._name} from {self._path}: {e}") from e


def iter_checkpoint(
    path: Path, device: torch.device
) -> Iterator[tuple[Path, str, SafetensorsTensor]]:
    """Every tensor of the checkpoint, not read yet: a read copies the region asked for to
    `device` from the memory-mapped shard."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield file, name, SafetensorsTensor(file, f, name, device)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e


def load_weights(model: LlamaForCausalLM, path: Path, device: torch.device) -> None:
    """Fill the parameters (on `device`) from the checkpoint at `path`; ModelLoadError, naming
    the file and tensor, for a tensor without a parameter, a shape mismatch or a gap."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for file, name, tensor in iter_checkpoint(path, device):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        target, shard = name, 0
        for ckpt_name, (ours, shard_id) in packed.items():
            if f".{ckpt_name}." in name:
                target, shard = name.replace(f".{ckpt_name}.", f".{ours}."), shard_id
                break
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{file.name}: tensor {name} has no matching model parameter")
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:  # replicated: every rank holds all of it
                check_shape(tensor, tuple(param.shape))
                param.data.copy_(tensor.read())
            else:
                loader(param, tensor, shard)
        except LinearShapeError as e:
            raise ModelLoadError(f"{file.name}: tensor {name} {e} (from config.json)") from e
        loaded.add(f"{target}#{shard}")
    expected = _expected_shards(model, params)
    missing = sorted(expected - loaded)
    if missing:
        names = ", ".join(_checkpoint_name(m, packed) for m in missing[:8])
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensor(s): {names}")


def _checkpoint_name(shard_key: str, packed: dict[str, tuple[str, int]]) -> str:
    """`...qkv_proj.weight#1` -> `...k_proj.weight`: the name the checkpoint should have."""
    name, shard = shard_key.rsplit("#", 1)
    for ckpt_name, (ours, shard_id) in packed.items():
        if f".{ours}." in name and shard_id == int(shard):
            return name.replace(f".{ours}.", f".{ckpt_name}.")
    return name


def _expected_shards(model: nn.Module, params: dict[str, nn.Parameter]) -> set[str]:
    expected: set[str] = set()
    for name in params:
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        shards = len(getattr(owner, "output_sizes", [0]))
        expected.update(f"{name}#{i}" for i in range(shards))
    return expected
