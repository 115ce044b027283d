"""Load against the HTTP API: streaming `/generate` requests of random token ids, sent at a
Poisson rate or with a cap on the requests in flight; TTFT, TPOT, ITL and end-to-end latency
(mean, p50, p90, p99), request and token throughput, errors.

    python -m srt.bench.serving --base-url http://127.0.0.1:30000 --num-prompts 64 \\
        --max-concurrency 1 16 64 --input-len 128 --output-len 64 --output-file serving.json
    python -m srt.bench.serving --num-prompts 32 --max-concurrency 8 -- --model-path DIR ...

Without `--base-url` it starts a server itself with the flags after `--` and stops it at the
end. Prompts are token ids (any tokenizer works: the model's vocabulary size comes from the
server), `--input-len` long, or uniform in [ratio x len, len] with `--range-ratio`; every
request asks for exactly `--output-len` tokens (`ignore_eos`), and a request that gets any
other count is counted as an error. Several `--max-concurrency` values run one after another
on the same server. A JSON file and a table, printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from srt.bench.report import format_table, machine, summary, write_json
from srt.bench.server_process import ServerProcess, add_server_flags_arg, server_flags


@dataclasses.dataclass
class RequestSpec:
    input_ids: list[int]
    output_len: int


@dataclasses.dataclass
class RequestRecord:
    """What one request saw. Times are `time.perf_counter()` seconds."""

    input_len: int
    output_len: int  # asked for
    sent: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per token
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # one per event
    done: float | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two): unlike the
        event gaps, the same whether the stream sent a token per event or several."""
        if self.output_tokens < 2:
            return None
        return ((self.done or self.sent) - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between the events that brought tokens (one per decode step while the
        server's stream keeps up; one that falls behind sends several steps' tokens at once)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 1.0,
    seed: int = 0,
) -> list[RequestSpec]:
    """`num` prompts of random token ids, `input_len` long (or uniform in
    [range_ratio * input_len, input_len]), each asking for `output_len` tokens."""
    rng = random.Random(seed)
    low = max(1, math.ceil(input_len * range_ratio))
    return [
        RequestSpec(
            [rng.randrange(vocab_size) for _ in range(rng.randint(low, input_len))], output_len
        )
        for _ in range(num)
    ]


