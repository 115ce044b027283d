"""What the backend gives Dynamo: the split graph as a callable that Dynamo's ahead-of-time
capture can save with the trace and load back. A module of its own because it imports Dynamo
(`import torch._dynamo` takes seconds), which only a process that compiles or loads needs."""

from __future__ import annotations

import pickle
from typing import Any

from torch._dynamo.aot_compile_types import SerializableCallable

from srt.compilation.split import SplitGraph


class CompiledForward(SerializableCallable):
    """What Dynamo's code for the forward calls: the split graph, its pieces routed. It saves
    as the split graph before routing (a GraphModule pickles as its Python code) and the
    piece signatures, which name the pieces' artifacts; a restored one routes nothing until
    `PiecewiseBackend.restore` has loaded its pieces."""

    def __init__(
        self, split: SplitGraph, signatures: list[str], saved: bytes | None = None
    ) -> None:
        self.split = split
        self.signatures = signatures
        # Pickled now, before the router's slots shadow the pieces (or kept, as loaded).
        self.saved = saved if saved is not None else pickle.dumps((split, signatures))

    def __call__(self, *args: Any) -> Any:
        return self.split.module(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: CompiledForward) -> bytes:
        return fn.saved

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> CompiledForward:
        split, signatures = pickle.loads(data)
        return cls(split, signatures, data)
