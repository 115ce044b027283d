"""Where a runner launch's host time goes, from a trace of the server's runner
(`srt.bench.serving --profile-steps N --profile-dir DIR`): for the longest launches and the
median one, the top-level host ops and CUDA runtime calls inside its annotation, what no op
covers (Python), the gap before it, and its graph's kernels (how many, which, and when the
first started and the last ended after the launch call began).

    python scripts/launch_breakdown.py DIR/srt-runner-....trace.json.gz
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import statistics
import sys
from collections import defaultdict
from typing import Any

ANNOTATION = "srt_runner_launch"
HOST = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def main(path: str) -> None:
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = sorted(
        (e for e in events if e.get("name") == ANNOTATION and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    host = sorted(
        (e for e in events if e.get("cat") in HOST and e.get("name") != ANNOTATION),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in host]
    kernels: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            kernels[e.get("args", {}).get("correlation")].append(e)
    gap_before = {id(b): b["ts"] - a["ts"] - a["dur"] for a, b in itertools.pairwise(launches)}
    durations = [launch["dur"] for launch in launches]
    deciles = statistics.quantiles(durations, n=10)
    print(
        f"{len(launches)} launches; ms p10 / p50 / p90 / max: "
        f"{deciles[0] / 1e3:.3f} / {deciles[4] / 1e3:.3f} / {deciles[8] / 1e3:.3f} / "
        f"{max(durations) / 1e3:.3f}"
    )
    longest = sorted(launches, key=lambda e: -e["dur"])[:6]
    median = sorted(launches, key=lambda e: e["dur"])[len(launches) // 2]
    for label, launch in [("longest", e) for e in longest] + [("median", median)]:
        end = launch["ts"] + launch["dur"]
        inside = [e for e in host[bisect.bisect_left(starts, launch["ts"]) :] if e["ts"] < end]
        top, covered_to = [], launch["ts"]
        for e in inside:  # top level: not inside the one before
            if e["ts"] >= covered_to:
                top.append(e)
                covered_to = e["ts"] + e["dur"]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in top:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e["dur"]
        covered = sum(e["dur"] for e in top)
        graph = [e for e in inside if e["name"] == "cudaGraphLaunch"]
        ks = kernels.get(graph[0].get("args", {}).get("correlation"), []) if graph else []
        timing = ""
        if ks:
            first = (min(k["ts"] for k in ks) - graph[0]["ts"]) / 1e3
            last = (max(k["ts"] + k["dur"] for k in ks) - graph[0]["ts"]) / 1e3
            timing = f", first starts {first:.3f} ms and last ends {last:.3f} ms after the call"
        gap = gap_before.get(id(launch))
        print(
            f"\n{label} launch: {launch['dur'] / 1e3:.3f} ms, gap before "
            f"{'-' if gap is None else f'{gap / 1e3:.3f}'} ms, ops cover {covered / 1e3:.3f}, "
            f"Python between {(launch['dur'] - covered) / 1e3:.3f}; graph kernels {len(ks)}"
            f"{timing}; {sorted({k['name'][:40] for k in ks})[:4]}"
        )
        for name, (n, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]:
            print(f"   {d / 1e3:7.3f} ms  x{int(n):<3d} {name[:90]}")


if __name__ == "__main__":
    main(sys.argv[1])
