"""Runner-level latency of one static batch: prefill ms and decode ms/step, per batch size, for
the graph backends the server flags select. No scheduler, no HTTP: batch plans are built here
and fed to `ModelRunner.forward`, so the figures are the runner's own.

    python -m srt.bench.one_batch --model-shape llama-3.2-1b --batch-size 1 8 \\
        --input-len 128 --output-len 32 --cuda-graph-backend-decode full --result-file out.jsonl

`--model-shape` benches a published shape with random weights drawn on the device
(`--load-format dummy`); `--model-path` a real checkpoint. Each batch size runs once cold (that
is when lazy capture happens: the cold figures include it) and then `--runs` times warm; the
warm medians are reported, and decode once more per run with the steps overlapped as the
server runs them (step N+1 launched before N's ids are read; `decode_ms_overlapped`), which
hides the host's share of a step behind the device's; `launch_host_ms` is the median host time
of one such launch (the plan uploaded, the graph replayed, the result's copy queued: what the
server's host path adds to each step when the device waits for it). `--profile DIR` then
runs the decode steps once more under `torch.profiler`, and three prefills of the batch's
prompts, writes their traces to DIR and adds their summaries (GPU kernel ms, kernels and host
ms per step, the top kernels). One JSON line per
batch size is appended to `--result-file`; the table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from srt.batch_layout import ForwardMode
from srt.bench.report import append_jsonl, format_table, machine
from srt.ipc.messages import BatchPlan
from srt.ipc.reports import jsonable
from srt.model_config import ModelConfig
from srt.model_executor.graphs.config import Phase
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.rank_processes import running_ranks
from srt.profiling import profiler_for, summarize_trace
from srt.server_args import ServerArgs
from srt.tools.make_tiny_model import resolve_model_path
from srt.tools.model_shapes import MODEL_SHAPES, write_model_shape

STEP_ANNOTATION = "srt_decode_step"
PREFILL_ANNOTATION = "srt_prefill_step"


@dataclasses.dataclass
class Requests:
    """`batch` requests of `input_len` random prompt tokens, each with its own table row and
    a contiguous run of KV slots (slot 0 is the dummy slot)."""

    batch: int
    input_len: int
    output_len: int
    vocab_size: int
    seed: int

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.prompts = rng.integers(0, self.vocab_size, (self.batch, self.input_len))
        span = self.input_len + self.output_len
        self.slots = 1 + np.arange(self.batch)[:, None] * span + np.arange(span)[None, :]

    def plan(
        self,
        mode: ForwardMode,
        start: int,
        tokens: np.ndarray,
        step: int = 0,
        from_prev: bool = False,
    ) -> BatchPlan:
        """The plan computing positions [start, start + tokens.shape[1]) of every request; with
        `from_prev` (decode), its input ids are the previous step's samples, each request's
        row's latest id on the device (request i has row i)."""
        b, n = tokens.shape
        cols = np.tile(np.arange(start, start + n), b)
        rows = np.repeat(np.arange(b), n)
        locs = self.slots[rows, cols]
        i32 = np.int32
        return BatchPlan(
            forward_mode=int(mode),
            input_ids=tokens.reshape(-1).astype(i32),
            positions=cols.astype(i32),
            out_cache_loc=locs.astype(i32),
            req_pool_indices=np.arange(b, dtype=i32),
            prefix_lens=np.full(b, start, i32),
            extend_lens=np.full(b, n, i32),
            table_rows=rows.astype(i32),
            table_cols=cols.astype(i32),
            table_slots=locs.astype(i32),
            temperatures=np.zeros(b, np.float32),  # greedy
            top_ps=np.ones(b, np.float32),
            top_ks=np.full(b, self.vocab_size, np.int64),
            min_ps=np.zeros(b, np.float32),
            seeds=np.zeros(b, np.int64),
            step=step,
            input_from_row=np.arange(b, dtype=i32) if from_prev else None,
        )


@dataclasses.dataclass
class Run:
    prefill_s: float
    step_s: list[float]  # each decode step's wall time (synchronous steps only)
    ids: np.ndarray  # [B, output_len] the sampled ids


