"""Compilation layer: custom ops, split ops, tracing, piecewise compile, cache."""

from srt.compilation.custom_ops import register_custom_op, register_split_op, split_ops

__all__ = ["register_custom_op", "register_split_op", "split_ops"]
