"""cudaGraphLaunch's host time on this GPU: back to back, and after the device idled (the host
spinning or asleep), for a graph of N small kernels; a plain kernel launch after idling too.

    python scripts/probe_graph_launch.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main(n: int) -> None:
    x = torch.zeros(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up before the capture, on a side stream
        for _ in range(n):
            x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    cases: list[tuple[str, str | None, float]] = [
        ("back to back (device busy)", None, 0),
        ("after sync, no idle", "spin", 0),
        ("idle 1 ms spin", "spin", 1),
        ("idle 5 ms spin", "spin", 5),
        ("idle 5 ms sleep", "sleep", 5),
        ("idle 20 ms sleep", "sleep", 20),
        ("idle 100 ms sleep", "sleep", 100),
    ]
    for label, idle, ms in cases:
        times = []
        for _ in range(30):
            if idle is not None:
                torch.cuda.synchronize()
                spin(ms) if idle == "spin" else time.sleep(ms / 1e3)
            start = time.perf_counter()
            graph.replay()
            times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        print(
            f"graph of {n} kernels, {label:28s}: launch host ms p50 "
            f"{statistics.median(times):.3f} max {max(times):.3f} min {min(times):.3f}"
        )
    for label, ms in (("kernel launch after 5 ms sleep", 5), ("kernel launch after sync", 0)):
        times = []
        for _ in range(30):
            torch.cuda.synchronize()
            time.sleep(ms / 1e3)
            start = time.perf_counter()
            x.add_(1)
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{label:40s}: host ms p50 {statistics.median(times):.3f} max {max(times):.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
