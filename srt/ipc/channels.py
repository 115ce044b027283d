"""ZeroMQ PUSH/PULL between the server's processes, over ipc:// endpoints in a private directory.

Each PULL socket is bound by the process that reads it, each PUSH socket connects; a message is
one pickled object (the io_struct dataclasses, whose token ids travel as numpy arrays). Pickle
protocol 5 sends larger arrays out of band, as frames of their own: their bytes are neither
copied into the pickle nor out of it.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

# A sync context makes sync sockets, a zmq.asyncio one asyncio sockets (recv returns a Future).
SocketT = TypeVar("SocketT", bound=zmq.Socket)


@dataclass(frozen=True)
class Endpoints:
    dir: str

    @classmethod
    def create(cls) -> Endpoints:
        path = tempfile.mkdtemp(prefix="srt-ipc-")
        os.chmod(path, 0o700)  # mkdtemp already does; the sockets must stay private
        return cls(path)

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.dir, name)}"

    @property
    def scheduler_inbox(self) -> str:
        """tokenizer -> scheduler: requests, aborts, flush and info requests."""
        return self._ipc("scheduler")

    @property
    def runner_inbox(self) -> str:
        """scheduler -> runner: batch plans and info requests."""
        return self._ipc("runner")

    @property
    def runner_results(self) -> str:
        """runner -> scheduler: batch results and runner info."""
        return self._ipc("runner-results")

    @property
    def tokenizer_inbox(self) -> str:
        """scheduler -> tokenizer: token outputs and replies."""
        return self._ipc("tokenizer")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _socket(ctx: zmq.Context[SocketT], kind: int) -> SocketT:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never block shutdown on undelivered messages
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # no silent drops
    return sock


def bind_pull(ctx: zmq.Context[SocketT], endpoint: str) -> SocketT:
    sock = _socket(ctx, zmq.PULL)
    sock.bind(endpoint)
    return sock


def connect_push(ctx: zmq.Context[SocketT], endpoint: str) -> SocketT:
    sock = _socket(ctx, zmq.PUSH)
    sock.connect(endpoint)
    return sock


# Arrays smaller than this stay inside the pickle: a frame of its own costs more than the copy.
_OUT_OF_BAND_BYTES = 4096


def dumps(obj: Any) -> list[Any]:
    """`obj` as message frames: the pickle, then its out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []

    def in_band(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < _OUT_OF_BAND_BYTES:
            return True
        buffers.append(buf)
        return False

    return [pickle.dumps(obj, protocol=5, buffer_callback=in_band), *buffers]


def loads(frames: list[Any]) -> Any:
    """The object `dumps` made the frames of (arrays on out-of-band frames are read-only)."""
    return pickle.loads(frames[0], buffers=frames[1:])


def send(sock: zmq.Socket, obj: Any) -> None:
    sock.send_multipart(dumps(obj), copy=False)


def recv(sock: zmq.Socket, flags: int = 0) -> Any:
    """The next object; with `zmq.NOBLOCK`, raises `zmq.Again` when none is waiting."""
    return loads(sock.recv_multipart(flags))
