"""The server's listening socket, bound before anything starts: a port in use fails at once.

With several tokenizer workers each binds its own socket to the port with SO_REUSEPORT, and
the kernel spreads new connections over them evenly (a connection stays with the worker that
accepted it); a socket shared by all would hand most connections to whichever worker happens
to wake first.
"""

from __future__ import annotations

import os
import socket

from srt.errors import ServerArgsError
from srt.server_args import ServerArgs


def bind(args: ServerArgs) -> socket.socket:
    """A socket listening on --host and --port (shared with the other tokenizer workers')."""
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server(
            (args.host, args.port), family=family, reuse_port=args.tokenizer_worker_num > 1
        )
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno and e.errno > 0 else e.strerror or str(e)
        raise ServerArgsError("port", f"cannot listen on {args.host}:{args.port}: {reason}") from e
