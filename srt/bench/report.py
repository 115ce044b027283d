"""What every benchmark shares: latency summaries, the printed table, JSON out, the machine."""

from __future__ import annotations

import datetime
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def summary(values_ms: Sequence[float]) -> dict[str, float | int | None]:
    """mean, p50, p90, p99 (ms, 3 decimals) and the count; None for an empty list."""
    if not len(values_ms):
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values_ms, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "n": int(arr.size),
        "mean": round(float(arr.mean()), 3),
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
    }


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A right-aligned text table: one line per row, a column per (title, key)."""
    cells = [[title for title, _ in columns]]
    cells += [[cell(row.get(key)) for _, key in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where and when a result was measured (for the results files)."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def write_json(path: str | Path, data: Any) -> None:
    """Write atomically: a reader (or a run killed mid-write) sees the old file or the new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def append_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """The same table as `format_table`, as Markdown (for docs/benchmarks.md)."""
    lines = [
        "| " + " | ".join(title for title, _ in columns) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|",
    ]
    lines += ["| " + " | ".join(cell(row.get(key)) for _, key in columns) + " |" for row in rows]
    return "\n".join(lines)
