"""The model runner's setup steps that decide something: the device, the layer kernels, how
many KV slots fit, and the compile cache entry of this setup."""

from __future__ import annotations

import inspect
import logging
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.compilation.cache import CompileCache
from srt.compilation.cache_key import CacheFactors, collect_factors
from srt.compilation.cache_root import CacheRoot
from srt.compilation.piece_compiler import INDUCTOR_COMPILERS
from srt.distributed import min_over_ranks
from srt.errors import ServerArgsError
from srt.layers.custom_op import apply_custom_ops, custom_ops_info, describe_custom_ops
from srt.layers.linear import skinny_table_fingerprint
from srt.model_config import ModelConfig
from srt.model_executor.graphs.config import Backend, Phase, PhaseConfig
from srt.model_executor.kv_cache import kv_bytes_per_token
from srt.op_selection import (
    PDL_MIN_CAPABILITY,
    SKINNY_LAUNCHES,
    OpImpl,
    asks_for_kernels,
    kernels_missing,
    resolve_custom_ops,
)
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.tp_rank import TPRank

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_SLOTS = 65536


def init_cuda(device: torch.device, dtype: torch.dtype) -> None:
    """Make the CUDA context and cuBLAS's handles now, where the startup breakdown times them
    (else the weight load or the warm-up's first matmul pays for them, unseen)."""
    torch.cuda.set_device(device.index or 0)
    a = torch.ones(16, 16, dtype=dtype, device=device)
    (a @ a).sum().item()


def select_custom_ops(
    model: nn.Module, args: ServerArgs, device: torch.device, launch: str
) -> dict[str, OpImpl]:
    """Resolve `--custom-ops` for this device and give every layer its selection and the skinny
    matmul kernel's `launch` (`skinny_launch`'s; before any trace: they shape the graph)."""
    missing = kernels_missing(device.type)
    impls = resolve_custom_ops(args.custom_ops, missing)
    if missing is not None and asks_for_kernels(args.custom_ops):
        logger.warning("--custom-ops asks for kernels, but %s: the reference runs", missing)
    apply_custom_ops(model, impls, SKINNY_LAUNCHES[launch])
    logger.info("custom ops: %s", "; ".join(describe_custom_ops(impls)))
    return impls


def puts_norms_in_products(args: ServerArgs, device: torch.device, tp_size: int) -> bool:
    """Whether the decoder layers' norms go into the products after them: where the skinny
    matmul kernel runs (`--custom-ops`, kernels on this device) on one GPU. Under tensor
    parallelism the norms stay where the sequence-parallel pass finds them."""
    impls = resolve_custom_ops(args.custom_ops, kernels_missing(device.type))
    return tp_size == 1 and impls["skinny_matmul"].kernel


