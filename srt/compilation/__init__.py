"""Compilation layer: custom ops, split ops, tracing, piecewise compile, cache.

- `custom_ops`: `register_custom_op`, `register_split_op`, `custom_ops()`, `split_ops()`,
  `inductor_trace()`.
- `piecewise_model`: `PiecewiseModel`, the forward traced once (or loaded), run with no guards.
- `compile_info`: the server info's `compile` section, light to import.
- `backend`: the torch.compile backend Dynamo hands the traced graph to.
- `compiled_forward`: what the backend returns, saved with Dynamo's capture for a warm start.
- `split`: the split at split ops and the piece signatures (identical pieces share).
- `piece_compiler`: a piece compiled once for the general shape, `eager` or `inductor`.
- `dispatch`: per piece, per bucket states and the `Specializer` hook (CUDA graphs plug in).
- `cache`: the compile cache (four-factor key, checked artifacts, bucket manifest).

Design and how to read the logs: docs/compilation.md.
"""

from srt.compilation.op_registry import register_custom_op, register_split_op, split_ops

__all__ = ["register_custom_op", "register_split_op", "split_ops"]
