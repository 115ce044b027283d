"""What each process reports about itself: the typed records that `info()` methods return, that
travel in the ready reports and info replies, and that `/get_server_info`, `/metrics` and the
ready lines read. Torch-free, so every process can read them; JSON is `dataclasses.asdict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class BucketInfo:
    bucket: int
    state: str  # unseen, captured, skipped (over the graph memory budget: runs uncaptured)
    capture_ms: float | None  # warm-up and capture, when captured
    pool_growth: int  # bytes the graph pool grew by when it was captured
    replays: int


@dataclass(frozen=True)
class ForwardInfo:
    """How a phase computes its forward (the compile axis)."""

    kind: str  # eager, general_graph, per_bucket_compile
    tc_compiler: str | None = None  # general_graph: the pieces' compiler
    general_runs: int | None = None  # general_graph: serving forwards without a bucket
    torch_compile_max_bs: int | None = None  # per_bucket_compile: the largest compiled bucket


@dataclass(frozen=True)
class CaptureInfo:
    """What a phase's capture kind adds (the capture axis)."""

    static_bytes: int = 0  # buffers it keeps outside the graph pool
    samplers_captured: tuple[int, ...] = ()  # full: buckets with a sampler graph of their own
    pieces_captured: int = 0  # tc_piecewise: (piece, bucket) graphs


@dataclass(frozen=True)
class PhaseGraphsInfo:
    """One phase's graphs: its backend, forward and capture, and every bucket's state."""

    backend: str
    forward: ForwardInfo
    capture: CaptureInfo | None = None  # None: nothing captured (disabled, or no capturer)
    max_bs: int | None = None  # None for disabled
    buckets: tuple[BucketInfo, ...] = ()
    captured: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    capture_s: float = 0.0
    replays: int = 0
    uncaptured_runs: int = 0  # beyond the largest bucket, of a skipped bucket, or no capturer
    pool_bytes: int = 0
    static_bytes: int = 0  # the static inputs and outputs, outside the pool


@dataclass(frozen=True)
class GraphPoolInfo:
    capture: bool  # whether this device captures at all
    pool_bytes: int
    budget_bytes: int
    captures: int
    skips: int


@dataclass(frozen=True)
class SchedulerInfo:
    """The scheduler's queue, KV slots and counters."""

    running_requests: int  # decoding, and the one whose prompt is half prefilled
    queued_requests: int
    kv_slots_total: int
    kv_slots_free: int
    kv_slots_used: int  # cached prefixes included
    kv_slots_cached: int  # held by the prefix cache
    kv_usage: float  # kv_slots_used / kv_slots_total
    prefill_steps: int
    decode_steps: int
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    mixed_decode_tokens: int  # decodes that rode along in prefill steps


def jsonable(record: object) -> Any:
    """A record (or anything holding records) as JSON data: dicts, lists and scalars."""
    return orjson.loads(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS))
