"""srt: an LLM serving runtime that compiles and captures only what the traffic needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from srt.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # `import srt` stays light (no torch): the server's launcher checks its flags before it
    # pays for the heavy imports.
    if name == "Engine":
        from srt.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")
