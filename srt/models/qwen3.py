"""Qwen3: the Llama layout with per-head RMSNorm on q and k before the rotation."""

from srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
