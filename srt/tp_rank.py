"""A tensor-parallel rank as the launcher hands it to a runner process (no torch here: the
launcher spawns the runners before it imports anything heavy)."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class TPRank:
    """What a runner process needs to join its group."""

    rank: int = 0
    size: int = 1
    init_method: str | None = None  # tcp://127.0.0.1:PORT; None with one rank

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tp_ranks(size: int) -> list[TPRank]:
    """The ranks of a group of `size`, meeting at a free local port."""
    init_method = f"tcp://127.0.0.1:{free_port()}" if size > 1 else None
    return [TPRank(rank, size, init_method) for rank in range(size)]
