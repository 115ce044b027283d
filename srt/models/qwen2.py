"""Qwen2: the Llama layout with a bias on the q, k and v projections."""

from srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
