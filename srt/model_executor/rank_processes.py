"""All ranks of a model runner from one process (the Engine, the benchmarks): rank 0 here, the
others spawned as child processes tied to this one (they die with it)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

from srt.distributed import destroy_tp
from srt.model_config import ModelConfig
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.runner_entry import start_compile_workers
from srt.process import ChildEntry, ReadyPipe
from srt.server_args import ServerArgs
from srt.tp_rank import TPRank, tp_ranks

logger = logging.getLogger(__name__)

_FOLLOWER_STOP_S = 10


class FollowerProcesses:
    """Ranks 1..N-1, each in a child process. Their ready reports are not read (the pipes are
    kept open for them): rank 0 meets them in the group's collectives, which fail if one died."""

    def __init__(self, args: ServerArgs, ranks: list[TPRank]) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[tuple[mp.process.BaseProcess, Connection]] = []
        for tp in ranks:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=ChildEntry("srt.model_executor.runner_process", "run_follower_process"),
                args=(args, tp, ReadyPipe(writer, time.time())),
                name=f"srt-model_runner_rank{tp.rank}",
            )
            proc.start()
            writer.close()
            self.procs.append((proc, reader))

    def stop(self) -> None:
        """Wait for them (told to stop by rank 0's `close()`, or left without their group when
        rank 0 failed to start); kill any that does not stop."""
        for proc, reader in self.procs:
            proc.join(_FOLLOWER_STOP_S)
            if proc.is_alive():
                logger.warning("%s did not stop; killing it", proc.name)
                proc.kill()
                proc.join()
            reader.close()
        self.procs = []


def start_ranks(args: ServerArgs, config: ModelConfig) -> tuple[ModelRunner, FollowerProcesses]:
    """Rank 0's runner, in this process, and the other ranks (none with --tp-size 1). On a
    first start its warm-up's kernels compile in worker processes started first (the runner
    stops them after its warm-up)."""
    ranks = tp_ranks(args.tp_size)
    workers = start_compile_workers(args)
    followers = FollowerProcesses(args, ranks[1:])
    try:
        return ModelRunner(args, config, ranks[0], workers), followers
    except BaseException:
        if workers is not None:
            workers.shutdown()
        destroy_tp()  # if rank 0 got as far as joining the group
        followers.stop()
        raise


def stop_ranks(runner: ModelRunner, followers: FollowerProcesses) -> None:
    runner.close()
    followers.stop()


@contextmanager
def running_ranks(args: ServerArgs, config: ModelConfig) -> Iterator[ModelRunner]:
    """`start_ranks`, stopped on leaving."""
    runner, followers = start_ranks(args, config)
    try:
        yield runner
    finally:
        stop_ranks(runner, followers)
