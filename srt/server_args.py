"""One options dataclass for the server flags and the Engine keyword arguments.

Every field is a flag: `--cuda-graph-backend-decode` on the command line is
`cuda_graph_backend_decode=` for `Engine(...)`. Help text lives in each field's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from srt.errors import ServerArgsError

if TYPE_CHECKING:
    from srt.model_config import ModelConfig

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
_MAX_PORT = 65535
# --busy-poll-ms with a CUDA runner: longer than a step, so a process waiting for the next
# step's message never sleeps, and idle again soon after the traffic stops. Only on a host of
# BUSY_POLL_MIN_CPUS or more: the scheduler and the runner then take a core each, and the
# main process (the HTTP server, tokenizing, streaming) needs one beside them.
DEFAULT_BUSY_POLL_S = 0.05
BUSY_POLL_MIN_CPUS = 4
# --tokenizer-worker-num by default: a second front-end process where the host has a core for
# it beside the two polling processes and the main one, and some to spare. One streams about
# 48,000 tokens a second at 128 concurrent streams, less than a 1B model decodes on an H200
# (64,000 at batch 128); two carry 76,000 (docs/benchmarks.md, r10a).
TOKENIZER_WORKERS_MIN_CPUS = 8


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def default_tokenizer_workers(cpus: int | None = None) -> int:
    """--tokenizer-worker-num 0 (unset): 2 on a host of `cpus` (default: `usable_cpus()`) of at
    least TOKENIZER_WORKERS_MIN_CPUS, else 1."""
    return 2 if (usable_cpus() if cpus is None else cpus) >= TOKENIZER_WORKERS_MIN_CPUS else 1


def _opt(default: Any, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = _opt(
        None, "Local Hugging Face model directory (default: the built-in tiny model)."
    )
    tokenizer_path: str | None = _opt(None, "Tokenizer directory (default: model_path).")
    served_model_name: str | None = _opt(None, "Model name reported by the API.")
    load_format: str = _opt(
        "auto",
        "auto: read safetensors; dummy: random weights from --seed.",
        choices=["auto", "dummy"],
    )
    dtype: str = _opt(
        "auto",
        "Weight and activation dtype (auto: the config's torch_dtype).",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    device: str = _opt("auto", "cpu, cuda or auto (cuda when available).")
    seed: int = _opt(0, "Seed for dummy weights and unseeded sampling.")
    context_length: int | None = _opt(None, "Max tokens per request (default: the config's).")
    tp_size: int = _opt(
        1,
        "Tensor-parallel size: the model is sharded over this many model runner processes, "
        "one per GPU (gloo on the CPU).",
    )

    # Memory and batching
    max_total_tokens: int | None = _opt(
        None, "KV cache slots (default: sized from --mem-fraction-static on CUDA, 65536 on CPU)."
    )
    mem_fraction_static: float = _opt(
        0.85, "Fraction of free GPU memory for weights, KV cache and graphs."
    )
    max_running_requests: int = _opt(256, "Max requests decoding at once.")
    chunked_prefill_size: int = _opt(2048, "Max prompt tokens of one request per prefill step.")
    max_prefill_tokens: int = _opt(8192, "Max tokens in one prefill batch.")
    enable_prefix_caching: bool = _opt(True, "Reuse KV of shared prompt prefixes.")
    disable_overlap_schedule: bool = _opt(
        False, "Plan each step only once the previous step's ids are back (no overlap)."
    )
    overlap_depth: int = _opt(
        2, "With overlap: steps launched ahead of the one whose result is processed."
    )
    busy_poll_ms: float | None = _opt(
        None,
        "How long the scheduler and the model runner poll for their next message before they "
        "sleep on it (ms). A process woken from sleep runs tens to hundreds of microseconds "
        "after its message, and a request's way to its first token crosses several; polling "
        "takes a core while it lasts. Default: 50 with a CUDA runner on a host of 4 or more "
        "CPUs, else 0 (on a CPU it would take the cores the model runs on).",
    )
    stream_interval: int = _opt(
        1,
        "Send a running request's new tokens to the tokenizer side every this many tokens "
        "(its first at once, the rest with its end), as SGLang's --stream-interval: fewer, "
        "larger stream events and less main-process work per token, a chunkier stream.",
    )
    enable_mixed_chunk: bool = _opt(
        False, "Decode the running requests inside prefill steps (one step for both)."
    )
    attention_backend: str | None = _opt(
        None, "torch_native, triton or flashinfer (default: triton on CUDA, torch_native on CPU)."
    )

    # Graphs and compilation
    cuda_graph_backend_decode: str | None = _opt(
        None,
        "Decode graph backend: disabled, full, breakable, tc_piecewise (default on CUDA: full "
        "where the attention backend can, else breakable).",
    )
    cuda_graph_backend_prefill: str | None = _opt(
        None,
        "Prefill graph backend: disabled, full, breakable, tc_piecewise (default on CUDA: full "
        "where the attention backend can, else disabled).",
    )
    cuda_graph_tc_compiler: str | None = _opt(
        None,
        "Compiler of the traced general graph (eager, inductor, or aot_inductor: each piece "
        "an AOTInductor package, which a warm start loads without importing Dynamo or "
        "Inductor), for every tc_piecewise phase and, unless --enable-torch-compile, every "
        "full phase (which then captures the compiled forward).",
    )
    inductor_graph_partition: bool = _opt(
        False,
        "Compile the whole traced graph with Inductor once, cut at the split ops at code "
        "generation (Inductor's graph partition), instead of compiling each FX piece alone; "
        "needs --cuda-graph-tc-compiler inductor. The capture kinds serve its partitions as "
        "they serve pieces.",
    )
    compile_passes: list[str] | None = _opt(
        None,
        "Graph passes Inductor runs on the graph it compiles, before lowering (each piece, or "
        "the whole graph with --inductor-graph-partition): none, all, or pass names, joined "
        "by commas or spaces (docs/compilation.md lists them). Default: none.",
    )
    cuda_graph_bs_decode: list[int] | None = _opt(None, "Decode buckets (batch sizes).")
    cuda_graph_bs_prefill: list[int] | None = _opt(None, "Prefill buckets (token counts).")
    cuda_graph_max_bs_decode: int | None = _opt(None, "Largest decode bucket.")
    cuda_graph_max_bs_prefill: int | None = _opt(None, "Largest prefill bucket.")
    cuda_graph_config: str | None = _opt(
        None, "JSON with per-phase settings; wins over the other graph flags."
    )
    cuda_graph_capture: str = _opt(
        "lazy",
        "When buckets are captured: lazy (first hit), upfront, manifest.",
        choices=["lazy", "upfront", "manifest"],
    )
    cuda_graph_mem_fraction: float = _opt(
        0.05, "Fraction of GPU memory reserved for CUDA graphs when sizing the KV cache."
    )
    disable_cuda_graph: bool = _opt(False, "Run every phase eagerly.")
    enable_torch_compile: bool = _opt(False, "Compile the whole forward per bucket (full).")
    torch_compile_max_bs: int = _opt(32, "Largest bucket compiled by --enable-torch-compile.")
    compile_cache_dir: str | None = _opt(
        None, "Compile cache root (default: ~/.cache/srt/compile)."
    )
    keep_shape_guards: bool = _opt(False, "Debug: keep Dynamo shape guards after tracing.")
    custom_ops: list[str] | None = _opt(
        None,
        "Layer ops' Triton kernels: exactly one of all/none, then +NAME/-NAME overrides "
        "(e.g. none +rms_norm, or all,-rotary_embedding). Default: kernels, but the PyTorch "
        "reference inside graphs Inductor compiles (docs/compilation.md lists the ops).",
    )
    skinny_matmul_launch: str = _opt(
        "auto",
        "How the skinny matmul kernel launches: pdl, at one row as a programmatic dependent of "
        "the kernel before it (it starts while that kernel runs, loads its first weight tile, "
        "then waits before reading its input; more rows launch plainly), which needs a CUDA GPU "
        "of compute capability 9.0 or newer; plain; or auto, pdl where the GPU can and plain "
        "elsewhere.",
        choices=["auto", "plain", "pdl"],
    )
    compile_threads: int | None = _opt(
        None,
        "Threads that compile the warm-up's Triton kernels side by side before it runs (the "
        "forward run once with every Triton launch turned into a compile), on a start whose "
        "Triton disk cache is empty, each handing its kernel to one of min(N, 8) worker "
        "processes started with the runner; default one per usable CPU, 0 to compile each "
        "kernel at its first launch, one after another.",
    )
    skip_warmup: bool = _opt(
        False,
        "Skip the model runner's warm-up before ready (dummy prefill steps, from scratch and "
        "over a prefix, and a decode step with sampling, which JIT-compile kernels); the first "
        "requests then pay those compiles.",
    )

    # Server
    host: str = _opt("127.0.0.1", "HTTP host.")
    port: int = _opt(30000, "HTTP port.")
    api_key: str | None = _opt(None, "Require 'Authorization: Bearer KEY' (not on /health).")
    max_request_bytes: int = _opt(
        32 * 1024 * 1024, "Largest request body accepted (larger ones get 413)."
    )
    incremental_streaming_output: bool = _opt(
        False,
        "/generate streams each event's new text and ids, not the whole output so far "
        "(SGLang's flag; its default is the whole output, which SGLang's clients read).",
    )
    tokenizer_worker_num: int = _opt(
        0,
        "Front-end processes sharing the HTTP port, each with its own tokenizer, "
        "detokenization and streams: the main process and N-1 more, a connection served by "
        "one of them (SGLang's flag; vLLM's --api-server-count is the same). More than one "
        "when streaming is a CPU's work: many concurrent streams of a fast model. 0 (the default): "
        f"2 on a host of {TOKENIZER_WORKERS_MIN_CPUS} or more CPUs this process may use, else 1.",
        aliases=["--api-server-count"],
    )
    log_level: str = _opt("info", "Logging level.", choices=LOG_LEVELS, type=str.lower)

    def __post_init__(self) -> None:
        # Resolved once, where the args are made: every process is handed the same count.
        if self.tokenizer_worker_num == 0:
            self.tokenizer_worker_num = default_tokenizer_workers()

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help", None)
            flags = [flag, *meta.pop("aliases", [])]
            hint = hints[f.name]
            if hint is bool:
                # A switch that defaults to on also needs its --no- form to turn it off.
                action = argparse.BooleanOptionalAction if f.default else "store_true"
                parser.add_argument(*flags, action=action, default=f.default, help=help_text)
                continue
            base, is_list = _unwrap(hint)
            kwargs: dict[str, Any] = {"type": base, "default": f.default, "help": help_text}
            if is_list:
                kwargs["nargs"] = "+"
            parser.add_argument(*flags, dest=f.name, **{**kwargs, **meta})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def check(self) -> None:
        """ServerArgsError for the first option that no server could start with. Checked
        before anything starts (and by Engine), so that a typo costs no model load."""
        for name in (
            "max_total_tokens",
            "context_length",
            "max_running_requests",
            "chunked_prefill_size",
            "max_prefill_tokens",
            "torch_compile_max_bs",
            "max_request_bytes",
            "tp_size",
            "overlap_depth",
            "stream_interval",
            "tokenizer_worker_num",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ServerArgsError(name, f"must be a positive integer, got {value!r}")
        if self.compile_threads is not None and not (
            isinstance(self.compile_threads, int) and self.compile_threads >= 0
        ):
            raise ServerArgsError(
                "compile_threads", f"must be a non-negative integer, got {self.compile_threads!r}"
            )
        if self.busy_poll_ms is not None and not (
            isinstance(self.busy_poll_ms, int | float) and 0 <= self.busy_poll_ms <= 10_000
        ):
            raise ServerArgsError(
                "busy_poll_ms", f"must be in [0, 10000] ms, got {self.busy_poll_ms!r}"
            )
        if not (isinstance(self.port, int) and 1 <= self.port <= _MAX_PORT):
            raise ServerArgsError("port", f"must be in [1, {_MAX_PORT}], got {self.port!r}")
        if str(self.log_level).lower() not in LOG_LEVELS:
            raise ServerArgsError(
                "log_level",
                f"invalid choice: {self.log_level!r} (choose from {', '.join(LOG_LEVELS)})",
            )
        from srt.op_selection import SKINNY_LAUNCHES, parse_custom_ops

        try:
            parse_custom_ops(self.custom_ops)
        except ValueError as e:
            raise ServerArgsError("custom_ops", str(e)) from None
        launch = self.skinny_matmul_launch
        if launch not in ("auto", *SKINNY_LAUNCHES):
            raise ServerArgsError(
                "skinny_matmul_launch",
                f"invalid choice: {launch!r} (choose from auto, {', '.join(SKINNY_LAUNCHES)})",
            )
        if launch == "pdl" and self.device == "cpu":
            raise ServerArgsError("skinny_matmul_launch", f"{launch} needs CUDA, not the CPU")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ServerArgsError("device", f"must be cpu, cuda or auto, got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ServerArgsError("device", f"{self.device}: CUDA is not available")
        if self.tp_size > 1:
            self._check_tp_devices()
        if self.attention_backend == "flashinfer":
            from srt import flashinfer_support

            # An explicit CPU here; a device that `auto` resolves to, and its compute
            # capability, the model runner checks once it has the device.
            flashinfer_support.check_flashinfer(
                installed=flashinfer_support.installed(),
                device_type="cpu" if self.device == "cpu" else None,
            )

    def _check_tp_devices(self) -> None:
        if self.device.startswith("cuda:"):
            raise ServerArgsError(
                "device", f"{self.device}: with --tp-size, rank r runs on cuda:r; pass cuda"
            )
        import torch

        if self.resolved_device() == "cuda" and self.tp_size > torch.cuda.device_count():
            raise ServerArgsError(
                "tp_size",
                f"{self.tp_size} ranks need as many GPUs, this host has "
                f"{torch.cuda.device_count()}",
            )

    def check_model(self, config: ModelConfig) -> None:
        """ServerArgsError if the model cannot be sharded over --tp-size ranks, or has a head
        size the attention backend cannot run (checked once its config is read, before any
        process starts)."""
        n = self.tp_size
        for what, count in (
            ("num_attention_heads", config.num_heads),
            ("intermediate_size", config.intermediate_size),
        ):
            if count % n:
                raise ServerArgsError(
                    "tp_size", f"{n} does not divide the model's {what} ({count})"
                )
        kv = config.num_kv_heads
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise ServerArgsError(
                "tp_size",
                f"{n} ranks cannot share the model's {kv} KV heads: the heads must split "
                "evenly, or (fewer heads than ranks) each be replicated on as many ranks",
            )
        if self.attention_backend == "flashinfer":
            from srt.flashinfer_support import check_flashinfer

            check_flashinfer(head_dim=config.head_dim)

    def busy_poll_s(self, device_type: str, cpus: int | None = None) -> float:
        """`busy_poll_ms` in seconds; by default, polling with a runner on CUDA and a host of
        `cpus` (default: this one's) that has a core for each polling process and the main
        one, else none."""
        if self.busy_poll_ms is not None:
            return self.busy_poll_ms / 1000
        if cpus is None:
            cpus = usable_cpus()
        if device_type == "cuda" and cpus >= BUSY_POLL_MIN_CPUS:
            return DEFAULT_BUSY_POLL_S
        return 0.0

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def _unwrap(hint: Any) -> tuple[type, bool]:
    """Return (element type, is_list) for `T`, `T | None`, `list[T] | None`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False
