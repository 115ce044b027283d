"""srt: an LLM serving runtime that compiles and captures only what the traffic needs."""

from srt.engine import Engine

__all__ = ["Engine"]
