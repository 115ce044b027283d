"""Per-phase graph configuration: which backend each phase uses and its bucket ladder.

Precedence: `--cuda-graph-config` JSON > the convenience flags > defaults. Every invalid
setting is rejected at startup with a message naming the flag.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from srt.batch_layout import ForwardMode
from srt.compilation.graph_passes import graph_passes, resolve_passes, whole_graph_passes
from srt.compilation.piece_compiler import COMPILERS
from srt.op_selection import kernels_missing, turned_off
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    PREFILL = "prefill"  # buckets are token counts
    DECODE = "decode"  # buckets are batch sizes

    @property
    def mode(self) -> ForwardMode:
        """The step kind this phase runs."""
        return ForwardMode.DECODE if self is Phase.DECODE else ForwardMode.EXTEND


class Backend(enum.StrEnum):
    DISABLED = "disabled"
    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"


def default_decode_ladder() -> list[int]:
    return [1, 2, 4, 8, 12] + list(range(16, 257, 8))


def default_prefill_ladder() -> list[int]:
    return (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
    )


# The step kinds the triton attention backend runs inside a CUDA graph (its `graph_modes`).
CAPTURABLE_BY_TRITON = frozenset({ForwardMode.DECODE, ForwardMode.EXTEND})


class GraphConfigError(ValueError):
    pass


@dataclass
class PhaseConfig:
    backend: Backend
    bs: list[int]  # buckets, increasing, all <= max_bs
    max_bs: int
    # The compiler of the traced general graph the phase runs, whatever its capture kind
    # (tc_piecewise always has one); None: the model's eager forward.
    tc_compiler: str | None = None

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding `n`, or None beyond the largest."""
        for b in self.bs:
            if b >= n:
                return b
        return None


def _flag(phase: Phase, name: str) -> str:
    return f"--cuda-graph-{name.replace('_', '-')}-{phase.value}"


def _phase_config(
    phase: Phase,
    raw: dict[str, Any],
    device: str,
    graph_modes: frozenset[ForwardMode],
    where: Callable[[str], str],
) -> PhaseConfig:
    backend_name = raw.get("backend", _default_backend(phase, device, graph_modes))
    try:
        backend = Backend(backend_name)
    except ValueError:
        raise GraphConfigError(
            f"{where('backend')}: unknown backend {backend_name!r}; "
            f"choose one of {[b.value for b in Backend]}"
        ) from None
    ladder = default_decode_ladder() if phase is Phase.DECODE else default_prefill_ladder()
    explicit = raw.get("bs")
    bs = list(explicit) if explicit is not None else ladder
    if not bs:
        raise GraphConfigError(f"{where('bs')}: the bucket list is empty")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs):
        raise GraphConfigError(f"{where('bs')}: buckets must be positive integers, got {bs}")
    if any(b >= c for b, c in zip(bs, bs[1:], strict=False)):
        raise GraphConfigError(f"{where('bs')}: buckets must be strictly increasing, got {bs}")
    max_bs = raw.get("max_bs")
    if max_bs is None:
        max_bs = bs[-1] if explicit is not None else (256 if phase is Phase.DECODE else 4096)
    if not isinstance(max_bs, int) or max_bs < 1:
        raise GraphConfigError(f"{where('max_bs')}: must be a positive integer, got {max_bs!r}")
    bs = [b for b in bs if b <= max_bs]
    if not bs:
        raise GraphConfigError(f"{where('max_bs')}: {max_bs} is below the smallest bucket")
    # How a phase is compiled and how it is captured are independent: any backend runs the
    # compiled general graph when given a tc compiler; tc_piecewise always does.
    tc_compiler = raw.get("tc_compiler")
    if backend is Backend.TC_PIECEWISE:
        tc_compiler = tc_compiler or "eager"
    if tc_compiler is not None:
        if tc_compiler not in COMPILERS:
            raise GraphConfigError(
                f"{where('tc_compiler')}: unknown compiler {tc_compiler!r}; "
                f"choose one of {COMPILERS}"
            )
    return PhaseConfig(backend, bs, max_bs, tc_compiler)


