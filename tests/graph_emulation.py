"""A CPU stand-in for CUDA graph capture, so that the graph runners' CPU tests exercise padding,
static buffers and the lazy state machine the way a real capture would.

A "graph" is the list of ATen ops dispatched between `begin` and `end` (recorded with a
`TorchDispatchMode`, each with its argument and result tensors). Replaying runs the same ops
on the same tensors again and copies each fresh result into the recorded result, so, like a
CUDA graph, a replay reads whatever the recorded input tensors hold now and bakes in every
Python-side value (shapes, scalars, host lists) from capture time. Host syncs during capture
raise, as they would on CUDA. Custom ops are recorded as one op (their Python implementation
re-runs at replay under the replay's forward context), which is how a split op, or attention
inside a `full` graph whose backend fills static metadata, behaves.

The recorded ops hold their tensors, so tensors a runner keeps without owning them
(`breakable_runner.unowned`) stay valid here as they do in a CUDA graph pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HOST_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.is_nonzero.default,
}


class RecordedGraph:
    def __init__(self, ops: list[tuple[Any, tuple, dict, Any]]) -> None:
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, recorded in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(recorded), tree_leaves(fresh), strict=True):
                if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                    old.copy_(new)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in HOST_SYNCS:
            raise RuntimeError(f"host sync during graph capture: {func}")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class EmulatedSession:
    def __init__(self, capturer: EmulatedCapturer) -> None:
        self.capturer = capturer
        self.recorder: _Recorder | None = None

    def begin(self) -> None:
        assert self.recorder is None, "begin() twice without end()"
        self.recorder = _Recorder()
        self.recorder.__enter__()

    def end(self) -> RecordedGraph:
        assert self.recorder is not None, "end() without begin()"
        recorder, self.recorder = self.recorder, None
        recorder.__exit__(None, None, None)
        graph = RecordedGraph(recorder.ops)
        self.capturer.graphs.append(graph)
        return graph


class EmulatedCapturer:
    """Implements `graph_memory.Capturer`; counts sessions (captures) and graphs (segments).

    `peak` is what every warm-up reports as its peak memory, `total` the device memory, so a
    test sets the budget outcome (`GraphPool` budget = mem_fraction * total)."""

    def __init__(self, peak: int = 0, total: int = 1 << 40) -> None:
        self.peak = peak
        self.total = total
        self.sessions = 0
        self.warmups = 0
        self.graphs: list[RecordedGraph] = []

    @contextmanager
    def session(self) -> Iterator[EmulatedSession]:
        self.sessions += 1
        session = EmulatedSession(self)
        try:
            yield session
        finally:
            if session.recorder is not None:
                session.recorder.__exit__(None, None, None)

    def peak_bytes(self, fn: Callable[[], object]) -> int:
        self.warmups += 1
        fn()
        return self.peak

    def pool_usage(self) -> tuple[int, int]:
        return 0, 0

    def device_bytes(self) -> int:
        return self.total

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs)
