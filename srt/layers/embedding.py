"""Token embedding and the LM head, vocabulary-parallel under tensor parallelism.

Each rank holds a contiguous part of the vocabulary rows (the last part padded with zero rows
when the vocabulary does not divide): the embedding looks up the ids in its part, zeroes the
others and sums over the ranks; the LM head computes its part's logits and gathers them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import all_gather_last_dim, all_reduce, padded_shard, tp_size
from srt.layers.custom_op import CustomOp
from srt.layers.linear import CheckpointTensor, check_shape, linear


class _VocabRows(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.shard = padded_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointTensor, shard: int = 0) -> None:
        check_shape(source, (self.vocab_size, self.hidden_size))
        real = max(min(self.shard.size, self.vocab_size - self.shard.start), 0)
        param.data[real:].zero_()
        if real:
            rows = slice(self.shard.start, self.shard.start + real)
            source.copy_to(param.data[:real], (rows, slice(None)))


class VocabEmbedding(_VocabRows):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0))


class LMHead(_VocabRows, CustomOp):
    """Projects hidden states to float32 vocabulary logits (matmul in the model dtype; the
    `skinny_matmul` op, see linear.py)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(self, hidden, self.weight, None)
        if tp_size() > 1:
            logits = all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits.float()
