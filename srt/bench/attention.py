"""The attention op alone, per backend: one layer's `forward` (the new tokens' K and V written
into the paged cache, then attention) on a model shape's heads, for decode and prefill steps
of the sizes serving meets. No model, no runner: a random KV cache whose slots are shuffled (a
request's pages are not contiguous), a request-to-token table, and the step's batch built the
way the runner uploads it.

    python -m srt.bench.attention --model-shape llama-3.2-1b llama-3-8b \\
        --backends triton flashinfer --output attention.json

Decode: `--decode-batch` requests (default 1, 8, 32, 128) of `--decode-context` tokens each
(128, 1,024, 4,096, 16,384). Prefill: one request of `--prefill-tokens` new tokens (128, 1,024,
8,192), from scratch and over a cached prefix as long (`--prefix same`; `none` or `both`).
Each case: `--warmup` calls first, then `--runs` calls, each timed on the device with CUDA
events (the L2 cache flushed before each; wall time on the CPU); the median and p90 are
reported, per layer. The metadata hook, which a step runs once for all its layers, is timed on
the host apart (`plan_ms`, its median). `first_call_s` is a case's first hook and call, waited
for: where a kernel is built on first use (FlashInfer's JIT modules, Triton's kernels), that is
when, outside the timed calls. Each backend's output is compared with the first backend's on
the same inputs and cache (`max_diff_vs`, `max_diff`): the cases run one by one, every backend
in turn. Kernels JIT-build into the compile cache root, as the
server's do (`--compile-cache-dir`).

The table is printed last; `--output` writes the rows and the machine as JSON.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srt.batch_layout import ForwardMode
from srt.bench.report import format_table, machine, write_json
from srt.compilation.cache_root import default_cache_root, open_cache_root, point_tool_caches
from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan
from srt.layers.attention.base import AttentionBackend, AttentionInputs
from srt.layers.attention.registry import ATTENTION_BACKENDS, create_attention_backend
from srt.model_executor.step_inputs import upload_step
from srt.tools.model_shapes import MODEL_SHAPES

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
L2_FLUSH_BYTES = 256 * 2**20  # larger than any GPU's L2 cache


@dataclass(frozen=True)
class Case:
    """One step: decode (`batch` requests of `context` tokens, one new each) or prefill (one
    request of `new` tokens after `prefix` cached ones)."""

    mode: ForwardMode
    batch: int
    prefix: int  # cached tokens per request
    new: int  # new tokens per request

    @property
    def kv_tokens(self) -> int:
        return self.batch * (self.prefix + self.new)

    def label(self) -> str:
        if self.mode == ForwardMode.DECODE:
            return f"decode bs {self.batch} ctx {self.prefix + self.new}"
        return f"prefill {self.new} over {self.prefix}"


def cases(
    decode_batch: list[int], decode_context: list[int], prefill_tokens: list[int], prefix: str
) -> list[Case]:
    out = [Case(ForwardMode.DECODE, b, c - 1, 1) for b in decode_batch for c in decode_context]
    prefixes = {"none": [False], "same": [True], "both": [False, True]}[prefix]
    out += [
        Case(ForwardMode.EXTEND, 1, n if cached else 0, n)
        for n in prefill_tokens
        for cached in prefixes
    ]
    return out


class World:
    """One layer's KV cache (random, `slots` slots, slot 0 the dummy slot) and the slot table:
    request i's table row is `row i` of a random permutation of the slots, `width` long."""

    def __init__(
        self,
        rows: int,
        width: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
    ) -> None:
        gen = np.random.default_rng(seed)
        self.table = (1 + gen.permutation(rows * width)).astype(np.int32).reshape(rows, width)
        self.req_to_token = torch.from_numpy(self.table).to(device)
        shape = (rows * width + 1, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device=device)
        self.v_cache = torch.randn(shape, dtype=dtype, device=device)

    def batch(self, case: Case) -> ForwardBatch:
        b, seq = case.batch, case.prefix + case.new
        cols = np.tile(np.arange(case.prefix, seq), b)
        rows = np.repeat(np.arange(b), case.new)
        i32 = np.int32
        plan = BatchPlan.greedy(
            case.mode,
            input_ids=np.zeros(b * case.new, i32),
            positions=cols.astype(i32),
            out_cache_loc=self.table[rows, cols],
            req_pool_indices=np.arange(b, dtype=i32),
            prefix_lens=np.full(b, case.prefix, i32),
            extend_lens=np.full(b, case.new, i32),
        )
        return upload_step(plan, self.req_to_token)