def skinny_launch(launch: str, device: torch.device) -> str:
    """`--skinny-matmul-launch` resolved for `device`: `auto` is `pdl` on a CUDA GPU that can
    launch a programmatic dependent (griddepcontrol is Hopper's; r40, an H100: 0.03-0.045
    ms off the 1B batch-1 step, 0.11 ms off the 8B one), `plain` elsewhere. ServerArgsError
    where `pdl` is asked of a device that cannot."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    can = capability is not None and capability >= PDL_MIN_CAPABILITY
    if launch == "auto":
        return "pdl" if can else "plain"
    if launch != "plain" and not can:
        need = ".".join(map(str, PDL_MIN_CAPABILITY))
        have = f"compute capability {'.'.join(map(str, capability))}" if capability else device.type
        raise ServerArgsError(
            "skinny_matmul_launch",
            f"{launch} needs a CUDA GPU of compute capability {need} or newer, not {have}; "
            "or choose --skinny-matmul-launch plain",
        )
    return launch


def kv_slots(
    args: ServerArgs,
    device: torch.device,
    configs: dict[Phase, PhaseConfig],
    rank_config: ModelConfig,
) -> int:
    """KV slots (the dummy slot included): `--max-total-tokens`, a fixed count on the CPU, or
    what fits in `--mem-fraction-static` of the GPU beside the graph pool's budget."""
    if args.max_total_tokens:
        return args.max_total_tokens + 1
    if device.type != "cuda":
        return CPU_DEFAULT_KV_SLOTS + 1
    free, total = torch.cuda.mem_get_info(device)
    graphs = any(c.backend is not Backend.DISABLED for c in configs.values())
    graph_fraction = args.cuda_graph_mem_fraction if graphs else 0.0
    budget = total * (args.mem_fraction_static - graph_fraction)
    budget -= total - free
    # Every rank sizes its own cache; all must agree on the slots the scheduler plans with.
    slots = min_over_ranks(int(budget // kv_bytes_per_token(rank_config)))
    if slots < 2:
        raise RuntimeError(
            "no GPU memory left for the KV cache: raise --mem-fraction-static "
            "or set --max-total-tokens"
        )
    return slots


# The ServerArgs fields that cannot reach a compiled graph, each with why. Every other field
# is in the compile cache key as it was given, so a new flag is in the key (a miss at worst,
# never a stale graph) until it is shown here not to shape one.
_RESOLVED = "resolved below, as the graph sees it"
_SCHEDULER = "the scheduler only: it forms the batches, whose shapes the graph is general over"
_SERVER = "the HTTP server and the log only"
_BUCKETS = (
    "a bucket pads a batch for the general graph; the token range the buckets imply reaches "
    "the trace, and is in every artifact's name"
)
NOT_IN_COMPILE_KEY: dict[str, str] = {
    "model_path": "where the files are: the model config (below), its code and its weights, "
    "which are graph inputs, are what the graph sees",
    "tokenizer_path": "the tokenizer process only",
    "served_model_name": _SERVER,
    "load_format": "the weights' values, which are graph inputs",
    "seed": "the weights' values (graph inputs) and sampling, outside the graph",
    "dtype": _RESOLVED,
    "device": _RESOLVED,
    "attention_backend": _RESOLVED,
    "custom_ops": _RESOLVED,
    "cuda_graph_backend_decode": _RESOLVED,
    "cuda_graph_backend_prefill": _RESOLVED,
    "cuda_graph_tc_compiler": _RESOLVED,
    "cuda_graph_config": _RESOLVED,
    "disable_cuda_graph": _RESOLVED,
    "cuda_graph_bs_decode": _BUCKETS,
    "cuda_graph_bs_prefill": _BUCKETS,
    "cuda_graph_max_bs_decode": _BUCKETS,
    "cuda_graph_max_bs_prefill": _BUCKETS,
    "cuda_graph_capture": "when buckets are captured, not what a piece computes",
    "cuda_graph_mem_fraction": "the memory budget only",
    "max_total_tokens": "the KV pools' size, which only the attention op reads: a split op, run "
    "eagerly between the compiled pieces",
    "mem_fraction_static": "the KV pools' size (as --max-total-tokens)",
    "chunked_prefill_size": _SCHEDULER,
    "enable_prefix_caching": _SCHEDULER,
    "disable_overlap_schedule": _SCHEDULER,
    "overlap_depth": _SCHEDULER,
    "stream_interval": _SCHEDULER,
    "busy_poll_ms": "how the scheduler and the runner wait for messages, not what runs",
    "enable_mixed_chunk": _SCHEDULER,
    "compile_cache_dir": "where the cache is",
    "skip_warmup": "whether a warm-up runs before ready, not what it runs",
    "compile_threads": "how many threads compile the warm-up's kernels, not what they compile",
    "host": _SERVER,
    "port": _SERVER,
    "api_key": _SERVER,
    "max_request_bytes": _SERVER,
    "incremental_streaming_output": _SERVER,
    "log_level": _SERVER,
    "tokenizer_worker_num": _SERVER,
}


def attention_backend_name(args: ServerArgs, device_type: str) -> str:
    """`--attention-backend`, or the device's default."""
    return args.attention_backend or ("triton" if device_type == "cuda" else "torch_native")


def compile_cache_factors(
    args: ServerArgs,
    config: ModelConfig,
    model_file: Path,
    device: torch.device,
    attention_backend: str,
    configs: dict[Phase, PhaseConfig],
    custom_ops: dict[str, OpImpl],
    tp: TPRank,
    inductor: str | None,
    kernels: dict[str, str] | None = None,
) -> CacheFactors:
    """The compile cache factors of this setup (`inductor`: what of Inductor's output is
    cached, `compiler_factor`). The config factor is derived from what the
    graph is built from, whole: the model config (every field: the context length sizes the
    rotary tables the pieces close over, the dtype every tensor), every option but those
    `NOT_IN_COMPILE_KEY` says cannot reach a graph, and what this process resolved them to."""
    return collect_factors(
        {
            "model": {k: v for k, v in asdict(config).items() if k != "path"},
            "options": {
                f.name: getattr(args, f.name)
                for f in fields(args)
                if f.name not in NOT_IN_COMPILE_KEY
            },
            "device": str(device),
            "attention_backend": attention_backend,
            "graphs": {p.value: [c.backend.value, c.tc_compiler] for p, c in configs.items()},
            "custom_ops": custom_ops_info(custom_ops),
            # Which products the skinny kernel runs, with which tiles (an opaque op's choice).
            "skinny_matmul_table": skinny_table_fingerprint(device),
            # Each rank traces and compiles its own shard's graph.
            "tp": [tp.size, tp.rank],
        },
        device,
        model_file,
        inductor=inductor,
        kernels=kernels,
    )


def inductor_output(args: ServerArgs, configs: dict[Phase, PhaseConfig]) -> str | None:
    """What of Inductor's output this setup caches: "inductor" (its Python output: torch.compile
    or an `inductor` phase), "aot_inductor" (only AOTInductor's packages), or None."""
    compilers = {c.tc_compiler for c in configs.values()} & set(INDUCTOR_COMPILERS)
    if args.enable_torch_compile or "inductor" in compilers:
        return "inductor"
    return "aot_inductor" if compilers else None


def open_compile_cache(
    root: CacheRoot,
    args: ServerArgs,
    config: ModelConfig,
    model: nn.Module,
    device: torch.device,
    attention_backend: str,
    attention_kernels: dict[str, str],
    configs: dict[Phase, PhaseConfig],
    custom_ops: dict[str, OpImpl],
    tp: TPRank,
) -> CompileCache | None:
    """The compile cache entry of this setup (pieces, capture manifest), when any phase
    compiles or captures; its key covers everything that changes the graph, and the versions
    of the attention backend's kernel packages (`attention_kernels`)."""
    if all(c.backend is Backend.DISABLED and c.tc_compiler is None for c in configs.values()):
        return None
    factors = compile_cache_factors(
        args,
        config,
        Path(inspect.getfile(type(model))),
        device,
        attention_backend,
        configs,
        custom_ops,
        tp,
        inductor=inductor_output(args, configs),
        kernels=attention_kernels,
    )
    return CompileCache(root, factors)
