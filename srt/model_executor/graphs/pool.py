"""The graph memory pool: one per model runner, shared by every phase and bucket, on a budget.

Every capture allocates from one pool (`torch.cuda.graph_pool_handle()`), so buckets share
memory: a graph's intermediates are dead once its replay ends, and the next capture reuses
them. Nothing whose value must outlive a replay (inputs, outputs, attention metadata) lives
in the pool; the runners keep those in static buffers allocated outside it.

Budget: KV cache sizing leaves `--cuda-graph-mem-fraction` of the device memory free for
graphs. Each bucket is warmed up eagerly before its capture; the warm-up's peak memory is
the estimate of what the capture needs, and a capture that would grow the pool past the
budget is skipped (logged once; that bucket runs uncaptured). An out-of-memory error while
warming up or capturing skips the bucket too: capture never crashes the server.

Tensors a capture keeps for later replays without pinning their pool memory are held through
`unowned` views: safe because graphs of one pool never run concurrently and everything a replay
reads from the pool is written by that same replay.

The capture action is injectable (`GraphPool.capturer`): `CudaGraphCapturer` records CUDA
graphs; without CUDA there is nothing to capture (`capturer` is None) and the runners take
their uncaptured path; tests plug in a capturer that emulates graphs on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from srt.ipc.reports import GraphPoolInfo

logger = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 2**20


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s memory that does not keep that memory allocated."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    return t.new_empty(0).set_(alias, t.storage_offset(), t.shape, t.stride())


class Graph(Protocol):
    def replay(self) -> None: ...


class CaptureSession(Protocol):
    """Records work between `begin` and `end` into a graph; a session may record several
    graphs in turn (the segments of a breakable capture), all in the same pool."""

    def begin(self) -> None: ...

    def end(self) -> Graph: ...


class Capturer(Protocol):
    def session(self) -> AbstractContextManager[CaptureSession]: ...

    def peak_bytes(self, fn: Callable[[], object]) -> int:
        """Run `fn` and return the most memory it held at once beyond what was in use."""
        ...

    def pool_usage(self) -> tuple[int, int]:
        """(bytes the pool reserves, bytes of it in use by live tensors) now."""
        ...

    def device_bytes(self) -> int:
        """Total device memory (the budget is a fraction of it)."""
        ...


class _CudaSession:
    def __init__(self, pool: torch.cuda._POOL_HANDLE) -> None:
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> torch.cuda.CUDAGraph:
        graph, self.graph = self.graph, None
        assert graph is not None, "end() without begin()"
        graph.capture_end()
        return graph

    def abort(self) -> None:
        """End a capture cut short by an error (the stream must leave capture mode)."""
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except RuntimeError:
                pass  # the capture was already invalidated by the error being raised
            self.graph = None


class CudaGraphCapturer:
    """Captures CUDA graphs into one pool, on one side stream (so that captures can share it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def session(self) -> Iterator[_CudaSession]:
        session = _CudaSession(self.pool)
        torch.cuda.synchronize(self.device)
        try:
            with torch.cuda.stream(self.stream):
                try:
                    yield session
                except BaseException:
                    # On the capture stream: a capture ends only on the stream it began on,
                    # and one left open makes every later CUDA call of the process fail.
                    session.abort()
                    raise
        finally:
            torch.cuda.synchronize(self.device)

    def peak_bytes(self, fn: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def pool_usage(self) -> tuple[int, int]:
        pool = tuple(self.pool)
        segments = [
            seg for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) == pool
        ]
        return (sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments))

    def device_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


def default_capturer(device: torch.device) -> Capturer | None:
    """The capture action for `device`: CUDA graphs on CUDA, nothing elsewhere."""
    return CudaGraphCapturer(device) if device.type == "cuda" else None


@dataclass
class Captured(Generic[T]):
    result: T  # what the record function returned (the graphs, the outputs)
    ms: float  # warm-up + capture
    pool_growth: int  # bytes the pool grew by


class GraphPool:
    """The one graph pool of a model runner, its budget, and the capture procedure."""

    def __init__(self, device: torch.device, mem_fraction: float) -> None:
        self.capturer = default_capturer(device)
        self.mem_fraction = mem_fraction
        self.bytes = 0  # pool size after the last capture (it only grows when capturing)
        self.live_bytes = 0  # of which held by live tensors (the rest is free for reuse)
        self.captures = 0
        self.skips = 0
        self.labels: Counter[str] = Counter()  # captures per label (one each, by design)

    @property
    def budget_bytes(self) -> int:
        if self.capturer is None:
            return 0
        return int(self.mem_fraction * self.capturer.device_bytes())

    def capture(
        self,
        label: str,
        warmup: Callable[[], object],
        record: Callable[[CaptureSession], T],
        warmup_runs: int = 2,
    ) -> Captured[T] | None:
        """Warm up (`warmup_runs` eager runs), check the budget, then capture with `record`.

        Returns None, after logging why, when the capture is skipped: over budget or out of
        memory. `label` names the capture in the log ("decode bucket 8").
        """
        if self.capturer is None:
            raise RuntimeError("GraphPool.capture: no capturer on this device")
        start = time.perf_counter()
        try:
            for _ in range(warmup_runs - 1):
                warmup()
            need = self.capturer.peak_bytes(warmup)
            # The capture reuses the pool's free memory and grows it by the rest.
            projected = max(self.bytes, self.live_bytes + need)
            budget = self.budget_bytes
            if projected > budget:
                self.skips += 1
                logger.warning(
                    "graph memory: skipping the capture of %s: it needs about %.1f MiB, the pool "
                    "would hold %.1f MiB of a %.1f MiB budget (--cuda-graph-mem-fraction); it "
                    "runs uncaptured",
                    label,
                    need / MiB,
                    projected / MiB,
                    budget / MiB,
                )
                return None
            before = self.bytes
            with self.capturer.session() as session:
                result = record(session)
        except torch.OutOfMemoryError:
            self.skips += 1
            logger.warning("graph memory: out of memory capturing %s; it runs uncaptured", label)
            return None
        except Exception as e:
            e.add_note(f"while capturing {label}")
            raise
        self.bytes, self.live_bytes = self.capturer.pool_usage()
        self.captures += 1
        self.labels[label] += 1
        ms = (time.perf_counter() - start) * 1000
        logger.info(
            "captured %s in %.1f ms; graph pool %.1f MiB (+%.1f MiB)",
            label,
            ms,
            self.bytes / MiB,
            (self.bytes - before) / MiB,
        )
        return Captured(result, ms, self.bytes - before)

    def info(self) -> GraphPoolInfo:
        return GraphPoolInfo(
            self.capturer is not None,
            self.bytes,
            self.budget_bytes,
            self.captures,
            self.skips,
            list(self.labels),
        )