async def send_request(
    client: httpx.AsyncClient, base_url: str, spec: RequestSpec, record: RequestRecord
) -> None:
    """One streaming `/generate` request, greedy, exactly `output_len` tokens; fills `record`
    (an HTTP error, an error event or a wrong token count becomes `record.error`)."""
    body = {
        "input_ids": spec.input_ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": spec.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    }
    record.sent = time.perf_counter()
    seen = 0
    try:
        async with client.stream("POST", f"{base_url}/generate", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = orjson.loads(line[6:])
                if "error" in event:
                    record.error = f"error event: {event['error'].get('message')}"
                    return
                count = len(event["output_ids"])  # /generate streams all ids so far
                if count > seen:
                    record.token_times += [now] * (count - seen)
                    record.chunk_times.append(now)
                    seen = count
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
        return
    finally:
        record.done = time.perf_counter()
    if record.output_tokens != spec.output_len:
        record.error = f"got {record.output_tokens} tokens, asked for {spec.output_len}"


async def run_load(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    timeout_s: float = 300.0,
    max_duration_s: float = math.inf,
    headers: dict[str, str] | None = None,
    progress: bool = True,
) -> list[RequestRecord]:
    """Send `specs` (Poisson arrivals at `request_rate` per second; at most `max_concurrency`
    in flight) and return one record per request, in order. Requests still running after
    `max_duration_s` are cancelled and recorded as errors; each has `timeout_s`."""
    rng = random.Random(seed)
    limit = max_concurrency or len(specs) or 1
    gate = asyncio.Semaphore(limit)
    records = [RequestRecord(len(s.input_ids), s.output_len) for s in specs]
    bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not progress)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    async def one(client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord) -> None:
        async with gate:
            await send_request(client, base_url, spec, record)
        bar.update()

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        tasks = []
        for spec, record in zip(specs, records, strict=True):
            tasks.append(asyncio.create_task(one(client, spec, record)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        _, pending = await asyncio.wait(tasks, timeout=max_duration_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    bar.close()
    for record in records:
        if record.done is None or (
            record.error is None and record.output_tokens < record.output_len
        ):
            record.error = record.error or f"cancelled after --max-duration {max_duration_s} s"
    return records


def metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The load's figures: latency summaries over the completed requests (ms), throughput
    over the wall time from the first send to the last answer, errors."""
    ok = [r for r in records if r.ok]
    started = min((r.sent for r in records), default=0.0)
    ended = max((r.done or r.sent for r in records), default=0.0)
    duration = max(ended - started, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in records if not r.ok]
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(e for e in errors if e))[:5],
        "duration_s": round(duration, 3),
        "total_input_tokens": sum(r.input_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(output_tokens / duration, 1),
        "ttft_ms": summary([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        "tpot_ms": summary([r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        "itl_ms": summary([gap * 1000 for r in ok for gap in r.itl_s]),
        "e2e_ms": summary([((r.done or r.sent) - r.sent) * 1000 for r in ok]),
    }


def server_info(
    base_url: str, headers: dict[str, str] | None = None, timeline_since: float | None = None
) -> dict[str, Any]:
    params = {} if timeline_since is None else {"timeline_since": timeline_since}
    resp = httpx.get(f"{base_url}/get_server_info", headers=headers, params=params, timeout=30)
    resp.raise_for_status()
    info: dict[str, Any] = resp.json()
    return info


def vocab_size_of(base_url: str, headers: dict[str, str] | None = None) -> int:
    return int(server_info(base_url, headers)["model"]["vocab_size"])


PROCESSES = ("scheduler", "runner", "tokenizer")


def after_run(
    base_url: str, before: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """What the server says once a run is done: the KV slots requests still hold (none, if
    every finished request gave its slots back; the prefix cache's are apart), its per-step
    timeline, per process, over the steps begun since the run began (`before`, the server
    info taken then; of a run longer than the 1024 steps a timeline keeps, the last), and
    the share of the run's wall time each process spent on a CPU (near 1: it was the
    bottleneck, or spinning)."""
    info = server_info(base_url, headers, timeline_since=before["clock_s"])
    scheduler = info["scheduler"]
    wall = info["clock_s"] - before["clock_s"]
    return {
        "kv_slots_held_after": scheduler["kv_slots_used"] - scheduler["kv_slots_cached"],
        "kv_slots_cached_after": scheduler["kv_slots_cached"],
        "timeline": {proc: info[proc].get("timeline") for proc in PROCESSES},
        "cpu_busy": {
            proc: round((cpu_s(info, proc) - cpu_s(before, proc)) / wall, 3) for proc in PROCESSES
        },
    }


def cpu_s(info: dict[str, Any], proc: str) -> float:
    return float(info[proc]["timeline"]["cpu_s"])


TABLE = [
    ("conc", "max_concurrency"),
    ("rate", "request_rate"),
    ("done", "completed"),
    ("errors", "errors"),
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
    ("TTFT p50", "ttft_p50"),
    ("TTFT p99", "ttft_p99"),
    ("TPOT p50", "tpot_p50"),
    ("ITL p50", "itl_p50"),
    ("ITL p99", "itl_p99"),
    ("E2E p50", "e2e_p50"),
    ("KV held after", "kv_slots_held_after"),
    # Where the time went: the server's decode batch, its extend (prefill) steps and their
    # share of the run, and whether a process (or this client) was on a CPU all along.
    ("decode bs", "decode_bs"),
    ("extend steps", "extend_steps"),
    ("extend time %", "extend_share"),
    ("CPU sched", "cpu_scheduler"),
    ("CPU runner", "cpu_runner"),
    ("CPU tok", "cpu_tokenizer"),
    ("CPU client", "client_cpu_busy"),
]


def table_row(run: dict[str, Any]) -> dict[str, Any]:
    """A run's row of the printed table (latencies in ms)."""
    sched = (run.get("timeline") or {}).get("scheduler") or {}
    total = sched.get("extend_ms_total", 0.0) + sched.get("decode_ms_total", 0.0)
    return {
        **run,
        "decode_bs": sched.get("decode_requests_mean"),
        "extend_steps": sched.get("extend_steps"),
        "extend_share": round(100 * sched.get("extend_ms_total", 0.0) / total, 1)
        if total
        else None,
        **{f"cpu_{proc}": share for proc, share in (run.get("cpu_busy") or {}).items()},
        **{
            f"{m}_{p}": run[f"{m}_ms"][p]
            for m in ("ttft", "tpot", "itl", "e2e")
            for p in ("p50", "p99")
        },
    }


def bench(
    base_url: str, ns: argparse.Namespace, headers: dict[str, str] | None
) -> list[dict[str, Any]]:
    vocab = vocab_size_of(base_url, headers)
    counts = (
        ns.num_prompts * len(ns.max_concurrency) if len(ns.num_prompts) == 1 else ns.num_prompts
    )
    if ns.warmup_requests:
        warm = random_requests(
            ns.warmup_requests, ns.input_len, ns.output_len, vocab, seed=ns.seed + 1
        )
        asyncio.run(run_load(base_url, warm, headers=headers, progress=False))
    runs = []
    for concurrency, num in zip(ns.max_concurrency, counts, strict=True):
        specs = random_requests(num, ns.input_len, ns.output_len, vocab, ns.range_ratio, ns.seed)
        before = server_info(base_url, headers)
        client_cpu, client_wall = time.process_time(), time.perf_counter()
        records = asyncio.run(
            run_load(
                base_url,
                specs,
                max_concurrency=concurrency or None,
                request_rate=ns.request_rate,
                seed=ns.seed,
                timeout_s=ns.timeout,
                max_duration_s=ns.max_duration,
                headers=headers,
            )
        )
        rate = ns.request_rate if math.isfinite(ns.request_rate) else None  # None: at once
        runs.append(
            {
                "max_concurrency": concurrency or None,
                "request_rate": rate,
                "input_len": ns.input_len,
                "output_len": ns.output_len,
                "range_ratio": ns.range_ratio,
                **metrics(records),
                **after_run(base_url, before, headers),
                # This client's own share: a saturated client under-reports the server.
                "client_cpu_busy": round(
                    (time.process_time() - client_cpu) / (time.perf_counter() - client_wall), 3
                ),
            }
        )
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.bench.serving", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--base-url",
        help="A running server (default: start one with the server flags given after --).",
    )
    parser.add_argument("--api-key", help="The server's --api-key.")
    parser.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=[64],
        help="Requests per run: one value, or one per --max-concurrency.",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=[0],
        help="Most requests in flight, one run per value (0: no cap).",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default inf: all at once).",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="Prompt lengths uniform in [ratio x input-len, input-len].",
    )
    parser.add_argument(
        "--warmup-requests", type=int, default=1, help="Untimed requests before the first run."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds per request.")
    parser.add_argument(
        "--max-duration",
        type=float,
        default=math.inf,
        help="Seconds per run; requests still open then are cancelled.",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="Seconds to wait for a server this tool starts.",
    )
    parser.add_argument("--output-file", type=Path, help="Write the JSON results here.")
    parser.add_argument(
        "--server-log",
        type=Path,
        help="Keep the log of the server this starts here (default: dropped after the run).",
    )
    add_server_flags_arg(parser, "-- then the flags of the server to start (without --base-url).")
    ns = parser.parse_args(argv)
    flags = server_flags(ns)
    if ns.base_url and flags:
        parser.error("give either --base-url or server flags after --, not both")
    if min(ns.num_prompts) < 1 or ns.input_len < 1 or ns.output_len < 1:
        parser.error("--num-prompts, --input-len and --output-len must be positive")
    if len(ns.num_prompts) not in (1, len(ns.max_concurrency)):
        parser.error("--num-prompts takes one value or one per --max-concurrency value")
    if not 0 < ns.range_ratio <= 1 or ns.request_rate <= 0 or min(ns.max_concurrency) < 0:
        parser.error(
            "--range-ratio must be in (0, 1], --request-rate positive, --max-concurrency at least 0"
        )
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else None
    result: dict[str, Any] = {"machine": machine(), "base_url": ns.base_url, "server_flags": flags}
    if ns.base_url:
        result["runs"] = bench(ns.base_url.rstrip("/"), ns, headers)
    else:
        with (
            tempfile.TemporaryDirectory() as tmp,
            ServerProcess(
                flags, ns.server_log or Path(tmp) / "server.log", api_key=ns.api_key
            ) as server,
        ):
            result["server_ready_s"] = round(server.wait_ready(ns.ready_timeout), 3)
            result["runs"] = bench(server.url, ns, server.headers)
    if ns.output_file:
        write_json(ns.output_file, result)
    print(format_table([table_row(r) for r in result["runs"]], TABLE))


if __name__ == "__main__":
    main()
