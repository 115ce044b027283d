"""Sweep the Triton decode attention kernel's launch constants on the GPU, as a decode step
runs it: one CUDA graph of `--layers` back-to-back calls, each layer with its own KV cache (so
the keys stream from memory, not from L2), for decode batches and contexts of the sizes
serving meets. Prints, per model shape, the microseconds per layer of every configuration
and the configuration with the least geometric mean over the cases (relative to each case's
best), which is what `srt/layers/attention/triton_ops/decode_attention.py` should hold.

    python scripts/sweep_decode_attention.py --model-shape llama-3.2-1b llama-3-8b \\
        --output decode_sweep.json

`--write` sets the chosen configuration's constants in that module's source.

A configuration is the kernel's (LOAD_V_WITH_K, NUM_WARPS, NUM_STAGES) and the split policy
(TARGET_PROGRAMS, MIN_SPLIT_TOKENS, SPLIT_FULL_GPU); each is checked against PyTorch's
attention on its first layer (`max_diff`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from srt.bench.report import format_table, machine, write_json
from srt.layers.attention.triton_ops import decode_attention as da
from srt.tools.model_shapes import MODEL_SHAPES

KERNELS = [  # (LOAD_V_WITH_K, NUM_WARPS, NUM_STAGES)
    (True, 4, 3),
    (True, 4, 2),
    (False, 4, 3),
    (False, 4, 2),
    (True, 2, 2),
    (True, 8, 3),
    (True, 2, 3),
    (False, 2, 2),
]
POLICY_NAMES = ("TARGET_PROGRAMS", "MIN_SPLIT_TOKENS", "SPLIT_FULL_GPU")
POLICIES = [
    (1024, 256, 256),
    (512, 256, 256),
    (2048, 256, 256),
    (1024, 128, 256),
    (1024, 512, 256),
    (1024, 256, 128),
    (1024, 256, 512),
]

# The kernel's constants before the split policy: one program per KV head at batch 32 and up,
# splits of at least one block (and a second launch to merge them).
BEFORE, BEFORE_POLICY = (False, 4, 2), (256, 64, 256)


def setup(batch: int, context: int, heads: tuple[int, int, int], layers: int) -> dict[str, Any]:
    num_heads, num_kv_heads, head_dim = heads
    slots = batch * context
    caches = [
        (
            torch.randn(slots, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
            torch.randn(slots, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        )
        for _ in range(layers)
    ]
    # A request's pages are not contiguous in a serving cache.
    table = torch.randperm(slots, device="cuda", dtype=torch.int64).to(torch.int32)
    q = torch.randn(layers, batch, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    return {
        "caches": caches,
        "q": q,
        "out": torch.full_like(q, float("nan")),  # a row the kernel skips shows in max_diff
        "req_to_token": table.view(batch, context),
        "rows": torch.arange(batch, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        "arrivals": torch.zeros(batch * num_kv_heads, dtype=torch.int32, device="cuda"),
    }


def reference(world: dict[str, Any]) -> torch.Tensor:
    k_cache, v_cache = world["caches"][0]
    q = world["q"][0]
    idx = world["req_to_token"].long()
    k, v = k_cache[idx], v_cache[idx]  # [B, S, Hkv, D]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return o[:, :, 0, :]


def run_layers(world: dict[str, Any], part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    arrivals = world["arrivals"]
    for layer, (k_cache, v_cache) in enumerate(world["caches"]):
        da.decode_attention(
            world["q"][layer],
            k_cache,
            v_cache,
            world["out"][layer],
            world["req_to_token"],
            world["rows"],
            world["seq_lens"],
            part_out,
            part_lse,
            arrivals,
            world["q"].shape[-1] ** -0.5,
        )


def time_config(world: dict[str, Any], replays: int) -> tuple[float, float]:
    """(µs per layer, max diff against the reference on layer 0) of the module's constants."""
    batch, num_heads, head_dim = world["q"].shape[1:]
    splits = da.num_decode_splits(batch, world["caches"][0][0].shape[1])
    part_out = torch.empty(batch, num_heads, splits, head_dim, device="cuda")
    part_lse = torch.empty(batch, num_heads, splits, device="cuda")
    run_layers(world, part_out, part_lse)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    diff = (world["out"][0].float() - world["expected"].float()).abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers(world, part_out, part_lse)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays / len(world["caches"]), diff


CONFIG_KEYS = ("v_with_k", "warps", "stages", "target", "min_split", "full_gpu")
TUNED = ("LOAD_V_WITH_K", "NUM_WARPS", "NUM_STAGES", *POLICY_NAMES)  # the module's, as CONFIG_KEYS
Config = tuple[tuple[bool, int, int], tuple[int, int, int]]