def device_ms(fn: Callable[[], object], runs: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `runs` calls: CUDA events around each (the L2 cache flushed
    before it, outside the events), all queued before the one wait; wall time elsewhere."""
    if device.type != "cuda":
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1000)
        return times
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(runs)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_case(
    backend: AttentionBackend,
    world: World,
    case: Case,
    num_heads: int,
    runs: int,
    warmup: int,
    seed: int,
) -> tuple[dict[str, Any], torch.Tensor]:
    """One backend on one case: its row of figures, and its output (to compare)."""
    device = world.k_cache.device
    dtype = world.k_cache.dtype
    _, num_kv_heads, head_dim = world.k_cache.shape
    batch = world.batch(case)
    tokens = batch.num_tokens
    gen = torch.Generator(device=device).manual_seed(seed)  # the same inputs for every backend

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads * head_dim, generator=gen, dtype=dtype, device=device)

    q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    out = torch.empty_like(q)
    x = AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, head_dim**-0.5)

    def call() -> None:
        backend.forward(batch, x)

    sync(device)
    start = time.perf_counter()
    backend.init_forward_metadata(batch)
    call()
    sync(device)
    first_call_s = time.perf_counter() - start
    plan_ms = []
    for _ in range(max(runs, 1)):
        start = time.perf_counter()
        backend.init_forward_metadata(batch)
        plan_ms.append((time.perf_counter() - start) * 1000)
    for _ in range(warmup):
        call()
    op_ms = device_ms(call, runs, device)
    median = statistics.median(op_ms)
    kv_bytes = 2 * case.kv_tokens * num_kv_heads * head_dim * world.k_cache.element_size()
    row = {
        "phase": "decode" if case.mode == ForwardMode.DECODE else "prefill",
        "batch_size": case.batch,
        "context": case.prefix + case.new,
        "prefix": case.prefix,
        "new_tokens": case.new,
        "op_ms": round(median, 4),
        "op_ms_p90": round(float(np.percentile(op_ms, 90)), 4),
        "plan_ms": round(statistics.median(plan_ms), 4),
        "first_call_s": round(first_call_s, 4),
        "kv_gb_s": round(kv_bytes / median / 1e6, 1) if median > 0 else None,
    }
    return row, out.clone()


def run(
    shapes: list[str],
    backends: list[str],
    all_cases: list[Case],
    dtype: torch.dtype,
    device: torch.device,
    runs: int,
    warmup: int,
    seed: int,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rows_needed = max(c.batch for c in all_cases)
    width = max(c.prefix + c.new for c in all_cases)
    for shape in shapes:
        cfg = MODEL_SHAPES[shape]
        heads, kv_heads, head_dim = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
        )
        world = World(rows_needed, width, kv_heads, head_dim, dtype, device, seed)
        made = {
            name: create_attention_backend(name, heads, kv_heads, head_dim) for name in backends
        }
        # Case by case, every backend in turn: each writes the case's new K and V (the same
        # values) into the cache, which later cases read, so all see the same cache.
        for i, case in enumerate(all_cases):
            first = None
            for name, backend in made.items():
                row, out = bench_case(backend, world, case, heads, runs, warmup, seed + i)
                first = out if first is None else first
                row["max_diff_vs"] = backends[0]
                row["max_diff"] = round(float((out.float() - first.float()).abs().max()), 5)
                rows.append({"model_shape": shape, "backend": name, **row})
                logging.info("%s %s %s: %.4f ms", shape, name, case.label(), row["op_ms"])
        del world
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


TABLE = [
    ("shape", "model_shape"),
    ("backend", "backend"),
    ("phase", "phase"),
    ("bs", "batch_size"),
    ("context", "context"),
    ("prefix", "prefix"),
    ("new", "new_tokens"),
    ("op ms", "op_ms"),
    ("p90 ms", "op_ms_p90"),
    ("plan ms", "plan_ms"),
    ("first call s", "first_call_s"),
    ("KV GB/s", "kv_gb_s"),
    ("max diff", "max_diff"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.bench.attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model-shape",
        nargs="+",
        choices=sorted(MODEL_SHAPES),
        default=sorted(MODEL_SHAPES),
        help="The heads of these published shapes (default: all).",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=ATTENTION_BACKENDS,
        default=["triton", "flashinfer"],
        help="Attention backends, in order; each is compared with the first.",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--decode-context", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument(
        "--prefix",
        choices=["none", "same", "both"],
        default="both",
        help="Prefill from scratch, over a cached prefix as long as the new tokens, or both.",
    )
    parser.add_argument("--runs", type=int, default=50, help="Timed calls per case.")
    parser.add_argument("--warmup", type=int, default=5, help="Untimed calls before them.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile-cache-dir",
        help="Compile cache root, where the kernels JIT-build (default: the server's).",
    )
    parser.add_argument("--output", help="Write the rows and the machine here as JSON.")
    parser.add_argument("--log-level", default="warning")
    ns = parser.parse_args(argv)
    sizes = [*ns.decode_batch, *ns.decode_context, *ns.prefill_tokens]
    if min(sizes) < 1 or ns.runs < 1 or ns.warmup < 0:
        parser.error("sizes and --runs must be positive, --warmup not negative")
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    # Before any backend imports its kernels: FlashInfer reads its JIT directory at import.
    point_tool_caches(open_cache_root(Path(ns.compile_cache_dir or default_cache_root())))
    all_cases = cases(ns.decode_batch, ns.decode_context, ns.prefill_tokens, ns.prefix)
    device = torch.device(ns.device)
    rows = run(
        ns.model_shape,
        ns.backends,
        all_cases,
        DTYPES[ns.dtype],
        device,
        ns.runs,
        ns.warmup,
        ns.seed,
    )
    if ns.output:
        write_json(ns.output, {"machine": machine(), "rows": rows})
    print(format_table(rows, TABLE))


if __name__ == "__main__":
    main()