def run_once(runner: ModelRunner, reqs: Requests, profiler: Any = None) -> Run:
    """One prefill and `output_len - 1` decode steps, each waited for. With a
    `torch.profiler.profile`, it records the decode steps only, each annotated."""
    start = time.perf_counter()
    ids = runner.forward(reqs.plan(ForwardMode.EXTEND, 0, reqs.prompts)).next_token_ids
    prefill_s = time.perf_counter() - start
    steps, sampled = [], [ids]
    if profiler is not None:
        profiler.start()
    for step in range(reqs.output_len - 1):
        with torch.profiler.record_function(STEP_ANNOTATION):
            start = time.perf_counter()
            plan = reqs.plan(ForwardMode.DECODE, reqs.input_len + step, ids.reshape(-1, 1))
            ids = runner.forward(plan).next_token_ids  # a host copy: the step is finished
            steps.append(time.perf_counter() - start)
        sampled.append(ids)
    if profiler is not None:
        profiler.stop()
    return Run(prefill_s, steps, np.stack(sampled, axis=1))


@dataclasses.dataclass
class Overlapped:
    step_s: float  # wall seconds per decode step
    launch_s: float  # median host seconds of one launch
    ids: np.ndarray  # [B, output_len] the sampled ids


def run_overlapped(runner: ModelRunner, reqs: Requests) -> Overlapped:
    """Decode as the server's overlap scheduler runs it: step N+1 is launched, its input ids
    the device's samples of step N, before N's ids are read, so that the host's work of a step
    (plan, upload, launch, the read of the result) runs while the device computes."""
    sampled = [runner.forward(reqs.plan(ForwardMode.EXTEND, 0, reqs.prompts)).next_token_ids]
    placeholder = np.zeros((reqs.batch, 1), np.int64)  # the ids come from the device
    steps = reqs.output_len - 1
    start = time.perf_counter()
    pending = None
    launches = []
    for step in range(1, steps + 1):
        plan = reqs.plan(
            ForwardMode.DECODE, reqs.input_len + step - 1, placeholder, step, from_prev=True
        )
        launch_start = time.perf_counter()
        launched = runner.launch(plan)
        launches.append(time.perf_counter() - launch_start)
        if pending is not None:
            sampled.append(pending.wait().next_token_ids)
        pending = launched
    if pending is not None:
        sampled.append(pending.wait().next_token_ids)
    step_s = (time.perf_counter() - start) / max(steps, 1)
    launch_s = statistics.median(launches) if launches else 0.0
    return Overlapped(step_s, launch_s, np.stack(sampled, axis=1))


def profile_decode(
    runner: ModelRunner, reqs: Requests, trace: Path, top: int = 25
) -> dict[str, Any]:
    """Profile one run's decode steps (warm), write the Kineto trace, summarise it."""
    prof = profiler_for(runner.device)
    run_once(runner, reqs, prof)  # it records the decode steps alone
    prof.export_chrome_trace(str(trace))
    return {
        "trace": str(trace),
        **summarize_trace(json.loads(trace.read_text()), top, STEP_ANNOTATION),
    }


def profile_prefill(
    runner: ModelRunner, reqs: Requests, trace: Path, runs: int = 3, top: int = 25
) -> dict[str, Any]:
    """Profile `runs` warm prefills of the batch's prompts, each waited for (its ids read
    back: `forward` waits), write the Kineto trace, summarise it per prefill step."""
    prof = profiler_for(runner.device)
    with prof:
        for _ in range(runs):
            with torch.profiler.record_function(PREFILL_ANNOTATION):
                runner.forward(reqs.plan(ForwardMode.EXTEND, 0, reqs.prompts))
    prof.export_chrome_trace(str(trace))
    summary = summarize_trace(json.loads(trace.read_text()), top, PREFILL_ANNOTATION)
    return {"trace": str(trace), **summary}