def sweep(args: argparse.Namespace, configs: list[Config]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for shape in args.model_shape:
        cfg = MODEL_SHAPES[shape]
        heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
        for batch, context in itertools.product(args.batch, args.context):
            world = setup(batch, context, heads, args.layers)
            world["expected"] = reference(world)
            for kernel, policy in configs:
                da.LOAD_V_WITH_K, da.NUM_WARPS, da.NUM_STAGES = kernel
                da.TARGET_PROGRAMS, da.MIN_SPLIT_TOKENS, da.SPLIT_FULL_GPU = policy
                us, diff = time_config(world, args.replays)
                values = (*kernel, *policy)
                rows.append(
                    {"shape": shape, "batch": batch, "context": context}
                    | dict(zip(CONFIG_KEYS, values, strict=True))
                    | {"us_per_layer": round(us, 2), "max_diff": round(diff, 4)}
                )
            del world
            torch.cuda.empty_cache()
    return rows


def ranking(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Configurations by the geometric mean of their time over each case's best, best first."""
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["shape"], r["batch"], r["context"])
        best[key] = min(best.get(key, math.inf), r["us_per_layer"])
    logs: dict[tuple, list[float]] = {}
    for r in rows:
        ratio = r["us_per_layer"] / best[(r["shape"], r["batch"], r["context"])]
        logs.setdefault(tuple(r[k] for k in CONFIG_KEYS), []).append(math.log(ratio))
    ranked = sorted((math.exp(sum(v) / len(v)), k) for k, v in logs.items())
    return [
        dict(zip(CONFIG_KEYS, k, strict=True), geomean_vs_best=round(score, 3))
        for score, k in ranked
    ]


def write_constants(chosen: dict[str, Any]) -> None:
    """Set the module's tuned constants (the `NAME = value` lines) to `chosen`'s."""
    path = Path(da.__file__)
    source = path.read_text()
    for name, key in zip(TUNED, CONFIG_KEYS, strict=True):
        source, count = re.subn(rf"^{name} = .*$", f"{name} = {chosen[key]}", source, flags=re.M)
        if count != 1:
            raise SystemExit(f"{path}: no single line '{name} = ...' to set")
    path.write_text(source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", nargs="+", default=["llama-3.2-1b", "llama-3-8b"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[160, 1024, 4096])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument(
        "--kernels", type=int, nargs="+", default=None, help="indices into KERNELS (default: all)"
    )
    parser.add_argument(
        "--policies", type=int, nargs="+", default=None, help="indices into POLICIES (default: all)"
    )
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--output", default=None)
    parser.add_argument("--write", action="store_true", help="set the chosen constants")
    args = parser.parse_args()

    saved = {name: getattr(da, name) for name in TUNED}
    # The kernel's constants at the module's split policy, then the policies with the best.
    policy = tuple(getattr(da, name) for name in POLICY_NAMES)
    kernels = [KERNELS[i] for i in args.kernels] if args.kernels else KERNELS
    policies = [POLICIES[i] for i in args.policies] if args.policies else POLICIES
    kernel_rows = sweep(args, [(k, policy) for k in kernels])
    top = ranking(kernel_rows)[0]
    kernel = (top["v_with_k"], top["warps"], top["stages"])
    policy_rows = sweep(
        args, [(kernel, p) for p in policies if p != policy] + [(BEFORE, BEFORE_POLICY)]
    )
    rows = kernel_rows + policy_rows
    for name, value in saved.items():
        setattr(da, name, value)

    summary = ranking([r for r in rows if (r["v_with_k"], r["warps"], r["stages"]) == kernel])
    chosen = summary[0]
    shown = [
        r
        for r in rows
        if all(r[k] == chosen[k] for k in CONFIG_KEYS)
        or tuple(r[k] for k in CONFIG_KEYS) == (*BEFORE, *BEFORE_POLICY)
    ]
    if args.output:
        write_json(
            args.output,
            {
                "machine": machine(),
                "rows": rows,
                "kernels": ranking(kernel_rows),
                "policies": summary,
            },
        )
    print(format_table(ranking(kernel_rows), [(k, k) for k in (*CONFIG_KEYS, "geomean_vs_best")]))
    print()
    print(format_table(summary, [(k, k) for k in (*CONFIG_KEYS, "geomean_vs_best")]))
    print()
    columns = ("shape", "batch", "context", *CONFIG_KEYS, "us_per_layer", "max_diff")
    print(format_table(shown, [(k, k) for k in columns]))
    print(json.dumps({"chosen": chosen, "max_diff": max(r["max_diff"] for r in rows)}))
    if args.write:
        write_constants(chosen)


if __name__ == "__main__":
    main()
