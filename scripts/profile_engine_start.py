"""A start of the in-process engine, timed, optionally under cProfile: where a start's
seconds go (the runner's imports, its warm-up, Dynamo's and Inductor's loads).

    python scripts/profile_engine_start.py MODEL_DIR CACHE_DIR (PROFILE_OUT | -) [FIELD=VALUE...]

FIELD=VALUE are `Engine` keyword arguments (e.g. cuda_graph_backend_decode=full); weights are
drawn at random (`load_format=dummy`), bf16. Run it twice on one CACHE_DIR for a warm start.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time


def main() -> None:
    model, cache, profile_out, *fields = sys.argv[1:]
    kwargs = dict(model_path=model, load_format="dummy", compile_cache_dir=cache, dtype="bfloat16")
    kwargs.update(field.split("=", 1) for field in fields)
    profiler = cProfile.Profile() if profile_out != "-" else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    from srt.engine import Engine  # inside the profile: its imports are part of a start

    engine = Engine(**kwargs)
    if profiler is not None:
        profiler.disable()
    total = time.perf_counter() - start
    info = engine.runner.info()
    print(
        f"engine ready in {total:.2f} s (startup_s {engine.startup_s:.2f}); warmup "
        f"{info.warmup_s} load {info.load_s} device_init {info.device_init_s}"
    )
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("cumulative").print_stats("/srt/", 45)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)
        with open(profile_out, "w") as f:
            f.write(out.getvalue())
    engine.shutdown()


if __name__ == "__main__":  # the compile workers are spawned: they import this module
    main()
