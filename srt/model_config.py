"""The model shape, read from a Hugging Face `config.json`: the one place that reads it.

No torch here: the scheduler process and the launcher read the config too (vocabulary, eos ids,
context length) and stay torch-free. The dtype is kept as its name; `ModelConfig.dtype` turns
it into a torch dtype where the model side asks for one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # each the name of a torch dtype


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message names the file and tensor."""


@dataclass
class ModelConfig:
    path: Path
    architecture: str
    hf_config: dict[str, Any]
    dtype_name: str  # one of DTYPE_NAMES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_path(
        cls, path: str | Path, dtype: str = "auto", context_length: int | None = None
    ) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"model directory {path} does not exist")
        if not config_file.is_file():
            raise ModelLoadError(f"{config_file} is missing")
        try:
            cfg = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError(f"{config_file} has no 'architectures' entry")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            result = cls(
                path=path,
                architecture=archs[0],
                hf_config=cfg,
                dtype_name=_resolve_dtype(dtype, cfg),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(cfg),
                rope_scaling=_rope_scaling(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                context_length=0,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                eos_token_ids=_eos_ids(path, cfg),
            )
        except KeyError as e:
            raise ModelLoadError(f"{config_file} lacks required key {e}") from e
        result.context_length = context_length or result.max_position_embeddings
        if result.num_heads % result.num_kv_heads:
            raise ModelLoadError(
                f"{config_file}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {result.num_kv_heads}"
            )
        return result

    @property
    def dtype(self) -> torch.dtype:
        import torch  # only the model side asks, and it has torch loaded already

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype


def warn_past_positions(config: ModelConfig, context_length: int | None) -> None:
    """A context longer than the model was trained for runs, but past its positions the
    output is not to be trusted: say so."""
    if context_length is not None and context_length > config.max_position_embeddings:
        logger.warning(
            "--context-length %d is larger than the model's max_position_embeddings "
            "%d; output past that position may be poor",
            context_length,
            config.max_position_embeddings,
        )


def _resolve_dtype(dtype: str, cfg: dict[str, Any]) -> str:
    if dtype == "auto":
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype not in DTYPE_NAMES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPE_NAMES)}")
    return dtype


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 4 writes `rope_scaling`, transformers 5 writes `rope_parameters`.
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}")
    return {**params, "rope_type": rope_type}


def _eos_ids(path: Path, cfg: dict[str, Any]) -> list[int]:
    ids = cfg.get("eos_token_id")
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            ids = json.loads(gen_file.read_text()).get("eos_token_id", ids)
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen_file} is not valid JSON: {e}") from e
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
