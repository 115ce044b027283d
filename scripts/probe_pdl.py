"""A decode step's matrix products alone, with and without programmatic dependent launch (PDL).

    python3 scripts/probe_pdl.py --model-shape llama-3.2-1b --rows 1 16 --output pdl.json

The products of every layer of a model shape (QKV, output, gate/up with the SiLU-and-mul fused,
down; the LM head last), each reading the one before's output as a step does, with distinct
weights per layer, through the skinny matmul kernel with the tile its table chose (where the
table has the shape), captured in one CUDA graph and replayed. Two launch modes: `plain`
(each kernel waits for the one before to end) and `pdl` (each starts as the one before walks
its last K block, at one row loads its first weight tile, and waits in `gdc_wait` before
reading its input). Printed: ms per chain (median of
replays), the weights' bytes over it, and whether each mode's outputs equal `plain`'s bit for
bit. What it answers: how much of the products' time over the bandwidth floor is each
kernel's start and end, which PDL can overlap, and whether captured graphs keep its edges.
"""

from __future__ import annotations

import argparse
import json

import torch

from srt.bench.skinny_matmul import products, replay_ms
from srt.layers.skinny_matmul_table import SkinnyConfig, choose
from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into
from srt.tools.model_shapes import MODEL_SHAPES

MODES = {"plain": 0, "pdl": 1}
Step = tuple[SkinnyConfig, torch.Tensor, torch.Tensor, torch.Tensor, bool]  # w, in, out, gated
FALLBACK = {"one": SkinnyConfig(4, 1024, 4, 2), "many": SkinnyConfig(32, 256, 4, 5)}


def chain(shape: str, rows: int, dev: torch.device) -> tuple[torch.Tensor, list[Step]]:
    """The step's products as (config, weight, input buffer, output buffer, gated) in order."""
    name = torch.cuda.get_device_name(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    layer_products = [p for p in products(shape) if p.name != "lm_head"]
    head = next(p for p in products(shape) if p.name == "lm_head")
    hidden = MODEL_SHAPES[shape]["hidden_size"]
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.bfloat16, device=dev)
    steps: list[Step] = []
    current = x
    for _ in range(MODEL_SHAPES[shape]["num_hidden_layers"]):
        for p in layer_products:
            w = torch.randn(p.n, p.k, generator=gen, dtype=torch.bfloat16, device=dev)
            w.mul_(p.k**-0.5)
            n_out = p.n // 2 if p.gated else p.n
            out = torch.empty(rows, n_out, dtype=torch.bfloat16, device=dev)
            config = (
                choose(name, "bfloat16", p.n, p.k, rows, p.gated)
                or FALLBACK["one" if rows == 1 else "many"]
            )
            steps.append((config, w, current[:, : p.k], out, p.gated))
            current = out
    w = torch.randn(head.n, head.k, generator=gen, dtype=torch.bfloat16, device=dev)
    out = torch.empty(rows, head.n, dtype=torch.bfloat16, device=dev)
    config = choose(name, "bfloat16", head.n, head.k, rows, False) or FALLBACK["one"]
    steps.append((config, w, current[:, : head.k], out, False))
    return x, steps


def run(steps: list[Step], pdl: int) -> None:
    for config, w, inp, out, gated in steps:
        skinny_matmul_into(out, inp, w, None, config, gated, pdl=pdl)


def time_mode(
    steps: list[Step], pdl: int, replays: int, repeats: int
) -> tuple[float, torch.Tensor]:
    run(steps, pdl)  # compile and load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(steps, pdl)
    graph.replay()
    torch.cuda.synchronize()
    result = steps[-1][3].clone()
    return replay_ms(graph, repeats, replays), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", nargs="+", default=["llama-3.2-1b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output")
    args = parser.parse_args()
    dev = torch.device("cuda")
    records = []
    for shape in args.model_shape:
        for rows in args.rows:
            x, steps = chain(shape, rows, dev)
            nbytes = sum(w.numel() * w.element_size() for _, w, _, _, _ in steps)
            results = {}
            for mode, pdl in MODES.items():
                ms, out = time_mode(steps, pdl, args.replays, args.repeats)
                results[mode] = (ms, out)
            plain = results["plain"][1]
            for mode, (ms, out) in results.items():
                records.append(
                    {
                        "shape": shape,
                        "rows": rows,
                        "mode": mode,
                        "kernels": len(steps),
                        "ms": round(ms, 4),
                        "gb_per_s": round(nbytes / (ms * 1e-3) / 1e9, 1),
                        "equal_to_plain": bool(torch.equal(out, plain)),
                    }
                )
            del x, steps, results
            torch.cuda.empty_cache()
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "records": records}, f, indent=1)
    print("shape rows mode kernels ms GB/s equal")
    for r in records:
        print(*r.values())


if __name__ == "__main__":
    main()
