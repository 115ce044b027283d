"""What a `torch.profiler` trace says about a run of steps: per step, the wall, device and host
milliseconds, the kernels, the top kernels, host ops and CUDA runtime calls. The benchmarks
profile the runner in-process (`srt.bench.one_batch --profile`); a server's runner profiles
itself on request (`/start_profile`, `srt.model_executor.runner_profiler`)."""

from __future__ import annotations

import collections
from typing import Any

import torch

# Device activity in a Kineto trace.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profiler_for(device: torch.device) -> Any:
    """A profiler of the host's ops, and of the device's kernels on CUDA."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def summarize_trace(trace: dict[str, Any], top: int, annotation: str) -> dict[str, Any]:
    """Per step (the trace's `annotation` events; it holds those steps only): wall ms, device
    busy ms and kernel count, host ms (wall less the time the host sat waiting for the
    device), the top kernels, the top host ops and CUDA runtime calls; and the device's span,
    from its first activity's start to its last's end (`device_span_ms`)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == annotation and e.get("cat") == "user_annotation"]
    n = max(len(steps), 1)
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    # The host waits in a synchronize call, or in the copy of a result to pageable memory,
    # which returns only once the copy (so everything queued before it) is done.
    to_host = {
        e.get("args", {}).get("correlation")
        for e in device
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
    }
    waits = [
        e
        for e in events
        if e.get("cat") == "cuda_runtime"
        and ("Synchronize" in e.get("name", "") or e.get("args", {}).get("correlation") in to_host)
    ]
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for e in device:
        per_kernel[e["name"]].append(e["dur"] / 1000)
    device_ms = sum(sum(d) for d in per_kernel.values())
    wall_ms = sum(e["dur"] for e in steps) / 1000
    wait_ms = sum(e["dur"] for e in waits) / 1000
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]

    def host_ranking(category: str) -> list[dict[str, Any]]:
        """The host side by name: torch ops (times include the ops they call) or CUDA runtime
        calls (launches, copies, synchronisations), ms and calls per step."""
        calls: dict[str, list[float]] = collections.defaultdict(list)
        for e in events:
            if e.get("cat") == category:
                calls[e["name"]].append(e["dur"] / 1000)
        return [
            {"name": name, "ms_per_step": round(sum(d) / n, 4), "calls_per_step": len(d) / n}
            for name, d in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:top]
        ]

    span_ms = (
        (max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)) / 1000
        if device
        else 0.0
    )
    return {
        "steps": len(steps),
        "device_span_ms": round(span_ms, 3),
        "wall_ms_per_step": round(wall_ms / n, 3),
        "gpu_ms_per_step": round(device_ms / n, 3),
        "kernels_per_step": round(sum(e.get("cat") == "kernel" for e in device) / n, 1),
        "host_ms_per_step": round((wall_ms - wait_ms) / n, 3),
        "wait_ms_per_step": round(wait_ms / n, 3),
        "top_kernels": [
            {
                "name": name,
                "ms_per_step": round(sum(d) / n, 4),
                "calls_per_step": len(d) / n,
                "share": round(sum(d) / device_ms, 3) if device_ms else None,
            }
            for name, d in ranked
        ],
        "top_host_ops": host_ranking("cpu_op"),
        "top_runtime_calls": host_ranking("cuda_runtime"),
    }
