"""Start the server: this process (HTTP, tokenizer, detokenizer) and two children, the scheduler
and the model runner, connected by ZeroMQ in a private temporary directory. With --tp-size N
the model runner is N processes, one per rank: the scheduler talks to rank 0, which passes
each plan on to the others over their process group.

    python -m srt.launch_server [--model-path DIR] [flags]

Flags are checked, and the port bound, before anything heavy is imported or started: a bad flag
or a port in use fails at once, with argparse's kind of message naming the flag. Then, in this
order: the first log line; the model directory checked (its config and tokenizer files, no
torch); the two children spawned; and only then this process's own heavy imports (the web
stack, transformers for the tokenizer), so that the three processes start in parallel.

HTTP is served as soon as the app exists: `/health` (and every other endpoint) answers 503
while the tokenizer loads and until both children have reported ready. The ready lines and
`/get_server_info` (`processes`) break each process's start down into its parts.

A child that dies takes the server down with a non-zero exit; SIGINT and SIGTERM shut
everything down cleanly (open streams end with an error event and `[DONE]`). Either way no
child outlives the launcher and the ipc directory is removed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time

from srt.server.listening import bind
from srt.server_args import ServerArgs, ServerArgsError

logger = logging.getLogger("srt.launch_server")


def launch_server(args: ServerArgs, sock: socket.socket, launched: float) -> int:
    """Run the server in this process, on the bound `sock`, until it stops; returns the exit
    code. `launched` is the perf_counter() at which the launch began."""
    from srt.model_config import ModelConfig, ModelLoadError, warn_past_positions
    from srt.process import configure_logging
    from srt.server.hf_tokenizer import check_tokenizer_files
    from srt.tools.make_tiny_model import resolve_model_path

    configure_logging(args.log_level, "tokenizer")
    logger.info(
        "starting: model %s, port %d", args.model_path or "(the built-in tiny model)", args.port
    )
    try:
        args.model_path = resolve_model_path(args.model_path)
        model_config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
        warn_past_positions(model_config, args.context_length)
        args.check_model(model_config)
        check_tokenizer_files(args.tokenizer_path or args.model_path)
    except (ModelLoadError, ServerArgsError) as e:
        logger.error("%s", e)
        return 1
    from srt.server.launcher import Launcher

    launcher = Launcher(args, model_config, launched)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, launcher.on_signal)
    try:
        launcher.spawn_children()
        code = launcher.run(sock)
    finally:
        launcher.cleanup()
        sock.close()
    logger.info("server stopped%s", "" if code == 0 else f" (exit code {code})")
    return code


def main(argv: list[str] | None = None) -> None:
    launched = time.perf_counter()
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
    sys.exit(launch_server(args, sock, launched))


if __name__ == "__main__":
    main()
