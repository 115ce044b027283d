"""Runner-level latency of one static batch: prefill ms and decode ms/step, per batch size, for
the graph backends the server flags select. No scheduler, no HTTP: batch plans are built here
and fed to `ModelRunner.forward`, so the figures are the runner's own.

    python -m srt.bench_one_batch --model-shape llama-3.2-1b --batch-size 1 8 \\
        --input-len 128 --output-len 32 --cuda-graph-backend-decode full --result-file out.jsonl

`--model-shape` writes a named model's config.json (with the tiny tokenizer files) to a
temporary directory and loads random weights (`--load-format dummy`); `--model-path` benches
a real checkpoint. Each batch size runs once cold (that is when lazy capture happens: the
cold figures include it) and then `--runs` times warm; the warm medians are reported. One JSON
line per batch size is appended to `--result-file`, and a table is printed.
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

from srt.managers.io_struct import BatchPlan
from srt.model_config import ModelConfig
from srt.model_executor.forward_batch import ForwardMode
from srt.model_executor.graph_config import Phase
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs

# Published shapes (config.json fields), for benchmarks with random weights.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rope_scaling": None, "tie_word_embeddings": False,
    },
}


def write_model_shape(name: str, directory: Path) -> Path:
    """A model directory with `name`'s config.json and the tiny model's tokenizer files (its
    weights are tiny and never read: load with `--load-format dummy`)."""
    from srt.tools.make_tiny_model import make_tiny_model

    if name not in MODEL_SHAPES:
        raise ValueError(f"--model-shape: unknown shape {name!r}; choose one of "
                         f"{sorted(MODEL_SHAPES)}")
    path = make_tiny_model(directory / name)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("rope_parameters", None)
    config.update(MODEL_SHAPES[name], architectures=["LlamaForCausalLM"], model_type="llama",
                  torch_dtype="bfloat16", dtype="bfloat16", rms_norm_eps=1e-5)
    config_file.write_text(json.dumps(config, indent=2))
    return path


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

    def plan(self, mode: ForwardMode, start: int, tokens: np.ndarray) -> BatchPlan:
        """The plan computing positions [start, start + tokens.shape[1]) of every request."""
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
        )


def run_once(runner: ModelRunner, reqs: Requests) -> tuple[float, list[float]]:
    """One prefill and `output_len - 1` decode steps: (prefill s, [decode step s])."""
    start = time.perf_counter()
    ids = runner.forward(reqs.plan(ForwardMode.EXTEND, 0, reqs.prompts)).next_token_ids
    prefill_s = time.perf_counter() - start
    steps = []
    for step in range(reqs.output_len - 1):
        start = time.perf_counter()
        plan = reqs.plan(ForwardMode.DECODE, reqs.input_len + step, ids.reshape(-1, 1))
        ids = runner.forward(plan).next_token_ids  # a host copy: the step is finished
        steps.append(time.perf_counter() - start)
    return prefill_s, steps


def bench(args: ServerArgs, batch_sizes: list[int], input_len: int, output_len: int,
          runs: int, shape: str | None) -> list[dict[str, Any]]:
    config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
    start = time.perf_counter()
    runner = ModelRunner(args, config)
    startup_s = time.perf_counter() - start  # load + compile (+ upfront capture)
    compile_info = runner.info()["compile"]
    graphs = runner.graph_configs
    results = []
    for b in batch_sizes:
        reqs = Requests(b, input_len, output_len, config.vocab_size, args.seed)
        cold_prefill, cold_steps = run_once(runner, reqs)
        warm = [run_once(runner, reqs) for _ in range(runs)]
        steps = [s for _, run_steps in warm for s in run_steps]
        decode_ms = statistics.median(steps) * 1000 if steps else None
        results.append({
            "model": shape or str(args.model_path),
            "dtype": str(config.dtype).removeprefix("torch."),
            "device": str(runner.device),
            "attention_backend": runner.attention_backend_name,
            "prefill_backend": graphs[Phase.PREFILL].backend.value,
            "decode_backend": graphs[Phase.DECODE].backend.value,
            "enable_torch_compile": args.enable_torch_compile,
            "tc_compiler": graphs[Phase.DECODE].tc_compiler,
            "startup_s": round(startup_s, 3),
            "compile_s": compile_info.get("total_s"),
            "compile_cache_hit": compile_info.get("cache_hit"),
            "batch_size": b,
            "input_len": input_len,
            "output_len": output_len,
            "runs": runs,
            "prefill_ms": round(statistics.median(p for p, _ in warm) * 1000, 3),
            "decode_ms_per_step": round(decode_ms, 3) if decode_ms else None,
            "decode_ms_p90": round(float(np.percentile(steps, 90)) * 1000, 3) if steps else None,
            "decode_tok_s": round(b * 1000 / decode_ms, 1) if decode_ms else None,
            "cold_prefill_ms": round(cold_prefill * 1000, 3),
            "cold_first_decode_ms": round(cold_steps[0] * 1000, 3) if cold_steps else None,
            "graphs": {phase: {k: info.get(k) for k in ("backend", "captured", "skipped",
                                                         "capture_s", "replays")}
                       for phase, info in runner.info()["graphs"].items()},
        })
    return results


def format_table(rows: list[dict[str, Any]]) -> str:
    columns = [("model", "model"), ("prefill", "prefill_backend"), ("decode", "decode_backend"),
               ("bs", "batch_size"), ("in", "input_len"), ("out", "output_len"),
               ("prefill ms", "prefill_ms"), ("decode ms/step", "decode_ms_per_step"),
               ("decode tok/s", "decode_tok_s"), ("cold prefill ms", "cold_prefill_ms"),
               ("cold 1st decode ms", "cold_first_decode_ms")]
    cells = [[title for title, _ in columns]]
    cells += [[str(row[key]) for _, key in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES),
                        help="Bench this published shape with random weights.")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3, help="Warm runs per batch size.")
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
        elif not args.model_path:
            parser.error("give --model-path or --model-shape")
        rows = bench(args, ns.batch_size, ns.input_len, ns.output_len, ns.runs, ns.model_shape)
    if ns.result_file:
        with open(ns.result_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