def bench(
    args: ServerArgs,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    runs: int,
    shape: str | None,
    profile_dir: Path | None = None,
) -> list[dict[str, Any]]:
    assert args.model_path is not None, "main resolves model_path"
    config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
    start = time.perf_counter()
    # --tp-size N: ranks 1.. in child processes, stopped at the end
    with running_ranks(args, config) as runner:
        startup_s = time.perf_counter() - start  # load + compile (+ upfront capture)
        compile_info = jsonable(runner.info())["compile"]
        graphs = runner.graph_configs
        where = machine()
        results = []
        for b in tqdm(batch_sizes, desc="batch sizes", unit="bs"):
            reqs = Requests(b, input_len, output_len, config.vocab_size, args.seed)
            cold = run_once(runner, reqs)
            warm = [run_once(runner, reqs) for _ in range(runs)]
            steps = [s for run in warm for s in run.step_s]
            decode_ms = statistics.median(steps) * 1000 if steps else None
            overlapped = [run_overlapped(runner, reqs) for _ in range(runs)]
            # Greedy, through the same graphs: the same ids whichever way the steps ran.
            same_graphs = warm[-1] if warm else cold
            for o in overlapped:
                if not np.array_equal(o.ids, same_graphs.ids):
                    raise RuntimeError(
                        f"batch {b}: overlapped decode sampled other ids than synchronous steps"
                    )
            row = {
                "model": shape or str(args.model_path),
                "dtype": str(config.dtype).removeprefix("torch."),
                "device": str(runner.device),
                "tp_size": args.tp_size,
                "attention_backend": runner.attention_backend_name,
                "prefill_backend": graphs[Phase.PREFILL].backend.value,
                "decode_backend": graphs[Phase.DECODE].backend.value,
                "enable_torch_compile": args.enable_torch_compile,
                "tc_compiler": graphs[Phase.DECODE].tc_compiler,
                "graph_partition": compile_info.get("mode") == "partition",
                "compile_passes": compile_info.get("passes") or None,
                "pass_matches": compile_info.get("pass_matches"),
                "custom_ops": args.custom_ops,
                "skinny_matmul_launch": runner.skinny_launch,  # as resolved (auto: pdl or plain)
                "load_s": round(runner.load_s, 3),
                "startup_s": round(startup_s, 3),
                "compile_s": compile_info.get("total_s"),
                "compile_cache_hit": compile_info.get("cache_hit"),
                "compile_graph_s": compile_info.get("compile_s"),  # pieces or the whole graph
                "batch_size": b,
                "input_len": input_len,
                "output_len": output_len,
                "runs": runs,
                "prefill_ms": round(statistics.median(r.prefill_s for r in warm) * 1000, 3),
                "decode_ms_per_step": round(decode_ms, 3) if decode_ms else None,
                "decode_ms_p90": round(float(np.percentile(steps, 90)) * 1000, 3)
                if steps
                else None,
                "decode_tok_s": round(b * 1000 / decode_ms, 1) if decode_ms else None,
                "decode_ms_overlapped": round(
                    statistics.median(o.step_s for o in overlapped) * 1000, 3
                )
                if steps
                else None,
                "launch_host_ms": round(statistics.median(o.launch_s for o in overlapped) * 1000, 3)
                if steps
                else None,
                "cold_prefill_ms": round(cold.prefill_s * 1000, 3),
                "cold_first_decode_ms": round(cold.step_s[0] * 1000, 3) if cold.step_s else None,
                "graphs": {
                    phase: {
                        k: info.get(k)
                        for k in ("backend", "captured", "skipped", "capture_s", "replays")
                    }
                    for phase, info in jsonable(runner.info())["graphs"].items()
                },
                "machine": where,
            }
            if profile_dir is not None and output_len > 1:
                profile_dir.mkdir(parents=True, exist_ok=True)
                name = label(row).replace(", ", "_").replace(" ", "-")  # a file name
                trace = profile_dir / f"{name}-bs{b}.json"
                row["profile"] = profile_decode(runner, reqs, trace)
                prefill_trace = profile_dir / f"{name}-bs{b}-prefill.json"
                row["profile_prefill"] = profile_prefill(runner, reqs, prefill_trace)
            results.append(row)
        return results