def resolve_graph_config(
    args: ServerArgs, device: str, graph_modes: frozenset[ForwardMode] = CAPTURABLE_BY_TRITON
) -> dict[Phase, PhaseConfig]:
    """Per-phase configs from the flags. Default, on CUDA: each phase `full` where the
    attention backend runs it inside a graph (`graph_modes`, as triton does both), else decode
    `breakable` and prefill `disabled`; nothing on the CPU.

    Why prefill is captured by default: served at concurrency 1-128 on the H200 (1B shape, 128
    prompt tokens and 256 new, docs/benchmarks.md r8), captured prefill took TTFT at
    concurrency 1 from 22.7 to 7.2 ms and throughput up 12-22% at 32-128, although the
    buckets it met for the first time were captured inside the run. Mixed steps
    (`--enable-mixed-chunk`) did no better at 64-128 and stay off."""
    try:
        overrides = json.loads(args.cuda_graph_config) if args.cuda_graph_config else {}
    except json.JSONDecodeError as e:
        raise GraphConfigError(f"--cuda-graph-config: invalid JSON: {e}") from e
    if not isinstance(overrides, dict) or set(overrides) - {p.value for p in Phase}:
        raise GraphConfigError(
            "--cuda-graph-config: expected an object with keys 'prefill' and/or 'decode'"
        )
    configs = {
        phase: _resolve_phase(phase, overrides.get(phase.value, {}), args, device, graph_modes)
        for phase in Phase
    }
    compilers = {c.tc_compiler for c in configs.values() if c.tc_compiler is not None}
    if args.inductor_graph_partition and compilers - {"inductor"}:
        raise GraphConfigError(
            "--inductor-graph-partition compiles the whole graph with Inductor: every phase "
            f"that runs the compiled graph needs --cuda-graph-tc-compiler inductor, not "
            f"{sorted(compilers - {'inductor'})}"
        )
    if args.inductor_graph_partition and not compilers:
        logger.warning(
            "--inductor-graph-partition is ignored: no phase runs the compiled graph (set "
            "--cuda-graph-tc-compiler inductor with tc_piecewise or full)"
        )
    if args.cuda_graph_tc_compiler is not None and not compilers:
        # As SGLang does, a compiler that nothing uses is ignored, not refused.
        logger.warning(
            "--cuda-graph-tc-compiler %s is ignored: no phase uses tc_piecewise or full "
            "(set --cuda-graph-backend-decode or -prefill)",
            args.cuda_graph_tc_compiler,
        )
    return configs


def resolve_compile_passes(
    args: ServerArgs, configs: dict[Phase, PhaseConfig], device: str
) -> tuple[str, ...]:
    """The graph passes `--compile-passes` turns on, in run order (the model's modules, which
    register them, imported by now); none when no phase compiles with Inductor.

    A pass that puts a layer op's kernel in the graph is refused where that kernel cannot
    run: `--custom-ops` turns it off (`none`, `-name`: asking for the reference everywhere
    and for the kernel in Inductor's graphs contradict each other, and neither is guessed to
    win), or the device has no kernels (the CPU is not one such: there the op runs its CPU
    kernel, the reference)."""
    try:
        names = resolve_passes(args.compile_passes)
    except ValueError as e:
        raise GraphConfigError(f"--compile-passes: {e}") from None
    if not any(c.tc_compiler == "inductor" for c in configs.values()):
        if names:
            logger.warning(
                "--compile-passes is ignored: no phase compiles the graph with Inductor (set "
                "--cuda-graph-tc-compiler inductor with tc_piecewise or full)"
            )
        return ()
    known, off = graph_passes(), turned_off(args.custom_ops)
    refused = [
        f"{name} (--custom-ops {off[op]})"
        for name in names
        if (op := known[name].op) is not None and op in off
    ]
    if refused:
        raise GraphConfigError(
            f"--compile-passes: {', '.join(refused)} put(s) a layer op's kernel in the graph "
            "where --custom-ops turns it off: leave the pass out, or the op's entry"
        )
    missing = kernels_missing(device) if device != "cpu" else None
    kernel_passes = [name for name in names if known[name].op is not None]
    if missing is not None and kernel_passes:
        raise GraphConfigError(
            f"--compile-passes: {', '.join(kernel_passes)} put(s) a layer op's kernel in the "
            f"graph, but {missing}"
        )
    whole = whole_graph_passes(names)
    named = {p.strip() for entry in args.compile_passes or () for p in entry.split(",")}
    if whole and not args.inductor_graph_partition and named == {"all"}:
        # `all`: every pass this mode can run; a pass named alone is refused below.
        logger.info("--compile-passes all: %s left out (partition mode only)", ", ".join(whole))
        names = [name for name in names if name not in whole]
    elif whole and not args.inductor_graph_partition:
        raise GraphConfigError(
            f"--compile-passes: {', '.join(whole)} rewrite(s) the graph across the split ops "
            "and need(s) --inductor-graph-partition"
        )
    return tuple(names)


