"""Per-phase forward runners: how a phase (prefill, decode) turns a batch into logits.

`EagerRunner` is the `disabled` backend and the uncaptured path every other backend falls
back to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from srt.model_executor.forward_batch import ForwardBatch, forward_context


def last_token_indices(batch: ForwardBatch) -> torch.Tensor:
    return batch.extend_start_loc.long() + batch.extend_lens.long() - 1


class EagerRunner:
    """Runs the model forward as plain PyTorch."""

    backend = "disabled"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of each request's last token."""
        batch.attn_backend.init_forward_metadata(batch)
        with forward_context(batch):
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[last_token_indices(batch)])

    def info(self) -> dict[str, Any]:
        return {"backend": self.backend}
