"""Llama (2, 3, 3.x; also the Mistral layout). Qwen2 and Qwen3 reuse it with two switches.

`forward(input_ids, positions)` is the part that is traced and compiled: its only inputs
share one token dimension. `compute_logits` maps selected hidden states to logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from srt.distributed import Shard, even_shard, kv_head_shard
from srt.layers.activation import SiluAndMul
from srt.layers.attention.layer import Attention
from srt.layers.embedding import LMHead, VocabEmbedding
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.layers.sequence_parallel import sequence_parallel  # noqa: F401  (registers the pass)
from srt.model_config import ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size]
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x; with `residual` (the norms in the products), x is the residual
        stream: gate/up normalises it and down_proj adds it to its output."""
        normalise = residual is not None
        return self.down_proj(
            self.gate_up_proj.silu_and_mul_of(x, self.act_fn, normalise), residual
        )


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.head_dim = d = config.head_dim
        # This rank's heads: an equal part of the query heads, and of the KV heads (or the one
        # KV head it shares with its neighbours when there are fewer KV heads than ranks).
        heads = even_shard(config.num_heads)
        kv_heads = kv_head_shard(config.num_kv_heads)
        self.q_size = heads.size * d
        self.kv_size = kv_heads.size * d
        q_rows = Shard(heads.start * d, self.q_size)
        kv_rows = Shard(kv_heads.start * d, self.kv_size)
        kv_total = config.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.num_heads * d, kv_total, kv_total],
            bias=qkv_bias,
            out_shards=[q_rows, kv_rows, kv_rows],
        )
        # Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2 configs never set it.
        self.o_proj = RowParallelLinear(
            config.num_heads * d, config.hidden_size, bias=config.attention_bias
        )
        self.rotary = rotary
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(heads.size, kv_heads.size, d, d**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention over hidden; with `residual` (the norms in the products), hidden is the
        residual stream: QKV normalises it and o_proj adds it to its output."""
        qkv = self.qkv_proj(hidden, normalise=residual is not None)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 normalises each head before the rotation.
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        # Where the rotary kernel runs, the attention op rotates q and k in its KV write.
        rope = self.rotary.rope_for_attention(positions)
        if rope is None:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, rope), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def norms_in_products(self) -> bool:
        return self.self_attn.qkv_proj.folded_norm_eps is not None

    def put_norms_in_products(self) -> None:
        """From here on, where the skinny kernel runs the products, the two norms go into the
        products after them (`forward`); their weights are folded in once the weights are
        filled (`fold_norm_weights`)."""
        self.self_attn.qkv_proj.folded_norm_eps = self.input_layernorm.eps
        self.mlp.gate_up_proj.folded_norm_eps = self.post_attention_layernorm.eps
        self.self_attn.o_proj.adds_residual = True
        self.mlp.down_proj.adds_residual = True

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """Each norm's weight into the columns of the product after it, the norm's weight
        then ones: `(norm(x) * g) W^T = norm(x) (W * g)^T`, the same model on every path (the
        products that normalise their input, and the norm with a unit weight before a plain
        product). Rounds W * g once, in the weights' dtype."""
        for norm, product in (
            (self.input_layernorm, self.self_attn.qkv_proj),
            (self.post_attention_layernorm, self.mlp.gate_up_proj),
        ):
            product.weight.mul_(norm.weight)
            norm.weight.fill_(1.0)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the next hidden, its residual). Where the norms are in the products and the skinny
        kernel runs them, the residual stream is one tensor, `hidden` (`residual` stays None):
        each norm is in the product after it (at one row no norm kernel launches), and the
        residual add is in the epilogue of the product before it (o_proj's, down_proj's)."""
        if self.norms_in_products and self.self_attn.qkv_proj.uses_kernel("skinny_matmul"):
            assert residual is None, "the residual stream is one tensor here"
            hidden = self.self_attn(positions, hidden, residual=hidden)
            return self.mlp(hidden, residual=hidden), None
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim,
            max(config.max_position_embeddings, config.context_length),
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, qkv_bias, qk_norm) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # the norms in the products: hidden is the residual stream
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # checkpoint name -> (our packed parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias or config.attention_bias, self.qk_norm)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def put_norms_in_products(self) -> None:
        """The norms before QKV and gate/up go into those products where the skinny kernel
        runs them (`LlamaDecoderLayer.forward`). Before any trace (the graph's shape) and
        before the weights are filled (`fold_norm_weights`, which `fill_weights` calls). The
        final norm stays: a tied LM head's weight is the embedding's too."""
        for layer in self.decoder_layers():
            layer.put_norms_in_products()

    def fold_norm_weights(self) -> None:
        """After the weights are filled: the norms' weights into the products after them,
        where `put_norms_in_products` put the norms there; else nothing."""
        for layer in self.decoder_layers():
            if layer.norms_in_products:
                layer.fold_norm_weights()

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [m for m in self.model.layers if isinstance(m, LlamaDecoderLayer)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    @contextmanager
    def first_layer_only(self) -> Iterator[None]:
        """Forwards through the first decoder layer alone (between the embedding and the final
        norm): every layer launches the same kernels with the same shapes, so one layer
        launches all a forward does. The compile-ahead block's forwards run so, to hand the
        compiles out sooner (r34: the prefill's extend kernel was handed out half a second
        in, behind the decode forward's 16 layers, and its compile then ended the block). A
        graph traced before is unchanged: it holds its own references to the layers."""
        layers = self.model.layers
        self.model.layers = nn.ModuleList(layers[:1])
        try:
            yield
        finally:
            self.model.layers = layers
