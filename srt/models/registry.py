"""`config.json` architecture name -> model class."""

from __future__ import annotations

from torch import nn

from srt.model_config import ModelLoadError
from srt.models.llama import LlamaForCausalLM
from srt.models.qwen2 import Qwen2ForCausalLM
from srt.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODELS))}"
        )
    return MODELS[architecture]
