"""What each process reports about itself: the typed records that `info()` methods return, that
travel in the ready reports and info replies, and that `/get_server_info`, `/metrics` and the
ready lines read. Torch-free, so every process can read them; JSON is `dataclasses.asdict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from srt.compilation.compile_info import CompileInfo


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
    captured: list[str]  # every capture's label ("decode bucket 8"), in order


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


@dataclass(frozen=True)
class OpImplInfo:
    """Which implementation a layer op runs, outside graphs Inductor compiles and inside."""

    impl: str  # kernel, reference
    in_inductor_graph: str
    why: str  # the `--custom-ops` entry, or the missing piece, that decided it


@dataclass(frozen=True)
class JitMiss:
    what: str  # the kernel or frame that compiled
    ms: float
    during: str | None  # the step it happened in


@dataclass(frozen=True)
class JitMissesInfo:
    """JIT compiles after the runner was ready: a count and the first few."""

    count: int
    listed: tuple[JitMiss, ...]


@dataclass(frozen=True)
class JitBuildsInfo:
    """FlashInfer's JIT modules before ready: compiled with nvcc (not in the cache yet) or only
    loaded, and the seconds both took (in the warm-up or the captures before ready, whose
    parts of the startup breakdown leave them out)."""

    compiled: int
    loaded: int
    s: float


@dataclass(frozen=True)
class CompileAheadInfo:
    """The warm-up's Triton kernels compiled side by side before it ran them
    (`srt.compilation.triton_ahead`): on how many threads, how many specialisations (compiled,
    or loaded from Triton's disk cache), how many failed or were unfinished at the deadline
    (compiled at their launch), and the seconds it held the start (`s`); then what the
    warm-up still compiled at a launch, one after another (a kernel the pool never saw), and
    the seconds that took; and the worker processes that compiled first (0: the threads
    alone), with how many kernels they compiled and when they had all imported, from their
    start (None: one had not, at the block's end). What bounds the block: when it began, from
    the workers' start; its forwards (entering it to the last launch); the longest compile on
    a worker and all of theirs together; the longest compile or load on a thread."""

    threads: int
    kernels: int
    failed: int
    s: float
    missed: int = 0
    missed_s: float = 0.0
    processes: int = 0
    in_processes: int = 0
    processes_ready_s: float | None = None
    began_s: float | None = None
    forwards_s: float = 0.0
    longest_process_s: float = 0.0
    longest_process_kernel: str = ""
    processes_s: float = 0.0
    longest_thread_s: float = 0.0
    # The start's own work that ran between the two steps (the weight fill, the breakdown's
    # `load`), its seconds: `s` is the block's part of the critical path (its forwards, then
    # the wait after that work), `span_s` from its start to its end, the work between included.
    beside_s: float = 0.0
    span_s: float = 0.0
    # The compile that ended last: its kernel, when it was handed out and when it ended,
    # from the block's start (a late hand-out, or a long compile?).
    last_kernel: str = ""
    last_handed_s: float = 0.0
    last_done_s: float = 0.0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    device: str


@dataclass(frozen=True)
class RunnerInfo:
    """The model runner: its device and KV cache, its start part by part, and its graphs."""

    device: str
    dtype: str
    attention_backend: str
    kv_slots: int
    kv_cache_bytes: int
    context_length: int
    tp_size: int
    tp_ranks: tuple[RankInfo, ...]
    device_init_s: float  # the CUDA context and cuBLAS's handles
    load_s: float
    load_bytes: int  # checkpoint bytes read into this rank's parameters (0: dummy weights)
    load_gb_s: float | None  # load_bytes / load_s, in GB (1e9 bytes) a second; None: dummy
    custom_ops_s: float  # the layer kernels' selection and import
    kv_alloc_s: float
    warmup_s: float  # FlashInfer's JIT builds and the compile ahead left out
    capture_s: float  # captures before ready (upfront, manifest), the same
    flashinfer_jit: JitBuildsInfo
    compile_ahead: CompileAheadInfo | None  # None: not run (off CUDA, flag, backend)
    jit_misses: JitMissesInfo
    graph_pool: GraphPoolInfo
    compile: CompileInfo  # the piecewise compile (zeros when no phase compiles)
    custom_ops: dict[str, OpImplInfo]
    skinny_matmul_launch: str  # --skinny-matmul-launch as resolved here (auto: pdl or plain)
    graphs: dict[str, PhaseGraphsInfo]  # per phase


@dataclass(frozen=True)
class StepKindSummary:
    """The steps of one kind (prefill, decode, ...) in a timeline's window."""

    steps: int
    requests_mean: float
    tokens_mean: float
    ms_total: float  # from their starts to the next step's (a long step counts in full)
    gaps_ms: dict[str, float] = field(default_factory=dict)  # their median gaps, as below
    means_ms: dict[str, float] = field(default_factory=dict)  # their durations' means
    # Their periods (start to the next step's start): p10, p50 and p90, where a median of all
    # steps hides an uneven rhythm of short and long turns.
    periods_ms: dict[str, float] = field(default_factory=dict)
    # Their durations' medians: the device's usual step beside its mean, which a few long or
    # short steps move (a host turn's rhythm against the device's own).
    medians_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TimelineSummary:
    """Where a process's steps went over a window: the median milliseconds from each mark to
    the next (`gaps_ms`, keyed `first_to_second`), from one step's start to the next's, and
    per step kind; with the process's CPU seconds so far, so that two answers give its share."""

    steps: int  # begun, all told
    window_steps: int  # summed here
    cpu_s: float
    gaps_ms: dict[str, float]
    period_ms: float | None
    kinds: dict[str, StepKindSummary]
    # Measured durations' means (the runner's device busy and idle ms per step, on CUDA).
    means_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadyReport:
    """What a child process tells the launcher, once, when it is ready: its start from its
    spawn (the interpreter and its imports, then its own setup) and what it is serving with."""

    pid: int
    spawn_imports_s: float
    setup_s: float
    runner: RunnerInfo | None = None  # the model runner's (rank 0)


@dataclass(frozen=True)
class StartFailure:
    """What a child tells the launcher instead, when it failed to start."""

    error: str


@dataclass(frozen=True)
class ProcessStartup:
    """One process's start, broken down into parts that sum to its total (`other_s`, the
    rest, is never negative)."""

    pid: int
    total_s: float
    breakdown: dict[str, float]
    # A child's: when the launcher spawned it and heard it was ready (from the launch), and
    # its own report (its interpreter and imports, then its setup).
    spawned_after_s: float | None = None
    ready_after_s: float | None = None
    spawn_imports_s: float | None = None
    setup_s: float | None = None


@dataclass(frozen=True)
class ServerStartup:
    startup_s: float  # from the launch to ready
    ready_at: float  # time.time() then
    ipc_dir: str
    processes: dict[str, ProcessStartup]  # tokenizer, scheduler, model_runner[_rankN]


def jsonable(record: object) -> Any:
    """A record (or anything holding records) as JSON data: dicts, lists and scalars."""
    return orjson.loads(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS))


@dataclass(frozen=True)
class ProfileOutcome:
    """Where the runner's profile stands (`/start_profile`, `/stop_profile`): whether one is
    recording, the steps it has, its trace file, and once it is written the trace's summary
    per step (`srt.profiling.summarize_trace`); `message` says what happened, `error` why a
    request was refused (a bad value: the runner serves on)."""

    recording: bool
    steps: int
    trace: str | None
    message: str
    summary: dict[str, Any] | None = None
    error: str | None = None
