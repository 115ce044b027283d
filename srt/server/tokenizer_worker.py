"""A tokenizer worker beyond the main process (--tokenizer-worker-num N starts N-1 of them):
the main process's front end again (the HTTP app, a tokenizer, detokenization, the streams)
in a process of its own, on the same port, sending its requests to the scheduler and reading
its own requests' outputs back.

Its life, as the launcher runs it: spawned beside the scheduler and the model runner, it loads
its tokenizer and reports ready; it waits for the launcher's `ServeFrom` (the limits the
runner set and the startup record, once every process is ready) and only then binds the
port, so that no connection reaches it before it can serve; it serves until the launcher
sends `StopServing` (a process died, or the server is shutting down: its open streams end
with that reason, as the main process's do) or SIGTERM comes. It dies with the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from srt.ipc.channels import Endpoints
from srt.ipc.reports import ServerStartup
from srt.process import ReadyPipe, run_child
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_ORDER_POLL_S = 0.05  # how often a serving worker looks for the launcher's orders
_STARTING_POLL_S = 0.01  # and while it waits to serve, so that it starts at once


@dataclass(frozen=True)
class ServeFrom:
    """launcher -> worker: every process is ready; serve within these limits."""

    context_length: int
    kv_capacity: int
    startup: ServerStartup


@dataclass(frozen=True)
class StopServing:
    """launcher -> worker: end the open requests with `reason` and exit."""

    reason: str


SHUTDOWN_REASON = "the server is shutting down"


class TokenizerWorker:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, worker: int, orders: Connection):
        from srt.model_config import ModelConfig
        from srt.server.tokenizer_manager import TokenizerManager

        assert args.model_path is not None, "the launcher resolves model_path"
        config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
        self.manager = TokenizerManager(args, endpoints, config, worker)
        self.manager.load_tokenizer()
        self.orders = orders

    def runner_info(self) -> None:
        return None

    def run(self) -> None:
        import uvloop

        try:
            code = uvloop.run(self._serve())
        finally:
            self.manager.close()
        sys.exit(code)

    def _order(self) -> ServeFrom | StopServing | None:
        """The launcher's order, if one came (a launcher gone is a stop)."""
        if not self.orders.poll():
            return None
        try:
            order: ServeFrom | StopServing = self.orders.recv()
        except EOFError:
            return StopServing("the launcher is gone")
        return order

    async def _serve(self) -> int:
        from srt.server.http.uvicorn_server import http_server
        from srt.server.listening import bind

        manager = self.manager
        outputs = asyncio.create_task(manager.handle_outputs())
        order = self._order()
        while order is None:
            await asyncio.sleep(_STARTING_POLL_S)
            order = self._order()
        if isinstance(order, StopServing):
            outputs.cancel()
            return 0
        manager.mark_ready(order.context_length, order.kv_capacity, order.startup)
        server = http_server(manager, main_process=False)
        serving = asyncio.create_task(server.serve(sockets=[bind(manager.args)]))
        reason, code = SHUTDOWN_REASON, 0
        while not server.should_exit and not serving.done():
            order = self._order()
            if isinstance(order, StopServing):
                reason = order.reason
                break
            if outputs.done():
                logger.error("routing outputs failed: %r", outputs.exception())
                reason, code = "this tokenizer worker failed", 1
                break
            await asyncio.sleep(_ORDER_POLL_S)
        # Open streams end now with the reason (a final event and [DONE]), rather than being
        # cut off when the graceful shutdown runs out.
        manager.fail(reason)
        server.should_exit = True
        await serving
        outputs.cancel()
        return code


def run_tokenizer_worker(
    args: ServerArgs, endpoints: Endpoints, worker: int, orders: Connection, ready: ReadyPipe
) -> None:
    run_child(
        f"tokenizer{worker}",
        args.log_level,
        ready,
        lambda: TokenizerWorker(args, endpoints, worker, orders),
    )
