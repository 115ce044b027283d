"""Cold start against steady state: for each server configuration, start a real server with an
empty compile cache, then again warm from the cache the first start wrote, and measure what a
user of a fleet sees.

    python -m srt.bench.cold_start --model-path DIR --configs nographs full-lazy \\
        [--attention-backends triton flashinfer] \\
        --output-file cold_start.json --plot cold_start.png [-- common server flags]

Per start: the time from launch to `/health` 200 and the server's own startup breakdown; the
TTFT (and time to the second token) of the very first request and of one at the end; the first
hit of each new decode bucket: bursts of 1, 2, 4, ... concurrent streams, each size sent twice,
the first burst's time to the second token (prefill and first decode step, when the bucket is
captured) against the second burst's, beside the server's own capture ms for that bucket;
steady ITL at concurrency 1 and 32; graph memory; a timeline of every token's latency.

Each configuration gets its own `--compile-cache-dir`; the server keeps Triton's, Inductor's
and FlashInfer's caches under it (the benchmark clears `TRITON_CACHE_DIR`,
`TORCHINDUCTOR_CACHE_DIR` and `FLASHINFER_WORKSPACE_BASE` for the server, which would
otherwise take them elsewhere), so the cold start is cold all the way down and the warm one
finds everything the cold one wrote.

`--attention-backends A B` runs every configuration once per attention backend (named
`CONFIG+A`, `--attention-backend A` added to its flags), each with its own cold and warm
start, and prints each start's ready time against the same configuration's and cache state's
start on the first backend, beside FlashInfer's JIT builds before ready (`flashinfer_jit_s` of
the runner's breakdown; modules compiled and only loaded).

A real checkpoint on disk is the honest case (`python -m srt.tools.make_random_checkpoint`);
`--model-shape` uses random weights drawn on the device, which skips the load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from srt.bench.report import format_table, machine, write_json
from srt.bench.server_process import ServerProcess, add_server_flags_arg, server_flags
from srt.bench.serving import RequestRecord, metrics, random_requests, run_load
from srt.tools.model_shapes import MODEL_SHAPES, write_model_shape

logger = logging.getLogger("srt.bench.cold_start")

_TCPW_INDUCTOR = [
    "--cuda-graph-backend-decode",
    "tc_piecewise",
    "--cuda-graph-tc-compiler",
    "inductor",
]
# Decode captured whole over the once-compiled general graph: capture is all a bucket costs.
_FULL_INDUCTOR = ["--cuda-graph-backend-decode", "full", "--cuda-graph-tc-compiler", "inductor"]
# The same two over AOTInductor's packages (a warm start imports neither Dynamo nor Inductor).
_TCPW_AOT = [
    "--cuda-graph-backend-decode",
    "tc_piecewise",
    "--cuda-graph-tc-compiler",
    "aot_inductor",
]
_FULL_AOT = ["--cuda-graph-backend-decode", "full", "--cuda-graph-tc-compiler", "aot_inductor"]
# The same two over the partition mode (the whole graph compiled once, cut at the split ops).
_PARTITION = ["--inductor-graph-partition"]
PRESETS: dict[str, list[str]] = {
    "nographs": ["--disable-cuda-graph"],
    "full-lazy": ["--cuda-graph-backend-decode", "full", "--cuda-graph-capture", "lazy"],
    "full-upfront": ["--cuda-graph-backend-decode", "full", "--cuda-graph-capture", "upfront"],
    "tcpw-inductor-lazy": [*_TCPW_INDUCTOR, "--cuda-graph-capture", "lazy"],
    "tcpw-inductor-upfront": [*_TCPW_INDUCTOR, "--cuda-graph-capture", "upfront"],
    "full-inductor-lazy": [*_FULL_INDUCTOR, "--cuda-graph-capture", "lazy"],
    "full-inductor-upfront": [*_FULL_INDUCTOR, "--cuda-graph-capture", "upfront"],
    "tcpw-partition-lazy": [*_TCPW_INDUCTOR, *_PARTITION, "--cuda-graph-capture", "lazy"],
    "full-partition-lazy": [*_FULL_INDUCTOR, *_PARTITION, "--cuda-graph-capture", "lazy"],
    # The split graph bound without Dynamo, its pieces as traced: a warm start imports no compiler.
    "tcpw-eager-lazy": [*_TCPW_INDUCTOR[:3], "eager", "--cuda-graph-capture", "lazy"],
    "tcpw-aot-lazy": [*_TCPW_AOT, "--cuda-graph-capture", "lazy"],
    "full-aot-lazy": [*_FULL_AOT, "--cuda-graph-capture", "lazy"],
}
CACHE_STATES = ("cold", "warm")
# Cleared for each server: set, a tool's cache would outlive the cold start.
TOOL_CACHE_ENV = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")


@dataclass(frozen=True)
class Configuration:
    """A preset or `--config`, on one attention backend where `--attention-backends` is given
    (else on what its flags and the server's default choose)."""

    name: str
    flags: list[str]
    attention: str | None = None

    @property
    def label(self) -> str:
        """Its name in the results, the tables, and its cache root's and logs' names."""
        return f"{self.name}+{self.attention}" if self.attention else self.name

    def server_flags(self) -> list[str]:
        return (
            [*self.flags, "--attention-backend", self.attention] if self.attention else self.flags
        )


def per_attention_backend(configs: list[Configuration], backends: list[str]) -> list[Configuration]:
    """Each configuration once per backend, the backends of one configuration together (so
    their starts are run close in time); `configs` as they are without backends."""
    if not backends:
        return configs
    return [Configuration(c.name, c.flags, b) for c in configs for b in backends]


def sets_attention_backend(flags: list[str]) -> bool:
    return any(f == "--attention-backend" or f.startswith("--attention-backend=") for f in flags)


def parse_config(text: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` (FLAGS as a shell would split them)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {text!r}")
    return name.strip(), shlex.split(flags)


def startup_breakdown(ready_s: float, info: dict[str, Any]) -> dict[str, float | None]:
    """The server's startup figures (from `/get_server_info`) beside the measured ready
    time: where each second went, per process (`{process}_{part}`, as each process's
    `breakdown` gives them, with its `total_s` and `ready_after_s`)."""
    startup_s = info.get("startup_s")
    out: dict[str, float | None] = {
        "launch_to_ready_s": round(ready_s, 3),
        "server_startup_s": startup_s,
        # Before the launcher's clock starts: its interpreter and first imports.
        "launcher_before_start_s": None if startup_s is None else round(ready_s - startup_s, 3),
    }
    for name, proc in info.get("processes", {}).items():
        for key in ("ready_after_s", "total_s"):
            if proc.get(key) is not None:  # the launcher's own entry has no ready_after_s
                out[f"{name}_{key}"] = proc[key]
        for part, seconds in (proc.get("breakdown") or {}).items():
            out[f"{name}_{part}"] = seconds
    return out


def median_ms(values_s: list[float]) -> float | None:
    return round(statistics.median(values_s) * 1000, 3) if values_s else None


def second_token_s(records: list[RequestRecord]) -> list[float]:
    """Each stream's time from send to its second token: its prefill and first decode step.
    (Not the gap between its first two tokens: a client busy with many streams can read two
    events at once, which shortens that gap to nothing and lengthens the TTFT as much.)"""
    return [r.token_times[1] - r.sent for r in records if r.ok and r.output_tokens > 1]


def bucket_of(graphs: dict[str, Any], batch: int) -> dict[str, Any]:
    """The server's record of the decode bucket that holds `batch` (empty when decode
    captures nothing)."""
    buckets = sorted((graphs.get("decode") or {}).get("buckets") or [], key=lambda b: b["bucket"])
    return next((b for b in buckets if b["bucket"] >= batch), {})


class Traffic:
    """The requests of one start, in order, all recorded for the timeline."""

    def __init__(self, url: str, vocab: int, ns: argparse.Namespace) -> None:
        self.url, self.vocab, self.ns = url, vocab, ns
        self.records: list[RequestRecord] = []
        self.seed = ns.seed

    def send(self, num: int, output_len: int, concurrency: int) -> list[RequestRecord]:
        self.seed += 1
        specs = random_requests(num, self.ns.input_len, output_len, self.vocab, seed=self.seed)
        records = asyncio.run(
            run_load(
                self.url,
                specs,
                max_concurrency=concurrency,
                timeout_s=self.ns.request_timeout,
                progress=False,
            )
        )
        self.records += records
        return records


def measure_start(
    name: str, flags: list[str], cache: Path, state: str, ns: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    """One server start and its traffic; the figures of one (configuration, cache) row."""
    # Unset, the server puts them under `cache`.
    env: dict[str, str | None] = dict.fromkeys(TOOL_CACHE_ENV)
    log = log_dir / f"{name}-{state}.log"
    row: dict[str, Any] = {"config": name, "flags": flags, "cache": state, "log": str(log)}
    with ServerProcess([*flags, "--compile-cache-dir", str(cache)], log, env=env) as server:
        try:
            ready_s = server.wait_ready(ns.ready_timeout)
        except (RuntimeError, TimeoutError) as e:
            row["error"] = str(e).splitlines()[0]
            logger.error("%s (%s) did not become ready: %s", name, state, row["error"])
            return row
        ready_at = time.perf_counter()
        info = server.info()
        traffic = Traffic(server.url, int(info["model"]["vocab_size"]), ns)
        first = traffic.send(1, ns.burst_output_len, 1)
        bursts = []
        for b in ns.bursts:  # the first burst of a size hits its bucket first; then again
            bursts.append(
                (
                    b,
                    traffic.send(b, ns.burst_output_len, b),
                    traffic.send(b, ns.burst_output_len, b),
                )
            )
        steady_runs = {}
        for c in ns.steady_concurrency:
            records = traffic.send(c * ns.steady_rounds, ns.steady_output_len, c)
            steady_runs[str(c)] = metrics(records)
        later = traffic.send(1, ns.burst_output_len, 1)
        after = server.info()
    buckets = []
    for b, hit, again in bursts:
        t2t_first, t2t_again = median_ms(second_token_s(hit)), median_ms(second_token_s(again))
        record = bucket_of(after.get("graphs") or {}, b)
        buckets.append(
            {
                "batch": b,
                "t2t_first_ms": t2t_first,
                "t2t_again_ms": t2t_again,
                "excess_ms": round(t2t_first - t2t_again, 3)
                if t2t_first is not None and t2t_again is not None
                else None,
                # Per token, not per event: a stream that falls behind gets several at once.
                "steady_tpot_ms": median_ms(
                    [r.tpot_s for r in again if r.ok and r.tpot_s is not None]
                ),
                "server_bucket": record.get("bucket"),
                "server_capture_ms": record.get("capture_ms"),
            }
        )
    runner = after["runner"]
    errors = [r.error for r in traffic.records if not r.ok]
    row.update(
        {
            "ready_s": round(ready_s, 3),
            "breakdown": startup_breakdown(ready_s, info),
            "load_bytes": runner.get("load_bytes"),
            "load_gb_s": runner.get("load_gb_s"),
            "ttft_first_ms": median_ms([r.ttft_s for r in first if r.ok and r.ttft_s]),
            "ttft_later_ms": median_ms([r.ttft_s for r in later if r.ok and r.ttft_s]),
            "t2t_first_ms": median_ms(second_token_s(first)),
            "t2t_later_ms": median_ms(second_token_s(later)),
            "buckets": buckets,
            "steady": steady_runs,
            "compile": {
                k: after["compile"].get(k)
                for k in (
                    "graph_source",
                    "dynamo_s",
                    "graph_load_s",
                    "compile_s",
                    "total_s",
                    "cache_hit",
                )
            },
            "graph_pool": runner.get("graph_pool"),
            "flashinfer_jit": runner.get("flashinfer_jit"),  # modules compiled, loaded, s
            "compile_ahead": runner.get("compile_ahead"),  # threads, kernels, failed, s
            "graphs": after.get("graphs"),
            "requests": len(traffic.records),
            "errors": len(errors),
            "error_samples": sorted(set(e for e in errors if e))[:5],
            "timeline": timeline(traffic.records, ready_at, ns.timeline_s),
        }
    )
    return row


def timeline(
    records: list[RequestRecord], ready_at: float, horizon_s: float
) -> dict[str, list[float] | list[bool]]:
    """Every token's latency (ms: TTFT for a first token, else the gap since the previous
    event of its stream) against its arrival (s since ready), for the first `horizon_s`."""
    t: list[float] = []
    ms: list[float] = []
    first: list[bool] = []
    for r in records:
        previous = r.sent
        for i, at in enumerate(r.chunk_times):
            if at - ready_at > horizon_s:
                break
            t.append(round(at - ready_at, 4))
            ms.append(round((at - previous) * 1000, 3))
            first.append(i == 0)
            previous = at
    return {"t_s": t, "ms": ms, "first_token": first}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Ready time per configuration (cold, warm) beside its steady ITL; per-token latency
    over the first traffic of each start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "ready_s" in r]
    names = list(dict.fromkeys(r["config"] for r in ok))
    fig, axes = plt.subplot_mosaic(
        [["ready", "ready"], list(CACHE_STATES)], figsize=(13, 9), layout="constrained"
    )
    top = axes["ready"]
    width = 0.38
    for k, state in enumerate(CACHE_STATES):
        ready = [
            next((r["ready_s"] for r in ok if r["config"] == n and r["cache"] == state), 0.0)
            for n in names
        ]
        bars = top.bar(
            [i + (k - 0.5) * width for i in range(len(names))],
            ready,
            width,
            label=f"ready, {state} cache",
        )
        top.bar_label(bars, fmt="%.1f s", fontsize=8)
    top.set_xticks(range(len(names)), names)
    top.set_ylabel("launch to /health 200 (s)")
    top.set_ylim(0, 1.35 * max((r["ready_s"] for r in ok), default=1.0))  # room for the legend
    itl = top.twinx()
    level = str(min(int(c) for r in ok for c in r["steady"])) if ok else "1"
    itl.plot(
        range(len(names)),
        [
            next(
                (
                    r["steady"][level]["itl_ms"]["p50"]
                    for r in ok
                    if r["config"] == n and r["cache"] == "warm" and level in r["steady"]
                ),
                math.nan,  # no point drawn
            )
            for n in names
        ],
        "kD",
        label=f"steady ITL p50 at concurrency {level} (warm)",
    )
    itl.set_ylabel("ITL p50 (ms)")
    itl.set_ylim(bottom=0)
    handles = top.get_legend_handles_labels()[0] + itl.get_legend_handles_labels()[0]
    top.legend(handles=handles, loc="upper left", fontsize=8)
    top.set_title("time to ready per configuration, and what it buys in steady state")
    for state in CACHE_STATES:
        ax = axes[state]
        for r in (r for r in ok if r["cache"] == state):
            tl = r["timeline"]
            ax.scatter(tl["t_s"], tl["ms"], s=4, alpha=0.6, label=r["config"])
        ax.set_yscale("log")
        ax.set_xlabel("seconds since ready")
        ax.set_ylabel("token latency (ms; first tokens: TTFT)")
        ax.set_title(f"first traffic after a {state} start")
        ax.legend(fontsize=7, markerscale=3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


TABLE = [
    ("config", "config"),
    ("cache", "cache"),
    ("ready s", "ready_s"),
    ("/ import torch", "ready_over_import_torch"),
    ("- import torch s", "ready_minus_import_torch_s"),
    ("load s", "model_runner_load_s"),
    ("load GB/s", "load_gb_s"),
    ("compile s", "compile_total_s"),
    ("upfront capture s", "model_runner_capture_s"),
    ("TTFT 1st ms", "ttft_first_ms"),
    ("TTFT later ms", "ttft_later_ms"),
    ("worst new-bucket excess ms", "worst_excess_ms"),
    ("ITL p50 c1", "itl_p50_c1"),
    ("ITL p99 c1", "itl_p99_c1"),
    ("ITL p50 cmax", "itl_p50_cmax"),
    ("graph MiB", "graph_mib"),
    ("errors", "errors"),
]
# Where a start's seconds went, process by process (the critical path is the slowest child).
PARTS_TABLE = [
    ("config", "config"),
    ("cache", "cache"),
    ("ready s", "ready_s"),
    ("runner imports", "model_runner_spawn_imports_s"),
    ("device init", "model_runner_device_init_s"),
    ("load", "model_runner_load_s"),
    ("kernels import", "model_runner_custom_ops_s"),
    ("dynamo", "model_runner_dynamo_s"),
    ("inductor", "model_runner_inductor_s"),
    ("flashinfer JIT", "model_runner_flashinfer_jit_s"),
    ("compile ahead", "model_runner_compile_ahead_s"),
    ("warm-up", "model_runner_warmup_s"),
    ("capture", "model_runner_capture_s"),
    ("runner other", "model_runner_other_s"),
    ("tokenizer imports", "tokenizer_imports_s"),
    ("tokenizer load", "tokenizer_tokenizer_s"),
]
BUCKET_TABLE = [
    ("config", "config"),
    ("cache", "cache"),
    ("batch", "batch"),
    ("2nd token, 1st burst ms", "t2t_first_ms"),
    ("2nd token, again ms", "t2t_again_ms"),
    ("excess ms", "excess_ms"),
    ("steady TPOT ms", "steady_tpot_ms"),
    ("bucket", "server_bucket"),
    ("server capture ms", "server_capture_ms"),
]


# Each start against the first attention backend's (`--attention-backends`).
BACKEND_TABLE = [
    ("config", "config"),
    ("cache", "cache"),
    ("attention", "attention"),
    ("ready s", "ready_s"),
    ("ready - first backend's s", "ready_minus_first_s"),
    ("flashinfer JIT s", "flashinfer_jit_s"),
    ("modules compiled", "flashinfer_compiled"),
    ("modules loaded", "flashinfer_loaded"),
]


def against_first_backend(rows: list[dict[str, Any]], first: str) -> list[dict[str, Any]]:
    """The starts run per attention backend: each one's ready time minus that of the start of
    the same configuration and cache state on `first` (the warm starts' difference is what a
    restart on the backend costs over one on `first`; the cold starts' adds its JIT builds),
    and FlashInfer's builds before ready. None where either start failed."""
    ready = {(r["base_config"], r["cache"], r["attention"]): r.get("ready_s") for r in rows}
    out = []
    for r in rows:
        if r.get("attention") is None:
            continue
        mine = r.get("ready_s")
        theirs = ready.get((r["base_config"], r["cache"], first))
        builds = r.get("flashinfer_jit") or {}
        out.append(
            {
                "config": r["base_config"],
                "cache": r["cache"],
                "attention": r["attention"],
                "ready_s": mine,
                "ready_minus_first_s": None
                if mine is None or theirs is None
                else round(mine - theirs, 3),
                "flashinfer_jit_s": (r.get("breakdown") or {}).get("model_runner_flashinfer_jit_s"),
                "flashinfer_compiled": builds.get("compiled"),
                "flashinfer_loaded": builds.get("loaded"),
            }
        )
    return out


def import_torch_s(runs: int = 3) -> float:
    """Median seconds of `python -c "import torch"` here: the yardstick a start is held
    against (a ratio survives a machine that is faster or busier than another)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if "ready_s" not in r:
            out.append({"config": r["config"], "cache": r["cache"], "errors": r.get("error")})
            continue
        levels = sorted(r["steady"], key=int)
        excess = [b["excess_ms"] for b in r["buckets"] if b["excess_ms"] is not None]
        pool = (r.get("graph_pool") or {}).get("pool_bytes") or 0
        out.append(
            {
                **r,
                **r["breakdown"],
                "compile_total_s": r["compile"]["total_s"],
                "worst_excess_ms": max(excess) if excess else None,
                "itl_p50_c1": r["steady"][levels[0]]["itl_ms"]["p50"],
                "itl_p99_c1": r["steady"][levels[0]]["itl_ms"]["p99"],
                "itl_p50_cmax": r["steady"][levels[-1]]["itl_ms"]["p50"],
                "graph_mib": round(pool / 2**20, 1),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.bench.cold_start", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-path", help="A checkpoint on disk (the honest case).")
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        help="A published shape with random weights drawn on the device.",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(PRESETS),
        help=f"Presets to run: {', '.join(PRESETS)} (default: all).",
    )
    parser.add_argument(
        "--config",
        action="append",
        type=parse_config,
        default=[],
        metavar="NAME=FLAGS",
        help="Another configuration (repeatable).",
    )
    parser.add_argument(
        "--attention-backends",
        nargs="+",
        default=[],
        metavar="BACKEND",
        help="Run every configuration once per attention backend (CONFIG+BACKEND), each "
        "compared with the first (default: the backend its flags and the server choose).",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument(
        "--bursts",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32],
        help="Concurrent streams per burst; each size is sent twice.",
    )
    parser.add_argument("--burst-output-len", type=int, default=16)
    parser.add_argument("--steady-concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--steady-rounds",
        type=int,
        default=2,
        help="Requests per steady level: this many times the concurrency.",
    )
    parser.add_argument("--steady-output-len", type=int, default=64)
    parser.add_argument(
        "--timeline-s",
        type=float,
        default=60.0,
        help="How much of the first traffic the timeline keeps.",
    )
    parser.add_argument(
        "--cache-root",
        type=Path,
        help="Where each configuration's caches go (default: a temporary "
        "directory, removed at the end).",
    )
    parser.add_argument("--log-dir", type=Path, help="Server logs (default: the cache root).")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", type=Path, help="Write the JSON results here.")
    parser.add_argument("--plot", type=Path, help="Write the PNG plot here.")
    add_server_flags_arg(parser, "-- then server flags common to every configuration.")
    ns = parser.parse_args(argv)
    common = server_flags(ns)
    unknown = [c for c in ns.configs if c not in PRESETS]
    if unknown:
        parser.error(
            f"--configs: unknown preset(s) {', '.join(unknown)}; presets are {', '.join(PRESETS)}"
        )
    if ns.model_path and ns.model_shape:
        parser.error("give --model-path or --model-shape, not both")
    if min(ns.bursts) < 1 or min(ns.steady_concurrency) < 1 or ns.steady_rounds < 1:
        parser.error("--bursts, --steady-concurrency and --steady-rounds must be positive")
    configs = [Configuration(n, PRESETS[n]) for n in ns.configs]
    configs += [Configuration(n, flags) for n, flags in ns.config]
    if ns.attention_backends and any(
        sets_attention_backend(f) for f in (common, *(c.flags for c in configs))
    ):
        parser.error("--attention-backends: leave --attention-backend out of the flags")
    configs = per_attention_backend(configs, ns.attention_backends)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="srt-cold-start-") as tmp:
        root = ns.cache_root or Path(tmp)
        log_dir = ns.log_dir or root
        log_dir.mkdir(parents=True, exist_ok=True)
        model = ["--model-path", ns.model_path] if ns.model_path else []
        if ns.model_shape:
            model = [
                "--model-path",
                str(write_model_shape(ns.model_shape, Path(tmp))),
                "--load-format",
                "dummy",
            ]
        rows: list[dict[str, Any]] = []
        reference_s = import_torch_s()
        result = {
            "machine": machine(),
            "import_torch_s": reference_s,
            "model": ns.model_path or ns.model_shape,
            "common_flags": common,
            "attention_backends": ns.attention_backends,
            "runs": rows,
        }
        runs = [(c, s) for c in configs for s in CACHE_STATES]
        for config, state in tqdm(runs, desc="server starts", unit="start"):
            flags = [*model, *common, *config.server_flags()]
            row = measure_start(config.label, flags, root / config.label, state, ns, log_dir)
            row.update(base_config=config.name, attention=config.attention)
            if "ready_s" in row:
                row["ready_over_import_torch"] = round(row["ready_s"] / reference_s, 2)
                # What the start adds to the import every process with torch pays.
                row["ready_minus_import_torch_s"] = round(row["ready_s"] - reference_s, 3)
            rows.append(row)
            if ns.output_file:  # after every start: a run cut short keeps what it measured
                write_json(ns.output_file, result)
    if ns.plot:
        plot(rows, ns.plot)
    flat = table_rows(rows)
    print(format_table(flat, TABLE))
    print()
    print(format_table(flat, PARTS_TABLE))
    print()
    if ns.attention_backends:
        print(format_table(against_first_backend(rows, ns.attention_backends[0]), BACKEND_TABLE))
        print()
    print(
        format_table(
            [
                {"config": r["config"], "cache": r["cache"], **b}
                for r in rows
                for b in r.get("buckets", [])
            ],
            BUCKET_TABLE,
        )
    )


if __name__ == "__main__":
    main()
