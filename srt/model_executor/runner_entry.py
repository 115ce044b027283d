"""The model runner process's first step, before it imports torch: on a first start on CUDA,
the processes that compile the warm-up's Triton kernels (`srt.compilation.triton_workers`)
start here, so that their imports (torch's 3-4 s each) overlap the runner's own imports, its
weight load and its graphs; then the runner itself (`runner_process`, which imports torch).

Only what is light is imported here: the compile cache root's resolution and Triton (no
torch; Triton reads where its disk cache is, to see whether it is empty).
"""

from __future__ import annotations

import os
from pathlib import Path

from srt.compilation.cache_root import default_cache_root, open_cache_root, point_tool_caches
from srt.compilation.triton_workers import MAX_WORKERS, CompileWorkers, disk_cache_entries
from srt.ipc.channels import Endpoints
from srt.process import ReadyPipe, die_with_parent
from srt.server_args import ServerArgs, usable_cpus
from srt.tp_rank import TPRank

# The packages whose modules hold srt's Triton kernels: each worker imports them before it is
# asked for one (the kernel's module is where a worker finds it by name).
KERNEL_PACKAGES = ("srt.layers.triton_ops", "srt.layers.attention.triton_ops")


def _on_cuda(args: ServerArgs) -> bool:
    """Whether the runner will run on CUDA, told without importing torch: `auto` resolves to
    CUDA where a driver's device node exists (a wrong guess costs only the workers' imports:
    the runner stops them when it does not compile ahead)."""
    if args.device == "auto":
        return os.path.exists("/dev/nvidiactl")
    return args.device.startswith("cuda")


def start_compile_workers(args: ServerArgs) -> CompileWorkers | None:
    """The workers for this start's compile ahead, or None where it will not run: off CUDA,
    with `--compile-threads 0`, `--skip-warmup`, FlashInfer's attention (it compiles nothing
    ahead), or a Triton disk cache that holds kernels (a warm start)."""
    if (
        args.compile_threads == 0
        or args.skip_warmup
        or args.attention_backend == "flashinfer"
        or not _on_cuda(args)
    ):
        return None
    # Where the runner's Triton cache is (it resolves the same root again: resolved once).
    point_tool_caches(open_cache_root(Path(args.compile_cache_dir or default_cache_root())))
    if disk_cache_entries():
        return None
    processes = min(args.compile_threads or usable_cpus(), MAX_WORKERS)
    return CompileWorkers(processes, KERNEL_PACKAGES, first=die_with_parent)


def run_runner_process(
    args: ServerArgs, endpoints: Endpoints, tp: TPRank, ready: ReadyPipe
) -> None:
    """Rank 0 of the model runner, in the server."""
    workers = start_compile_workers(args)
    from srt.model_executor import runner_process  # torch, after the workers started

    runner_process.run_runner_process(args, endpoints, tp, ready, workers)