def _resolve_phase(
    phase: Phase,
    from_json: Any,
    args: ServerArgs,
    device: str,
    graph_modes: frozenset[ForwardMode],
) -> PhaseConfig:
    """One phase's config: its `--cuda-graph-config` entry over its flags over the defaults."""
    if not isinstance(from_json, dict):
        raise GraphConfigError(f"--cuda-graph-config: '{phase.value}' must be an object")
    unknown = set(from_json) - {"backend", "bs", "max_bs", "tc_compiler"}
    if unknown:
        raise GraphConfigError(
            f"--cuda-graph-config: unknown key(s) {sorted(unknown)} for '{phase.value}'"
        )
    from_flags = {
        "backend": getattr(args, f"cuda_graph_backend_{phase.value}"),
        "bs": getattr(args, f"cuda_graph_bs_{phase.value}"),
        "max_bs": getattr(args, f"cuda_graph_max_bs_{phase.value}"),
        "tc_compiler": args.cuda_graph_tc_compiler,
    }
    if args.disable_cuda_graph:
        from_flags["backend"] = Backend.DISABLED
    raw = {k: v for k, v in from_flags.items() if v is not None}
    raw.update(from_json)
    if "tc_compiler" not in from_json and not _flag_compiler_applies(
        raw.get("backend", _default_backend(phase, device, graph_modes)), args
    ):
        # One --cuda-graph-tc-compiler serves whichever phases can use it.
        raw.pop("tc_compiler", None)

    def where(key: str) -> str:
        if key in from_json:
            return f"--cuda-graph-config {phase.value}.{key}"
        return "--cuda-graph-tc-compiler" if key == "tc_compiler" else _flag(phase, key)

    config = _phase_config(phase, raw, device, graph_modes, where)
    if config.backend is Backend.FULL and config.tc_compiler and args.enable_torch_compile:
        raise GraphConfigError(
            f"{where('tc_compiler')}: a full phase with a tc compiler captures the compiled "
            "general graph; --enable-torch-compile compiles each bucket instead: use one"
        )
    return config


def _default_backend(phase: Phase, device: str, graph_modes: frozenset[ForwardMode]) -> Backend:
    if device != "cuda":
        return Backend.DISABLED
    if phase.mode in graph_modes:
        return Backend.FULL
    return Backend.BREAKABLE if phase is Phase.DECODE else Backend.DISABLED


def _flag_compiler_applies(backend: str, args: ServerArgs) -> bool:
    """Whether `--cuda-graph-tc-compiler` applies to a phase of `backend`: tc_piecewise
    always; full unless `--enable-torch-compile` keeps SGLang's per-bucket compile for it."""
    return backend == Backend.TC_PIECEWISE or (
        backend == Backend.FULL and not args.enable_torch_compile
    )
