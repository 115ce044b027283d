"""The `srt` command, installed with the package: `srt serve [flags]` starts the server
(`python -m srt.launch_server [flags]`), `srt bench NAME [flags]` runs a benchmark
(`python -m srt.bench.NAME [flags]`), `srt tool NAME [flags]` a tool. Each subcommand is the
module's own `main`, its flags and `--help` unchanged; nothing is imported until one is
chosen, so `srt --help` answers at once."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

BENCHES = ("serving", "frontend", "one_batch", "hf_baseline", "cold_start", "attention")
TOOLS = ("make_tiny_model", "make_random_checkpoint", "compile_bisect")

USAGE = f"""usage: srt serve [server flags]      start the server (srt serve --help for the flags)
       srt bench NAME [flags]       a benchmark: {", ".join(BENCHES)}
       srt tool NAME [flags]        a tool: {", ".join(TOOLS)}"""


def _module_main(package: str, name: str, choices: tuple[str, ...]) -> Callable[..., object]:
    if name not in choices:
        sys.exit(f"srt: unknown {package.rsplit('.', 1)[-1]} {name!r}; choose one of {choices}")
    main: Callable[..., object] = importlib.import_module(f"{package}.{name}").main
    return main


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    command, rest = args[0], args[1:]
    if command == "serve":
        from srt.launch_server import main as serve

        serve(rest)
        return
    if command in ("bench", "tool") and rest:
        package = "srt.bench" if command == "bench" else "srt.tools"
        run = _module_main(package, rest[0], BENCHES if command == "bench" else TOOLS)
        code = run(rest[1:])
        sys.exit(code if isinstance(code, int) else 0)
    print(USAGE, file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
