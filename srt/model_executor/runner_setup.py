"""The model runner's setup steps that decide something: the device, the layer kernels, how
many KV slots fit, and the compile cache entry of this setup."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.compilation.cache import CompileCache
from srt.compilation.cache_key import collect_factors
from srt.distributed import min_over_ranks
from srt.layers.custom_op import apply_custom_ops, custom_ops_info, describe_custom_ops
from srt.model_config import ModelConfig
from srt.model_executor.graphs.config import Backend, Phase, PhaseConfig
from srt.model_executor.kv_cache import kv_bytes_per_token
from srt.op_selection import OpImpl, asks_for_kernels, kernels_missing, resolve_custom_ops
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
    model: nn.Module, args: ServerArgs, device: torch.device
) -> dict[str, OpImpl]:
    """Resolve `--custom-ops` for this device and give every layer its selection (before any
    trace: it shapes the graph)."""
    missing = kernels_missing(device.type)
    impls = resolve_custom_ops(args.custom_ops, missing)
    if missing is not None and asks_for_kernels(args.custom_ops):
        logger.warning("--custom-ops asks for kernels, but %s: the reference runs", missing)
    apply_custom_ops(model, impls)
    logger.info("custom ops: %s", "; ".join(describe_custom_ops(impls)))
    return impls


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


def open_compile_cache(
    root: Path,
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
    compiles or captures; its key covers every option that changes the graph, and the
    versions of the attention backend's kernel packages (`attention_kernels`)."""
    if all(c.backend is Backend.DISABLED and c.tc_compiler is None for c in configs.values()):
        return None
    factors = collect_factors(
        {
            "model": config.hf_config,
            "dtype": str(config.dtype),
            "attention_backend": attention_backend,
            # Not the bucket ladders: artifacts are general over the token range (which
            # their names carry), so a new ladder reuses them.
            "graphs": {p.value: [c.backend.value, c.tc_compiler] for p, c in configs.items()},
            "max_running_requests": args.max_running_requests,
            "enable_torch_compile": args.enable_torch_compile,
            "torch_compile_max_bs": args.torch_compile_max_bs,
            "keep_shape_guards": args.keep_shape_guards,
            "custom_ops": custom_ops_info(custom_ops),
            # Each rank traces and compiles its own shard's graph.
            "tp": [tp.size, tp.rank],
        },
        device,
        Path(inspect.getfile(type(model))),
        inductor=args.enable_torch_compile
        or any(c.tc_compiler == "inductor" for c in configs.values()),
        kernels=attention_kernels,
    )
    return CompileCache(root, factors)
