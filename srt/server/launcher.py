"""The main process's supervision of the server: spawn the scheduler and model runner children
(and the other tokenizer workers, with --tokenizer-worker-num), serve HTTP (503 until every
process is ready), assemble the ready lines and the startup breakdown from each process's
report, and take everything down when a child dies or a signal comes. `srt.launch_server` is
its command line.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import FrameType
from typing import TYPE_CHECKING, Any

from srt.ipc.channels import Endpoints
from srt.ipc.reports import ProcessStartup, ReadyReport, RunnerInfo, ServerStartup, StartFailure
from srt.process import ChildEntry, ReadyPipe
from srt.server.tokenizer_worker import SHUTDOWN_REASON, ServeFrom, StopServing
from srt.server_args import ServerArgs
from srt.tp_rank import tp_ranks

if TYPE_CHECKING:  # imported when the server starts, once its flags are known to be good
    import uvicorn

    from srt.model_config import ModelConfig
    from srt.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("srt.launch_server")


_SUPERVISE_S = 0.2  # how often children are checked


_STARTING_POLL_S = 0.01  # and while starting, so that readiness is noticed at once


_CHILD_STOP_S = 5  # SIGTERM, then SIGKILL after this long


class BackendFailed(RuntimeError):
    pass


RUNNER_MODULE = "srt.model_executor.runner_process"
# Rank 0's entry: it starts the warm-up's compile workers before importing the runner (torch).
RUNNER_ENTRY_MODULE = "srt.model_executor.runner_entry"


SCHEDULER_MODULE = "srt.scheduler.scheduler_process"


TOKENIZER_WORKER_MODULE = "srt.server.tokenizer_worker"


class Child:
    """A spawned child process and the pipe on which it reports ready (or its error)."""

    def __init__(
        self, name: str, target: Callable[..., None], call_args: tuple[Any, ...], launched: float
    ) -> None:
        """Spawn `target(*call_args, ready_pipe)`."""
        ctx = mp.get_context("spawn")
        self.name = name
        self.reader, writer = ctx.Pipe(duplex=False)
        self.spawned_after_s = round(time.perf_counter() - launched, 3)
        self.process = ctx.Process(
            target=target,
            args=(*call_args, ReadyPipe(writer, time.time())),
            name=f"srt-{name}",
        )
        self.process.start()
        writer.close()  # the child holds the only writer: EOF means it is gone
        self.report: ReadyReport | None = None
        self.ready_after_s = 0.0

    def check(self, start: float) -> None:
        """Take its ready report if one came; raise BackendFailed if it failed or died.

        `start` is the launch time, from which `ready_after_s` is timed (the child times its
        own parts from its spawn)."""
        if self.report is None and self.reader.poll():
            try:
                report = self.reader.recv()
            except EOFError:  # died without a report; seen below once it is reaped
                report = None
            if isinstance(report, StartFailure):
                raise BackendFailed(f"{self.name} failed to start: {report.error}")
            if isinstance(report, ReadyReport):
                self.report = report
                self.ready_after_s = round(time.perf_counter() - start, 3)
        if not self.process.is_alive():
            raise BackendFailed(
                f"{self.name} process (pid {self.process.pid}) died "
                f"with exit code {self.process.exitcode}"
            )

    def startup(self, parts: dict[str, float]) -> ProcessStartup:
        """Its `processes` entry: its total (spawn to ready report, as the child timed it)
        broken down into `parts` (the rest in `other_s`)."""
        report = self.report
        assert report is not None, "only once it reported ready"
        total_s = round(report.spawn_imports_s + report.setup_s, 3)
        return ProcessStartup(
            report.pid,
            total_s,
            with_other(total_s, {"spawn_imports_s": report.spawn_imports_s, **parts}),
            self.spawned_after_s,
            self.ready_after_s,
            report.spawn_imports_s,
            report.setup_s,
        )

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def join(self) -> None:
        self.process.join(_CHILD_STOP_S)
        if self.process.is_alive():
            logger.warning("%s did not stop on SIGTERM; killing it", self.name)
            self.process.kill()
            self.process.join()


class Launcher:
    def __init__(self, args: ServerArgs, model_config: ModelConfig, launched: float) -> None:
        self.args = args
        self.model_config = model_config
        self.launched = launched  # perf_counter() when main() began
        self.endpoints = Endpoints.create()
        self.children: dict[str, Child] = {}
        self.manager: TokenizerManager | None = None
        self.server: uvicorn.Server | None = None
        # The other tokenizer workers' order pipes (ServeFrom, StopServing), by child name.
        self.worker_orders: dict[str, Connection] = {}
        self.stopping = False
        # This process's own start, in order: each part's seconds (see `_mark`).
        self.parts: dict[str, float] = {}
        self._last_mark = launched

    def _mark(self, part: str) -> None:
        """`part` ends now: it took the time since the previous part ended."""
        now = time.perf_counter()
        self.parts[part] = round(now - self._last_mark, 3)
        self._last_mark = now

    def on_signal(self, signum: int, _: FrameType | None) -> None:
        if not self.stopping:
            logger.info("received %s; shutting down", signal.Signals(signum).name)
        self.stopping = True
        if self.server is not None:
            self.server.should_exit = True

    def spawn_children(self) -> None:
        args, endpoints = self.args, self.endpoints
        ranks = tp_ranks(args.tp_size)
        spawns: list[tuple[str, str, str, tuple[Any, ...]]] = [
            (
                "model_runner",
                RUNNER_ENTRY_MODULE,
                "run_runner_process",
                (args, endpoints, ranks[0]),
            ),
            *(
                (f"model_runner_rank{tp.rank}", RUNNER_MODULE, "run_follower_process", (args, tp))
                for tp in ranks[1:]
            ),
            ("scheduler", SCHEDULER_MODULE, "run_scheduler_process", (args, endpoints)),
        ]
        for name, module, function, call_args in spawns:
            target = ChildEntry(module, function)
            self.children[name] = Child(name, target, call_args, self.launched)
        workers = spawn_tokenizer_workers(args, endpoints, self.launched)
        for name, (child, orders) in workers.items():
            self.children[name] = child
            self.worker_orders[name] = orders
        self._mark("start_s")

    def run(self, sock: socket.socket) -> int:
        """Serve on `sock` until a signal (exit code 0) or a child failure (1)."""
        import uvloop

        from srt.server.http.uvicorn_server import http_server
        from srt.server.tokenizer_manager import TokenizerManager

        self._mark("imports_s")
        self.manager = TokenizerManager(self.args, self.endpoints, self.model_config)
        self.server = http_server(self.manager)
        self.server.should_exit = self.stopping
        self._mark("app_s")
        return uvloop.run(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> int:
        assert self.server is not None and self.manager is not None
        # The tokenizer loads on the manager's tokenizing thread while HTTP already answers.
        tokenizer = asyncio.get_running_loop().run_in_executor(
            self.manager.prepare_pool, self._load_tokenizer
        )
        outputs = asyncio.create_task(self.manager.handle_outputs())
        supervisor = asyncio.create_task(self._supervise(outputs, tokenizer))
        logger.info(
            "HTTP on http://%s:%d: 503 until ready (loading the tokenizer, children starting)",
            self.args.host,
            self.args.port,
        )
        await self.server.serve(sockets=[sock])
        self.server.should_exit = True
        code = await supervisor
        outputs.cancel()
        return code

    def _load_tokenizer(self) -> None:
        assert self.manager is not None
        self.manager.load_tokenizer()
        self._mark("tokenizer_s")

    async def _supervise(self, outputs: asyncio.Task[None], tokenizer: asyncio.Future[None]) -> int:
        """Mark the server ready once the tokenizer and every child are; stop it when a child
        (or the task that routes their outputs, or the tokenizer's load) fails."""
        assert self.server is not None and self.manager is not None
        while not self.server.should_exit:
            try:
                for child in self.children.values():
                    child.check(self.launched)
                if outputs.done():
                    raise BackendFailed(f"routing outputs failed: {outputs.exception()!r}")
                if tokenizer.done() and tokenizer.exception() is not None:
                    raise BackendFailed(str(tokenizer.exception()))
            except BackendFailed as e:
                if self.stopping:  # a signal reached the children too; we are leaving anyway
                    return 0
                logger.error("%s; shutting down", e)
                self.manager.fail(str(e))
                order_workers(self.worker_orders, StopServing(str(e)))
                self.server.should_exit = True
                return 1
            if (
                not self.manager.ready
                and tokenizer.done()
                and all(c.report for c in self.children.values())
            ):
                self._mark_ready()
            await asyncio.sleep(_SUPERVISE_S if self.manager.ready else _STARTING_POLL_S)
        # A signal: requests in flight end now, with an error (a final event and [DONE] for a
        # stream), rather than being cut off when the graceful shutdown runs out.
        ended = self.manager.fail(SHUTDOWN_REASON)
        order_workers(self.worker_orders, StopServing(SHUTDOWN_REASON))
        if ended:
            logger.info("shutting down: ended %d sequence(s) in flight", ended)
        return 0

    def _mark_ready(self) -> None:
        assert self.manager is not None
        runner = self.children["model_runner"]
        info = runner.report.runner if runner.report is not None else None
        assert info is not None, "the model runner reports its info"
        processes = {
            "scheduler": self.children["scheduler"].startup({}),
            "model_runner": runner.startup(runner_parts(info)),
            **{
                name: child.startup({})
                for name, child in self.children.items()
                if name.startswith("model_runner_rank")
            },
            **{
                name: self.children[name].startup({"tokenizer_s": self._setup_s(name)})
                for name in self.worker_orders
            },
        }
        backends = ", ".join(f"{phase} {g.backend}" for phase, g in info.graphs.items())
        logger.info(
            "model_runner ready after %.2f s (pid %d; %s); %s; tp %d, %s %s, %s attention, "
            "graphs: %s; %d KV slots, context length %d",
            runner.ready_after_s,
            processes["model_runner"].pid,
            parts_text(processes["model_runner"]),
            load_text(info),
            info.tp_size,
            info.device,
            info.dtype,
            info.attention_backend,
            backends or "none",
            info.kv_slots,
            info.context_length,
        )
        # Its "other" is mostly the wait for the runner's KV cache, which it plans against.
        scheduler = processes["scheduler"]
        logger.info(
            "scheduler ready after %.2f s (pid %d; %s)",
            scheduler.ready_after_s,
            scheduler.pid,
            parts_text(scheduler),
        )
        for name in self.worker_orders:
            logger.info(
                "%s ready after %.2f s (pid %d; %s)",
                name,
                processes[name].ready_after_s,
                processes[name].pid,
                parts_text(processes[name]),
            )
        startup_s = round(time.perf_counter() - self.launched, 3)
        tokenizer = ProcessStartup(os.getpid(), startup_s, with_other(startup_s, self.parts))
        startup = ServerStartup(
            startup_s, time.time(), self.endpoints.dir, {"tokenizer": tokenizer, **processes}
        )
        order_workers(self.worker_orders, ServeFrom(info.context_length, info.kv_slots, startup))
        self.manager.mark_ready(info.context_length, info.kv_slots, startup)
        logger.info(
            "server ready in %.2f s (this process: %s): serving %s at http://%s:%d",
            startup_s,
            parts_text(tokenizer),
            self.manager.model_name,
            self.args.host,
            self.args.port,
        )

    def _setup_s(self, name: str) -> float:
        report = self.children[name].report
        assert report is not None, "only once it reported ready"
        return report.setup_s

    def cleanup(self) -> None:
        if self.manager is not None:
            self.manager.close()
        for conn in self.worker_orders.values():
            conn.close()
        for child in self.children.values():
            child.stop()
        for child in self.children.values():
            child.join()
        self.endpoints.remove()


def spawn_tokenizer_workers(
    args: ServerArgs, endpoints: Endpoints, launched: float
) -> dict[str, tuple[Child, Connection]]:
    """The tokenizer workers beyond this process's (none unless --tokenizer-worker-num), each
    with the pipe of its orders, by name. Call before this process imports prometheus_client:
    with workers, it and they count in files the directory set here holds."""
    count = args.tokenizer_worker_num
    if count == 1:
        return {}
    assert "prometheus_client" not in sys.modules, "it reads PROMETHEUS_MULTIPROC_DIR on import"
    metrics_dir = os.path.join(endpoints.dir, "metrics")
    os.mkdir(metrics_dir, 0o700)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the workers inherit it
    ctx = mp.get_context("spawn")
    target = ChildEntry(TOKENIZER_WORKER_MODULE, "run_tokenizer_worker")
    workers = {}
    for worker in range(1, count):
        name = f"tokenizer{worker}"
        theirs, ours = ctx.Pipe(duplex=False)
        child = Child(name, target, (args, endpoints, worker, theirs), launched)
        theirs.close()  # the worker holds the reading end
        workers[name] = (child, ours)
    return workers


def order_workers(orders: dict[str, Connection], order: ServeFrom | StopServing) -> None:
    """Send `order` to every tokenizer worker of `orders` (their pipes, by name)."""
    for name, conn in orders.items():
        try:
            conn.send(order)
        except OSError:  # it is gone; its death is reported on its own
            logger.debug("%s did not take %s", name, type(order).__name__)


def runner_parts(info: RunnerInfo) -> dict[str, float]:
    """The model runner's own setup, part by part (after its spawn and imports)."""
    compiled = info.compile
    return {
        "device_init_s": info.device_init_s,  # the CUDA context and cuBLAS's handles
        "load_s": info.load_s,
        "custom_ops_s": info.custom_ops_s,  # the layer kernels' selection and import
        "kv_alloc_s": info.kv_alloc_s,
        "dynamo_s": compiled.dynamo_s,
        "graph_load_s": compiled.graph_load_s,  # the saved trace, on a warm start
        "inductor_s": compiled.compile_s,
        "flashinfer_jit_s": info.flashinfer_jit.s,  # its modules' builds, before ready
        # The warm-up's kernels compiled side by side, before it ran them.
        "compile_ahead_s": info.compile_ahead.s if info.compile_ahead is not None else 0.0,
        "warmup_s": info.warmup_s,
        "capture_s": info.capture_s,
    }


def load_text(info: RunnerInfo) -> str:
    """`weights 16.1 GB at 4.79 GB/s` (rank 0's share under tensor parallelism)."""
    if info.load_gb_s is None:
        return "weights random (none read)"
    return f"weights {info.load_bytes / 1e9:.3g} GB at {info.load_gb_s:.3g} GB/s"


def with_other(total_s: float, parts: dict[str, float]) -> dict[str, float]:
    """`parts` and `other_s`, the rest of `total_s`. Never below zero: a piece that Inductor
    compiles during its first capture counts in both."""
    named = {k: round(float(v), 3) for k, v in parts.items()}
    return {**named, "other_s": round(max(total_s - sum(named.values()), 0.0), 3)}


def parts_text(entry: ProcessStartup) -> str:
    """`total 2.31 s: spawn imports 1.80 s, load 0.04 s, ...` for a ready line."""
    parts = ", ".join(
        f"{name.removesuffix('_s').replace('_', ' ')} {seconds:.2f} s"
        for name, seconds in entry.breakdown.items()
    )
    return f"total {entry.total_s:.2f} s: {parts}"
