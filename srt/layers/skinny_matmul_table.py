"""Where the skinny matmul kernel runs in place of cuBLAS: the table its tuning wrote.

`srt.bench.skinny_matmul --tune` times, on one GPU, each product a model's decode step makes
(its weight's shape, plain or with the SiLU-and-mul fused) at each batch bucket of 1 to 16
rows, for the kernel's candidate tiles against cuBLAS (`F.linear`, and the SiLU-and-mul kernel
after it for the gated form), each over a chain of distinct weights larger than L2 in one CUDA
graph, as a step reads them. It writes one JSON file per GPU model under `tuned/`; the kernel
runs only where its entry says it was faster, with the tile it was faster with. A GPU without
a file, a shape or dtype the file lacks: cuBLAS. So a table never changes what is computed,
only which kernel computes it (the two agree to the last bits of a sum's order).

Torch-free: the file is read by name, and the choice is made from plain values.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
BUCKETS = (1, 2, 4, 8, 16)  # rows are tuned at these counts; a count uses the next one up
MAX_ROWS = BUCKETS[-1]


@dataclass(frozen=True)
class SkinnyConfig:
    """A launch of the kernel: its tile and the compiler's options."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def as_list(self) -> list[int]:
        return [self.block_n, self.block_k, self.num_warps, self.num_stages]


def table_path(device_name: str) -> Path:
    """`tuned/skinny_matmul-NVIDIA_H200.json` for `NVIDIA H200`."""
    return TUNED_DIR / f"skinny_matmul-{re.sub(r'[^A-Za-z0-9]+', '_', device_name)}.json"


def shape_key(dtype: str, n: int, k: int, gated: bool) -> str:
    """The table's key of a product: `bfloat16 16384x2048 gated` (n counts the weight's rows,
    gate and up both)."""
    return f"{dtype} {n}x{k}{' gated' if gated else ''}"


def bucket(rows: int) -> int | None:
    """The tuned row count that covers `rows`, or None above the largest."""
    return next((b for b in BUCKETS if rows <= b), None)


@functools.cache
def load_table(device_name: str) -> dict[str, Any]:
    """The tuning of `device_name` ({} where there is none). A table that does not parse is an
    error, not a silent fallback: it is part of the installed package."""
    path = table_path(device_name)
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text())
        return dict(table["shapes"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a skinny matmul table ({e})") from e


def table_fingerprint(device_name: str) -> str | None:
    """A hash of the device's table (None without one), for the compile cache key."""
    path = table_path(device_name)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


@functools.cache
def choose(
    device_name: str, dtype: str, n: int, k: int, rows: int, gated: bool
) -> SkinnyConfig | None:
    """The kernel's tile for this product at `rows` rows, or None where cuBLAS runs it."""
    b = bucket(rows)
    if b is None:
        return None
    entry = load_table(device_name).get(shape_key(dtype, n, k, gated), {}).get(str(b))
    if not entry or entry.get("choice") != "triton":
        return None
    return SkinnyConfig(*entry["config"])
