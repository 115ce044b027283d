"""The skinny matmul kernel against cuBLAS on a model shape's decode products, and its tuning.

    python -m srt.bench.skinny_matmul --model-shape llama-3.2-1b llama-3-8b --tune \\
        --output skinny.json

For each product a decode step makes (QKV, output, gate/up with the SiLU-and-mul fused, down,
the LM head) and each row bucket (1, 2, 4, 8, 16), every candidate tile of the kernel and
cuBLAS (`F.linear`; for the gated product `F.linear` then the SiLU-and-mul kernel, the path the
fusion replaces) run over a chain of distinct weights of that shape, at least 256 MiB of them
(more than any L2), captured in one CUDA graph, as a step reads them: the time per product is
the graph's replay over the chain's length (median of `--repeats`). Each candidate's output
is compared with cuBLAS's first (`max_diff`). Every candidate is compiled before any is timed,
in `--compile-workers` processes (they share Triton's cache; the timing process then loads).

`--tune` writes the winners into the device's table (`srt/layers/tuned/`, see
`srt/layers/skinny_matmul_table.py`): the kernel where its best tile beat cuBLAS by more than
`--margin`, cuBLAS elsewhere; the tables of other shapes already in the file are kept. The
per-shape table and, per model and bucket, the products' sum over a step (layers x product +
LM head) for cuBLAS and for the choice are printed last; `--output` writes them as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from srt.bench.report import format_table, machine, write_json
from srt.layers.skinny_matmul_table import (
    BUCKETS,
    SkinnyConfig,
    shape_key,
    table_path,
)
from srt.tools.model_shapes import MODEL_SHAPES

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
CHAIN_BYTES = 256 * 2**20
# One row: dot products on the CUDA cores, few columns a program; more rows: the tensor cores.
# K blocks up to 4,096 columns: a program's loads in flight are one block's, and at one row the
# 1B shape's products took 2.5-3.5 us more than their bytes at the LM head's 3.1 TB/s with
# blocks of at most 1,024 (r30, H100); a block as wide as K has all of them in flight at once.
CANDIDATES = {
    "one": [
        SkinnyConfig(n, k, w, s)
        for n in (4, 8, 16)
        for k in (512, 1024, 2048, 4096)
        for w in (4, 8)
        for s in (2, 4)
    ],
    "many": [
        SkinnyConfig(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256, 512) for s in (3, 5)
    ],
}


@dataclass(frozen=True)
class Product:
    name: str
    n: int  # weight rows (gate and up both, gated)
    k: int
    gated: bool
    per_step: int  # how many a step makes (the layers; 1 for the LM head)


def products(shape: str) -> list[Product]:
    c = MODEL_SHAPES[shape]
    hidden, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c["num_key_value_heads"] * head_dim
    inter = c["intermediate_size"]
    return [
        Product("qkv", heads * head_dim + 2 * kv, hidden, False, layers),
        Product("o", hidden, heads * head_dim, False, layers),
        Product("gate_up+silu", 2 * inter, hidden, True, layers),
        Product("down", hidden, inter, False, layers),
        Product("lm_head", c["vocab_size"], hidden, False, 1),
    ]


def family(rows: int) -> str:
    return "one" if rows == 1 else "many"


def candidates(rows: int, k: int) -> list[SkinnyConfig]:
    """The tiles tried for a product of `rows` rows over K = `k`: none whose K block is wider
    than K (a masked half of a tile is no faster)."""
    return [c for c in CANDIDATES[family(rows)] if c.block_k <= k]


def kernel_call(config: SkinnyConfig, gated: bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], w.shape[0] // 2 if gated else w.shape[0]))
        skinny_matmul_into(out, x, w, None, config, gated)
        return out

    return call


def cublas_call(gated: bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    from srt.layers.activation import silu_and_mul_kernel

    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, w)
        return silu_and_mul_kernel(y) if gated else y

    return call


Spec = tuple[int, bool, int, str, tuple[int, ...]]  # K, gated, rows, dtype, tile


def compile_one(spec: Spec) -> str | None:
    """Compile (by launching once, on small inputs) one kernel variant; why it cannot run
    (a tile too large for the SM's memory), or None. The binary lands in Triton's cache."""
    k, gated, rows, dtype, tile = spec
    dev = torch.device("cuda")
    x = torch.zeros(rows, k, dtype=DTYPES[dtype], device=dev)
    w = torch.zeros(128 if gated else 64, k, dtype=DTYPES[dtype], device=dev)
    try:
        kernel_call(SkinnyConfig(*tile), gated)(x, w)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (a candidate that cannot run is left out, named)
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def compile_all(specs: list[Spec], workers: int) -> tuple[float, dict[Spec, str]]:
    """Compile every variant (in `workers` processes first); seconds, and the failures."""
    start = datetime.datetime.now()
    if workers > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            list(pool.map(compile_one, specs))
    # Load each in this process, from the cache the workers filled.
    failed = {spec: why for spec in specs if (why := compile_one(spec)) is not None}
    return (datetime.datetime.now() - start).total_seconds(), failed


def chain_ms(
    call: Callable[[torch.Tensor, torch.Tensor], Any],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    repeats: int,
    replays: int = 10,
) -> float:
    """ms per product: one CUDA graph of `call` over every weight, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # cuBLAS picks its kernels and workspace before capture
            call(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(x, w)
    graph.replay()
    return replay_ms(graph, repeats, replays) / len(weights)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int, replays: int) -> float:
    """ms per replay of `graph`: the median of `repeats` timings of `replays` back to back."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def bench_product(
    product: Product, dtype: str, repeats: int, margin: float, failed: dict[Spec, str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The table entry of one product (per bucket) and its rows for the report."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    nbytes = product.n * product.k * 2
    count = max(2, -(-CHAIN_BYTES // nbytes))
    weights = [
        torch.randn(product.n, product.k, generator=gen, dtype=DTYPES[dtype], device=dev).mul_(
            product.k**-0.5
        )
        for _ in range(count)
    ]
    entry: dict[str, Any] = {}
    rows_out = []
    for rows in BUCKETS:
        x = torch.randn(rows, product.k, generator=gen, dtype=DTYPES[dtype], device=dev)
        want = cublas_call(product.gated)(x, weights[0]).float()
        cublas = chain_ms(cublas_call(product.gated), x, weights, repeats)
        timed = []
        for config in candidates(rows, product.k):
            spec = (product.k, product.gated, min(rows, 2), dtype, tuple(config.as_list()))
            if spec in failed:
                continue
            call = kernel_call(config, product.gated)
            diff = (call(x, weights[0]).float() - want).abs().max().item()
            timed.append((chain_ms(call, x, weights, repeats), config, diff))
        best_ms, best, diff = min(timed, key=lambda t: t[0])
        wins = best_ms < cublas * (1 - margin)
        entry[str(rows)] = {
            "choice": "triton" if wins else "cublas",
            "config": best.as_list(),
            "triton_us": round(best_ms * 1000, 2),
            "cublas_us": round(cublas * 1000, 2),
            "max_diff": diff,
        }
        rows_out.append(
            {
                "product": product.name,
                "n": product.n,
                "k": product.k,
                "rows": rows,
                "cublas_us": round(cublas * 1000, 2),
                "triton_us": round(best_ms * 1000, 2),
                "speedup": round(cublas / best_ms, 3),
                "tile": "x".join(map(str, best.as_list())),
                "choice": entry[str(rows)]["choice"],
                "max_diff": round(diff, 5),
                "gb_per_s": round(nbytes / (min(best_ms, cublas) * 1e-3) / 1e9, 1),
            }
        )
    del weights
    torch.cuda.empty_cache()
    return entry, rows_out


def step_sums(shape: str, entries: dict[str, dict[str, Any]], dtype: str) -> list[dict[str, Any]]:
    """Per bucket: the step's products summed, by cuBLAS and by the table's choice (ms)."""
    out = []
    for rows in BUCKETS:
        cublas = chosen = 0.0
        for p in products(shape):
            e = entries[shape_key(dtype, p.n, p.k, p.gated)][str(rows)]
            cublas += p.per_step * e["cublas_us"] / 1000
            pick = e["triton_us"] if e["choice"] == "triton" else e["cublas_us"]
            chosen += p.per_step * pick / 1000
        out.append(
            {
                "shape": shape,
                "rows": rows,
                "cublas_ms": round(cublas, 3),
                "chosen_ms": round(chosen, 3),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", nargs="+", default=["llama-3.2-1b"], choices=MODEL_SHAPES)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--margin", type=float, default=0.02, help="Least gain to pick the kernel.")
    parser.add_argument("--compile-workers", type=int, default=8)
    parser.add_argument("--tune", action="store_true", help="Write the device's table.")
    parser.add_argument("--output", help="Write the rows and the machine here as JSON.")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    all_products = [p for shape in ns.model_shape for p in products(shape)]
    specs = sorted(
        {
            (p.k, p.gated, r, ns.dtype, tuple(c.as_list()))
            for p in all_products
            for r in (1, 2)
            for c in candidates(r, p.k)
        }
    )
    compile_s, failed = compile_all(specs, ns.compile_workers)
    print(f"compiled {len(specs)} kernel variants in {compile_s:.1f} s", flush=True)
    for spec, why in failed.items():
        print(f"left out {spec}: {why}")
    entries: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for p in all_products:
        key = shape_key(ns.dtype, p.n, p.k, p.gated)
        if key not in entries:
            entries[key], product_rows = bench_product(p, ns.dtype, ns.repeats, ns.margin, failed)
            rows += product_rows
            print(f"timed {key}", flush=True)
    sums = [s for shape in ns.model_shape for s in step_sums(shape, entries, ns.dtype)]
    device_name = torch.cuda.get_device_name()
    if ns.tune:
        path = table_path(device_name)
        old = json.loads(path.read_text())["shapes"] if path.is_file() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        table = {
            "device": device_name,
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "date": datetime.date.today().isoformat(),
            "command": "python -m srt.bench.skinny_matmul --tune "
            f"--model-shape {' '.join(ns.model_shape)} --dtype {ns.dtype} --margin {ns.margin}",
            "shapes": dict(sorted({**old, **entries}.items())),
        }
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path}")
    if ns.output:
        write_json(
            ns.output,
            {
                "machine": machine(),
                "compile_s": compile_s,
                "left_out": [[*spec[:4], list(spec[4]), why] for spec, why in failed.items()],
                "rows": rows,
                "step_sums": sums,
            },
        )
    columns = [
        (t, t) for t in ("product", "n", "k", "rows", "cublas_us", "triton_us", "speedup", "tile")
    ] + [("choice", "choice"), ("GB/s", "gb_per_s"), ("max_diff", "max_diff")]
    print(format_table(rows, columns))
    print(
        format_table(
            sums,
            [
                ("shape", "shape"),
                ("rows", "rows"),
                ("cublas ms", "cublas_ms"),
                ("chosen ms", "chosen_ms"),
            ],
        )
    )


if __name__ == "__main__":
    main()
