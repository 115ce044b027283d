"""srt's Triton kernels compiled ahead on a pool (`srt.compilation.triton_ahead`), on N threads
and M worker processes, without a GPU: every kernel srt launches, through its wrapper,
compiled for the H200 (sm_90) into an empty disk cache, each run in a fresh process. What the
pool's width buys on this machine's CPUs, the part of an empty-cache start that the warm-up's
compiles are.

    PYTHONPATH=<checkout> python3 scripts/bench_compile_ahead.py --threads 1 2 --runs 3 \
        [--processes 0 8] [--json]

Prints, per worker process count (0: the threads compile) and thread count: the
specialisations compiled and the block's seconds (median, min, max of the runs; the first
compile's backend set-up and the wrappers' own work included; with processes, from the moment
every worker has imported, as in a server's start).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests helpers
from tests.test_triton_compile import run_python  # noqa: E402


def one_run(threads: int, processes: int) -> dict:
    if processes:
        check = "check_the_workers_compile_and_the_threads_only_load as c"
        call = f"c({processes}, {threads}, ready_first=True)"
    else:
        check, call = "check_every_srt_kernel_compiles_ahead as c", f"c({threads})"
    code = f"from tests.test_triton_ahead import {check}; {call}"
    out = run_python(code, interpret=False, timeout=900)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--processes",
        type=int,
        nargs="+",
        default=[0],
        help="Worker processes that compile first (0: the threads alone); each with every "
        "thread count, the block timed once every worker has imported.",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON lines.")
    ns = parser.parse_args()
    for processes, threads in itertools.product(ns.processes, ns.threads):
        reports = [one_run(threads, processes) for _ in range(ns.runs)]
        seconds = [r["seconds"] for r in reports]
        row = {
            "processes": processes,
            "threads": threads,
            "kernels": reports[0]["kernels"],
            "failed": max(r["failed"] for r in reports),
            "median_s": round(statistics.median(seconds), 3),
            "min_s": round(min(seconds), 3),
            "max_s": round(max(seconds), 3),
            "cpus": len(os.sched_getaffinity(0)),
        }
        print(json.dumps(row) if ns.json else "  ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
