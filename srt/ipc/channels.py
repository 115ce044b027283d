"""ZeroMQ PUSH/PULL between the server's processes, over ipc:// endpoints in a private directory.

Each direction is a `Channel` that carries one message class (messages.py): its PULL socket is
bound by the process that reads it (`Receiver`), its PUSH sockets connect (`Sender`), and a
receiver refuses anything that is not of its direction. A message is one pickled object (the
messages' dataclasses, whose token ids travel as numpy arrays). Pickle protocol 5 sends larger
arrays out of band, as frames of their own: their bytes are neither copied into the pickle nor
out of it.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq

from srt.ipc.messages import FromRunner, ToRunner, ToScheduler, ToTokenizer

M = TypeVar("M")


@dataclass(frozen=True)
class Endpoints:
    """The server's private ipc directory, where every channel's socket lives."""

    dir: str

    @classmethod
    def create(cls) -> Endpoints:
        path = tempfile.mkdtemp(prefix="srt-ipc-")
        os.chmod(path, 0o700)  # mkdtemp already does; the sockets must stay private
        return cls(path)

    def address(self, channel: Channel[Any]) -> str:
        return f"ipc://{os.path.join(self.dir, channel.name)}"

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass(frozen=True)
class Channel(Generic[M]):
    """One direction of the server's traffic and the message class it carries."""

    name: str
    kind: type[M]

    def check(self, msg: object) -> M:
        if not isinstance(msg, self.kind):
            raise TypeError(
                f"the {self.name} channel carries {self.kind.__name__} messages, "
                f"got {type(msg).__name__}"
            )
        return msg


TO_SCHEDULER = Channel("scheduler", ToScheduler)  # requests, aborts, flush and info requests
TO_RUNNER = Channel("runner", ToRunner)  # batch plans, info requests
FROM_RUNNER = Channel("runner-results", FromRunner)  # batch results, runner info


def to_tokenizer(worker: int) -> Channel[ToTokenizer]:
    """Step outputs and replies to tokenizer worker `worker` (0: the main process; more with
    --tokenizer-worker-num), each of which reads its own."""
    return Channel(f"tokenizer-{worker}", ToTokenizer)


def _socket(ctx: zmq.Context[Any], kind: int) -> Any:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never block shutdown on undelivered messages
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # no silent drops
    return sock


class Receiver(Generic[M]):
    """The reading end of a channel: binds its PULL socket."""

    def __init__(self, ctx: zmq.Context[Any], endpoints: Endpoints, channel: Channel[M]) -> None:
        self.channel = channel
        self.socket = _socket(ctx, zmq.PULL)
        self.socket.bind(endpoints.address(channel))

    def recv(self, flags: int = 0) -> M:
        """The next message; with `zmq.NOBLOCK`, raises `zmq.Again` when none is waiting."""
        return self.channel.check(loads(self.socket.recv_multipart(flags)))

    async def recv_all_async(self) -> list[M]:
        """Every message waiting, once there is at least one: for an asyncio loop, on a sync
        context's socket. zmq.asyncio costs a future and several callbacks per message; here
        the loop watches the socket's descriptor and one wake drains what arrived meanwhile
        (the descriptor is edge-triggered: it signals again only once the queue was emptied)."""
        while True:
            messages = []
            while True:
                try:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                messages.append(self.channel.check(loads(frames)))
            if messages:
                return messages
            await self._readable()

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.socket.getsockopt(zmq.FD)

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(fd, wake)
        try:
            # An edge that came before the reader was added is not signalled again: ask.
            if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await readable
        finally:
            loop.remove_reader(fd)

    def poll(self, timeout_ms: int | None = 0, busy_s: float = 0.0) -> bool:
        """Whether a message is waiting, within `timeout_ms` (None: until one is): polled
        without sleeping for up to `busy_s` seconds first (`--busy-poll-ms`: a process woken
        from sleep runs tens to hundreds of microseconds after its message), then asleep."""
        if busy_s > 0:
            start = time.perf_counter()
            while (spent := time.perf_counter() - start) < busy_s:
                if self.socket.poll(0):
                    return True
                if timeout_ms is not None and spent * 1000 >= timeout_ms:
                    return False
            if timeout_ms is not None:
                timeout_ms = max(0, timeout_ms - int(spent * 1000))
        return bool(self.socket.poll(timeout_ms))

    def close(self) -> None:
        self.socket.close()


class Sender(Generic[M]):
    """A writing end of a channel: connects a PUSH socket."""

    def __init__(self, ctx: zmq.Context[Any], endpoints: Endpoints, channel: Channel[M]) -> None:
        self.channel = channel
        self.socket = _socket(ctx, zmq.PUSH)
        self.socket.connect(endpoints.address(channel))

    def send(self, msg: M) -> None:
        self.socket.send_multipart(dumps(self.channel.check(msg)), copy=False)

    def close(self) -> None:
        self.socket.close()


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
