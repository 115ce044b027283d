"""`config.json` architecture name -> model class."""

from __future__ import annotations

from srt.model_config import ModelLoadError
from srt.models.llama import LlamaForCausalLM
from srt.models.qwen2 import Qwen2ForCausalLM
from srt.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODELS:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODELS))}"
        )
    return MODELS[architecture]
