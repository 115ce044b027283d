"""What the backend gives Dynamo: the split graph (or, in the partition mode, the whole
compiled graph) as a callable that Dynamo's ahead-of-time capture can save with the trace and
load back. A module of its own because it imports Dynamo
(`import torch._dynamo` takes seconds), which only a process that compiles or loads needs."""

from __future__ import annotations

import pickle
from collections.abc import Callable
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


class PartitionedForward(SerializableCallable):
    """What Dynamo's code for the forward calls in the partition mode: the whole graph as
    Inductor compiled it, its partitions routed (`partition_compiler`). It saves as the name
    of its artifact in the compile cache and the graph's signature; a restored one runs
    nothing until `PiecewiseBackend.restore` has loaded that artifact."""

    def __init__(self, artifact: str, signature: str) -> None:
        self.artifact = artifact
        self.signature = signature
        self.fn: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        assert self.fn is not None, "the compiled graph is set when compiled or restored"
        return self.fn(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: PartitionedForward) -> bytes:
        return pickle.dumps((fn.artifact, fn.signature))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PartitionedForward:
        return cls(*pickle.loads(data))
