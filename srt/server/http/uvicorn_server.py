"""The HTTP server around the app: uvicorn on the running (uv)loop, on a socket bound before."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from srt.server.http.app import create_app
from srt.server.tokenizer_manager import TokenizerManager

GRACEFUL_SHUTDOWN_S = 3  # open HTTP requests get this long to finish on shutdown


class _WorkerServer(uvicorn.Server):
    """A tokenizer worker's server: Ctrl-C reaches the whole process group, and the launcher
    alone decides what it means (it stops the workers); SIGTERM still stops this one."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


def http_server(manager: TokenizerManager, main_process: bool = True) -> uvicorn.Server:
    """The server of `manager`'s app; `main_process` False for the other tokenizer workers."""
    # uvicorn's own INFO lines (started, waiting for startup...) would read as the server's;
    # srt logs its lifecycle itself, so only uvicorn's warnings come through.
    level = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    config = uvicorn.Config(
        create_app(manager),
        host=manager.args.host,
        port=manager.args.port,
        loop="none",
        log_config=None,
        log_level=level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return (uvicorn.Server if main_process else _WorkerServer)(config)