def label(row: dict[str, Any]) -> str:
    """The decode path of a result row, e.g. `full+compile`, `full-inductor` (the captured
    graph over Inductor pieces) or `tc_piecewise-inductor` (`-partition`: the whole graph
    compiled, cut at the split ops), and the prefill backend where it
    is not `disabled` (`full, prefill full`); an attention backend other than `triton` and a
    `--custom-ops` selection, graph passes and a skinny kernel's launch other than `plain` too
    (`full, flashinfer`, `full, ops all,-skinny_matmul`, `full-inductor, passes rotary_kernel`,
    `full, launch pdl`), so that rows of one file that differ only in those stay apart."""
    name = row["decode_backend"]
    if row.get("enable_torch_compile") and name == "full":
        name += "+compile"
    elif name in ("full", "tc_piecewise") and row.get("tc_compiler"):
        name += f"-{row['tc_compiler']}"
        if row.get("graph_partition"):
            name += "-partition"
    if row.get("prefill_backend") not in (None, "disabled"):
        name += f", prefill {row['prefill_backend']}"
    if row.get("attention_backend") not in (None, "triton"):
        name += f", {row['attention_backend']}"
    if row.get("custom_ops"):
        name += f", ops {row['custom_ops']}"
    if row.get("compile_passes"):
        name += f", passes {','.join(row['compile_passes'])}"
    if row.get("skinny_matmul_launch") not in (None, "plain"):
        name += f", launch {row['skinny_matmul_launch']}"
    return name


TABLE = [
    ("model", "model"),
    ("decode", "label"),
    ("bs", "batch_size"),
    ("startup s", "startup_s"),
    ("prefill ms", "prefill_ms"),
    ("decode ms/step", "decode_ms_per_step"),
    ("decode tok/s", "decode_tok_s"),
    ("overlapped ms/step", "decode_ms_overlapped"),
    ("launch host ms", "launch_host_ms"),
    ("cold 1st decode ms", "cold_first_decode_ms"),
]
PROFILE_TABLE = [
    ("decode", "label"),
    ("bs", "batch_size"),
    ("wall ms", "wall_ms_per_step"),
    ("gpu ms", "gpu_ms_per_step"),
    ("host ms", "host_ms_per_step"),
    ("kernels", "kernels_per_step"),
]


def format_results(rows: list[dict[str, Any]]) -> str:
    rows = [{**r, "label": label(r)} for r in rows]
    out = [format_table(rows, TABLE)]
    for key, steps in (("profile", "decode steps"), ("profile_prefill", "prefill steps")):
        profiled = [r for r in rows if key in r]
        if not profiled:
            continue
        out.append(f"\nprofile of the warm {steps} (per step):")
        out.append(format_table([{**r, **r[key]} for r in profiled], PROFILE_TABLE))
        for r in profiled:
            out.append(f"\ntop kernels of the {steps}, {r['label']} bs {r['batch_size']}:")
            for k in r[key]["top_kernels"]:
                out.append(
                    f"  {k['ms_per_step']:8.4f} ms  x{k['calls_per_step']:<6g} {k['name'][:100]}"
                )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.bench.one_batch", description=__doc__.split("\n\n")[0]
    )
    ServerArgs.add_cli_args(parser)
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        help="Bench this published shape with random weights.",
    )
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3, help="Warm runs per batch size.")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="Profile the warm decode steps; traces go to DIR.",
    )
    parser.add_argument("--result-file", help="Append one JSON line per batch size here.")
    ns = parser.parse_args(argv)
    if ns.input_len < 1 or ns.output_len < 1 or min(ns.batch_size) < 1 or ns.runs < 1:
        parser.error("--batch-size, --input-len, --output-len and --runs must be positive")
    args = ServerArgs.from_cli_args(ns)
    span = ns.input_len + ns.output_len
    args.context_length = args.context_length or span
    args.max_running_requests = max(ns.batch_size)
    args.max_total_tokens = args.max_total_tokens or max(ns.batch_size) * span
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        if ns.model_shape:
            args.model_path = str(write_model_shape(ns.model_shape, Path(tmp)))
            args.load_format = "dummy"
        else:
            # default: the built-in tiny model
            args.model_path = resolve_model_path(args.model_path)
        rows = bench(
            args, ns.batch_size, ns.input_len, ns.output_len, ns.runs, ns.model_shape, ns.profile
        )
    if ns.result_file:
        append_jsonl(ns.result_file, rows)
    print(format_results(rows))


if __name__ == "__main__":
    main()
