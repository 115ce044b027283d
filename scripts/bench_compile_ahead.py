"""srt's Triton kernels compiled ahead on a pool (`srt.compilation.triton_ahead`), on N threads,
without a GPU: every kernel srt launches, through its wrapper, compiled for the H200 (sm_90)
into an empty disk cache, each run in a fresh process. What the pool's width buys on this
machine's CPUs, the part of an empty-cache start that the warm-up's compiles are.

    PYTHONPATH=<checkout> python3 scripts/bench_compile_ahead.py --threads 1 2 --runs 3 [--json]

Prints, per thread count: the specialisations compiled and the block's seconds (median, min,
max of the runs; the first compile's backend set-up and the wrappers' own work included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)  # the compiler's kernels, not the interpreter's
    check = "from tests.test_triton_ahead import check_every_srt_kernel_compiles_ahead as c"
    proc = subprocess.run(
        [sys.executable, "-c", f"{check}; c({threads})"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON lines.")
    ns = parser.parse_args()
    for threads in ns.threads:
        reports = [one_run(threads) for _ in range(ns.runs)]
        seconds = [r["seconds"] for r in reports]
        row = {
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
