"""Start the server: this process (HTTP, tokenizer, detokenizer) and two children, the scheduler
and the model runner, connected by ZeroMQ in a private temporary directory.

    python -m srt.launch_server [--model-path DIR] [flags]

Flags are checked, and the port bound, before anything heavy is imported or started: a bad flag
or a port in use fails at once, with argparse's kind of message naming the flag.

`/health` answers 503 until both children have reported ready. A child that dies takes the
server down with a non-zero exit; SIGINT and SIGTERM shut everything down cleanly (open streams
end with an error event and `[DONE]`). Either way no child outlives the launcher and the ipc
directory is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from srt.server_args import ServerArgs, ServerArgsError

if TYPE_CHECKING:  # imported when the server starts, once its flags are known to be good
    import uvicorn

    from srt.managers.ipc import Endpoints
    from srt.managers.tokenizer_manager import TokenizerManager
    from srt.model_config import ModelConfig

logger = logging.getLogger("srt.launch_server")

_SUPERVISE_S = 0.2  # how often children are checked
_GRACEFUL_SHUTDOWN_S = 3  # open HTTP requests get this long to finish on shutdown
_CHILD_STOP_S = 5  # SIGTERM, then SIGKILL after this long
_SHUTDOWN_REASON = "the server is shutting down"


class BackendFailed(RuntimeError):
    pass


class Child:
    """A spawned child process and the pipe on which it reports ready (or its error)."""

    def __init__(
        self, name: str, target: Callable[..., None], args: ServerArgs, endpoints: Endpoints
    ) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.reader, writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=target, args=(args, endpoints, writer), name=f"srt-{name}"
        )
        self.process.start()
        writer.close()  # the child holds the only writer: EOF means it is gone
        self.figures: dict[str, Any] | None = None

    def check(self, start: float) -> None:
        """Take its ready report if one came; raise BackendFailed if it failed or died.

        `start` is the launch time, from which its readiness is timed (its own `setup_s`
        counts from when its imports were done)."""
        if self.figures is None and self.reader.poll():
            try:
                report = self.reader.recv()
            except EOFError:  # died without a report; seen below once it is reaped
                report = {}
            if "error" in report:
                raise BackendFailed(f"{self.name} failed to start: {report['error']}")
            if report:
                self.figures = {**report, "ready_after_s": round(time.perf_counter() - start, 3)}
        if not self.process.is_alive():
            raise BackendFailed(
                f"{self.name} process (pid {self.process.pid}) died "
                f"with exit code {self.process.exitcode}"
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
    def __init__(self, args: ServerArgs) -> None:
        from srt.managers.ipc import Endpoints

        self.args = args
        self.started = time.perf_counter()
        self.endpoints = Endpoints.create()
        self.children: dict[str, Child] = {}
        self.manager: TokenizerManager | None = None
        self.server: uvicorn.Server | None = None
        self.stopping = False

    def on_signal(self, signum: int, _: FrameType | None) -> None:
        if not self.stopping:
            logger.info("received %s; shutting down", signal.Signals(signum).name)
        self.stopping = True
        if self.server is not None:
            self.server.should_exit = True

    def run(self, model_config: ModelConfig, sock: socket.socket) -> int:
        """Serve on `sock` until a signal (exit code 0) or a child failure (1)."""
        import uvicorn
        import uvloop

        from srt.entrypoints.http_server import create_app
        from srt.managers.scheduler_process import run_scheduler_process
        from srt.managers.tokenizer_manager import TokenizerManager
        from srt.model_executor.runner_process import run_runner_process

        for name, target in [
            ("model_runner", run_runner_process),
            ("scheduler", run_scheduler_process),
        ]:
            self.children[name] = Child(name, target, self.args, self.endpoints)
        # Loads the tokenizer while the children load the model.
        self.manager = TokenizerManager(self.args, self.endpoints, model_config)
        config = uvicorn.Config(
            create_app(self.manager),
            host=self.args.host,
            port=self.args.port,
            loop="none",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        )
        self.server = uvicorn.Server(config)
        self.server.should_exit = self.stopping
        return uvloop.run(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> int:
        assert self.server is not None and self.manager is not None
        outputs = asyncio.create_task(self.manager.handle_outputs())
        supervisor = asyncio.create_task(self._supervise(outputs))
        await self.server.serve(sockets=[sock])
        self.server.should_exit = True
        code = await supervisor
        outputs.cancel()
        return code

    async def _supervise(self, outputs: asyncio.Task[None]) -> int:
        """Mark the server ready once every child is; stop it when a child (or the task that
        routes their outputs) fails."""
        assert self.server is not None and self.manager is not None
        while not self.server.should_exit:
            try:
                for child in self.children.values():
                    child.check(self.started)
                if outputs.done():
                    raise BackendFailed(f"routing outputs failed: {outputs.exception()!r}")
            except BackendFailed as e:
                if self.stopping:  # a signal reached the children too; we are leaving anyway
                    return 0
                logger.error("%s; shutting down", e)
                self.manager.fail(str(e))
                self.server.should_exit = True
                return 1
            if not self.manager.ready and all(c.figures for c in self.children.values()):
                self._mark_ready()
            await asyncio.sleep(_SUPERVISE_S)
        # A signal: requests in flight end now, with an error (a final event and [DONE] for a
        # stream), rather than being cut off when the graceful shutdown runs out.
        ended = self.manager.fail(_SHUTDOWN_REASON)
        if ended:
            logger.info("shutting down: ended %d sequence(s) in flight", ended)
        return 0

    def _mark_ready(self) -> None:
        from srt.managers.metrics import graph_figures

        assert self.manager is not None
        runner = self.children["model_runner"].figures
        scheduler = self.children["scheduler"].figures
        assert runner is not None and scheduler is not None
        info = runner["info"]
        graphs = graph_figures(info)
        backends = ", ".join(
            f"{phase} {g['backend']}" for phase, g in (info.get("graphs") or {}).items()
        )
        logger.info(
            "model_runner ready after %.2f s (pid %d; setup %.2f s: load %.2f s, compile %.2f s, "
            "capture %.2f s); %s %s, %s attention, graphs: %s; %d KV slots, context length %d",
            runner["ready_after_s"],
            runner["pid"],
            runner["setup_s"],
            info["load_s"],
            graphs["compile_s"],
            graphs["capture_s"],
            info["device"],
            info["dtype"],
            info["attention_backend"],
            backends or "none",
            info["kv_slots"],
            info["context_length"],
        )
        logger.info(
            "scheduler ready after %.2f s (pid %d; setup %.2f s)",
            scheduler["ready_after_s"],
            scheduler["pid"],
            scheduler["setup_s"],
        )
        startup_s = round(time.perf_counter() - self.started, 3)
        self.manager.mark_ready(
            info["context_length"],
            info["kv_slots"],
            {
                "startup_s": startup_s,
                "ready_at": time.time(),
                "ipc_dir": self.endpoints.dir,
                "processes": {
                    "tokenizer": {"pid": os.getpid()},
                    "scheduler": _without_info(scheduler),
                    "model_runner": {**_without_info(runner), "load_s": info["load_s"], **graphs},
                },
            },
        )
        logger.info(
            "server ready in %.2f s: serving %s at http://%s:%d",
            startup_s,
            self.manager.model_name,
            self.args.host,
            self.args.port,
        )

    def cleanup(self) -> None:
        if self.manager is not None:
            self.manager.close()
        for child in self.children.values():
            child.stop()
        for child in self.children.values():
            child.join()
        self.endpoints.remove()


def _without_info(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if k != "info"}


def bind(args: ServerArgs) -> socket.socket:
    """The listening socket, bound before anything starts: a port in use fails at once."""
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((args.host, args.port), family=family)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno and e.errno > 0 else e.strerror or str(e)
        raise ServerArgsError("port", f"cannot listen on {args.host}:{args.port}: {reason}") from e


def launch_server(args: ServerArgs, sock: socket.socket) -> int:
    """Run the server in this process, on the bound `sock`, until it stops; returns the exit
    code."""
    from srt.managers.tokenizer import check_tokenizer_files
    from srt.model_config import (
        ModelConfig,
        ModelLoadError,
        resolve_model_path,
        warn_past_positions,
    )
    from srt.process import configure_logging

    configure_logging(args.log_level, "tokenizer")
    try:
        args.model_path = resolve_model_path(args.model_path)
        model_config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
        warn_past_positions(model_config, args.context_length)
        check_tokenizer_files(args.tokenizer_path or args.model_path)
    except ModelLoadError as e:
        logger.error("%s", e)
        return 1
    launcher = Launcher(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, launcher.on_signal)
    try:
        code = launcher.run(model_config, sock)
    except ModelLoadError as e:  # the tokenizer, loaded while the children start
        logger.error("%s", e)
        code = 1
    finally:
        launcher.cleanup()
        sock.close()
    logger.info("server stopped%s", "" if code == 0 else f" (exit code {code})")
    return code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.launch_server",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    try:
        args.check()
        sock = bind(args)
    except ServerArgsError as e:
        parser.error(str(e))
    sys.exit(launch_server(args, sock))


if __name__ == "__main__":
    main()
