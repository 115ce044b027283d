"""A start of the in-process engine, timed, optionally under cProfile: where a start's
seconds go (the runner's imports, its warm-up, Dynamo's and Inductor's loads).

    python scripts/profile_engine_start.py MODEL_DIR CACHE_DIR (PROFILE_OUT | -) [FIELD=VALUE...]
        [--within METHOD]

FIELD=VALUE are `Engine` keyword arguments (e.g. cuda_graph_backend_decode=full, a Python
literal where the value is one: inductor_graph_partition=True); weights are
drawn at random (`load_format=dummy`), bf16. Run it twice on one CACHE_DIR for a warm start;
on an empty CACHE_DIR the runner compiles its warm-up's kernels ahead, in worker processes as
in the server. `--within METHOD` profiles only the calls of that `ModelRunner` method (e.g.
`_hand_out_compiles`, the compile-ahead block's forwards) instead of the whole start: a
profile of the whole start merges what a function calls across all its callers.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import functools
import io
import pstats
import time
from typing import Any


def _value(text: str) -> Any:
    """A field's value: a Python literal (True, 8, 0.5) where it is one, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def profile_within(profiler: cProfile.Profile, method: str) -> list[float]:
    """Make `ModelRunner.<method>` run under `profiler`, and nothing else; returns the list
    that each of its calls adds its seconds to (empty: this start did not call it)."""
    from srt.model_executor.model_runner import ModelRunner

    original = getattr(ModelRunner, method)

    calls: list[float] = []

    @functools.wraps(original)
    def profiled(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        profiler.enable()
        try:
            return original(*args, **kwargs)
        finally:
            profiler.disable()
            calls.append(time.perf_counter() - start)

    setattr(ModelRunner, method, profiled)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("cache")
    parser.add_argument("profile_out", help="where the profile's text goes; - for no profile")
    parser.add_argument("fields", nargs="*", help="Engine keyword arguments, FIELD=VALUE")
    parser.add_argument("--within", metavar="METHOD", help="profile only this ModelRunner method")
    ns = parser.parse_intermixed_args()  # fields may follow --within
    kwargs = dict(
        model_path=ns.model, load_format="dummy", compile_cache_dir=ns.cache, dtype="bfloat16"
    )
    for field in ns.fields:
        name, value = field.split("=", 1)
        kwargs[name] = _value(value)
    profiler = cProfile.Profile() if ns.profile_out != "-" else None
    start = time.perf_counter()
    calls: list[float] | None = None
    if profiler is not None and ns.within:
        calls = profile_within(profiler, ns.within)
    elif profiler is not None:
        profiler.enable()
    from srt.engine import Engine  # inside the profile: its imports are part of a start

    engine = Engine(**kwargs)
    if profiler is not None and not ns.within:
        profiler.disable()
    total = time.perf_counter() - start
    info = engine.runner.info()
    print(
        f"engine ready in {total:.2f} s (startup_s {engine.startup_s:.2f}); warmup "
        f"{info.warmup_s} load {info.load_s} device_init {info.device_init_s}; "
        f"compile ahead {info.compile_ahead}"
    )
    if calls == []:
        print(f"ModelRunner.{ns.within} was not called on this start: nothing profiled")
    elif profiler is not None:
        out = io.StringIO()
        if calls is not None:  # its own wall time, under the profiler's overhead
            out.write(f"ModelRunner.{ns.within}: {len(calls)} call(s), {sum(calls):.3f} s\n")
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("cumulative").print_stats("/srt/", 45)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)
        with open(ns.profile_out, "w") as f:
            f.write(out.getvalue())
    engine.shutdown()


if __name__ == "__main__":  # the compile workers are spawned: they import this module
    main()
