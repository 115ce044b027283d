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

One asyncio process saturates a CPU at some tens of streams, and then the load measures the
client rather than the server. So a run's requests are split across `--client-processes`
spawned client processes (request i goes to process i mod N; each gets an even share of the
concurrency cap, or of the request rate with a seed of its own) and their records merged back
in order. The default, `auto`, takes one process per 16 requests that can be in flight (the
cap, or every request of a run without one), at most half the CPUs (the server needs the
rest), so runs of up to 16 streams stay in this process. Each run records the processes it
used (`client_processes`), their CPU seconds summed per second of the run
(`client_cpu_busy`) and the busiest one's (`client_cpu_busy_max`: near 1, the client was
the bottleneck).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import connection
from multiprocessing.connection import Connection
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
    """What one request saw. Times are `time.perf_counter()` seconds: on Linux the
    system-wide CLOCK_MONOTONIC, so the records of several client processes of one host
    compare (and merge into one run's figures) as they are."""

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
    on_request_done: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Send `specs` (Poisson arrivals at `request_rate` per second; at most `max_concurrency`
    in flight) and return one record per request, in order. Requests still running after
    `max_duration_s` are cancelled and recorded as errors; each has `timeout_s`.
    `on_request_done` is called as each request ends."""
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
        if on_request_done is not None:
            on_request_done()

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


# Streams one client process is given before `auto` adds another: one asyncio process was on
# a CPU 89-97% of a run at 64 and 128 streams, and kept only 5-11 of them in flight.
STREAMS_PER_CLIENT_PROCESS = 16


def client_processes_for_run(
    requested: int | None, max_concurrency: int | None, num_requests: int, cpu_count: int | None
) -> int:
    """The client processes a run uses: `requested` (None: `auto`, one per 16 requests that
    can be in flight, at most half of `cpu_count` as the server on the same host needs the
    rest), never more than the requests that can be in flight, each process driving one at
    least. Without a cap every request may be in flight: all of them at once, or at a rate
    whose overlap depends on the server's latency, which is unknown beforehand, so `auto`
    sizes such a run for the worst case (a process too many only idles)."""
    in_flight = min(max_concurrency or num_requests, num_requests)
    if requested is None:
        most = max(1, (cpu_count or 1) // 2)
        requested = min(math.ceil(in_flight / STREAMS_PER_CLIENT_PROCESS), most)
    return max(1, min(requested, in_flight))


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` as `parts` counts that differ by one at most, the larger first."""
    return [total // parts + (k < total % parts) for k in range(parts)]


@dataclasses.dataclass
class ClientLoad:
    """A run's records, in the order of its specs, and what the load cost the client: the CPU
    seconds of each client process over the run, and the run's wall seconds."""

    records: list[RequestRecord]
    cpu_s: list[float]
    wall_s: float

    def figures(self) -> dict[str, Any]:
        """The client's CPU share of the run, all its processes together and the busiest one
        (the one that saturates first: near 1, the load measured the client)."""
        return {
            "client_processes": len(self.cpu_s),
            "client_cpu_busy": round(sum(self.cpu_s) / self.wall_s, 3),
            "client_cpu_busy_max": round(max(self.cpu_s) / self.wall_s, 3),
        }


def client_load(
    base_url: str,
    specs: Sequence[RequestSpec],
    processes: int,
    *,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    timeout_s: float,
    max_duration_s: float,
    headers: dict[str, str] | None,
) -> ClientLoad:
    """`run_load` of `specs`, in this process (`processes` 1) or split across `processes`
    spawned client processes: request i goes to process i % processes, which gets its share
    of `max_concurrency` (even, one at least) and of `request_rate` with a seed of its own
    (N Poisson streams at rate/N make one at the rate). A client process that fails or dies
    fails the run."""
    common: dict[str, Any] = {
        "timeout_s": timeout_s,
        "max_duration_s": max_duration_s,
        "headers": headers,
    }
    if processes == 1:
        cpu, start = time.process_time(), time.perf_counter()
        records = asyncio.run(
            run_load(
                base_url,
                specs,
                max_concurrency=max_concurrency,
                request_rate=request_rate,
                seed=seed,
                **common,
            )
        )
        return ClientLoad(records, [time.process_time() - cpu], time.perf_counter() - start)
    seeds = random.Random(seed)
    caps = split_evenly(max_concurrency, processes) if max_concurrency else [None] * processes
    shares = [
        dict(
            common,
            max_concurrency=cap,
            request_rate=request_rate / processes,
            seed=seeds.getrandbits(64),
        )
        for cap in caps
    ]
    return load_from_processes(base_url, specs, shares)


def load_from_processes(
    base_url: str, specs: Sequence[RequestSpec], shares: Sequence[dict[str, Any]]
) -> ClientLoad:
    """`run_load` in a spawned client process per share (`run_load`'s settings), request i in
    process i % len(shares); the load starts once every process is up."""
    processes = len(shares)
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    try:
        for k, share in enumerate(shares):
            ours, theirs = ctx.Pipe()
            child = ctx.Process(
                target=client_process,
                args=(theirs, base_url, specs[k::processes], share),
                name=f"bench-client-{k}",
                daemon=True,
            )
            child.start()
            theirs.close()  # the child holds the only other end: EOF means it is gone
            procs.append(child)
            conns.append(ours)
        for _ in receive(procs, conns, until="ready"):  # so that they start together
            pass
        start = time.perf_counter()
        for conn in conns:
            conn.send("go")
        results: dict[int, tuple[list[RequestRecord], float]] = {}
        with tqdm(total=len(specs), desc="requests", unit="req") as bar:
            for k, message in receive(procs, conns, until="records"):
                if message[0] == "records":
                    results[k] = message[1], message[2]
                else:
                    bar.update()
        wall_s = time.perf_counter() - start
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():  # the run failed, or was interrupted
                proc.terminate()
                proc.join()
        for conn in conns:
            conn.close()
    # Back in the specs' order; their times compare as they are (one host's perf_counter).
    records = [results[i % processes][0][i // processes] for i in range(len(specs))]
    return ClientLoad(records, [results[k][1] for k in range(processes)], wall_s)


def receive(
    procs: Sequence[mp.process.BaseProcess], conns: Sequence[Connection], until: str
) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """The client processes' messages as they come, with the sender's index, until each has
    sent `until`; an error one sent, or one's end of its pipe closed early, raises."""
    waiting = dict(enumerate(conns))
    while waiting:
        for readable in connection.wait(list(waiting.values())):
            k = conns.index(readable)
            try:
                message: tuple[Any, ...] = conns[k].recv()
            except EOFError:
                procs[k].join()
                raise RuntimeError(
                    f"client process {k} died (exit code {procs[k].exitcode})"
                ) from None
            if message[0] == "error":
                raise RuntimeError(f"client process {k} failed:\n{message[1]}")
            if message[0] == until:
                del waiting[k]
            yield k, message


def client_process(
    conn: Connection, base_url: str, specs: Sequence[RequestSpec], load: dict[str, Any]
) -> None:
    """Body of a spawned client process: report ready, wait for the go, run its share of the
    load (`load`: `run_load`'s settings), report each request's end, then send its records
    and the CPU seconds the load took it (or the error that stopped it)."""
    # Ctrl-C reaches the whole process group; the bench stops its client processes itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send(("ready",))
        conn.recv()
        cpu = time.process_time()
        records = asyncio.run(
            run_load(
                base_url,
                specs,
                progress=False,
                on_request_done=lambda: conn.send(("request_done",)),
                **load,
            )
        )
        conn.send(("records", records, time.process_time() - cpu))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


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
    ("CPU client", "client_cpu_busy"),  # all its processes together
    ("client procs", "client_processes"),
    ("CPU client max", "client_cpu_busy_max"),  # its busiest process
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
        processes = client_processes_for_run(
            ns.client_processes, concurrency or None, num, os.cpu_count()
        )
        before = server_info(base_url, headers)
        load = client_load(
            base_url,
            specs,
            processes,
            max_concurrency=concurrency or None,
            request_rate=ns.request_rate,
            seed=ns.seed,
            timeout_s=ns.timeout,
            max_duration_s=ns.max_duration,
            headers=headers,
        )
        rate = ns.request_rate if math.isfinite(ns.request_rate) else None  # None: at once
        runs.append(
            {
                "max_concurrency": concurrency or None,
                "request_rate": rate,
                "input_len": ns.input_len,
                "output_len": ns.output_len,
                "range_ratio": ns.range_ratio,
                **metrics(load.records),
                **after_run(base_url, before, headers),
                # The client's own share: a saturated client under-reports the server.
                **load.figures(),
            }
        )
    return runs


def client_processes_arg(text: str) -> int | None:
    """`--client-processes`: a count of one or more, or `auto` (None)."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', not {text!r}")
    return int(text)


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
    parser.add_argument(
        "--client-processes",
        type=client_processes_arg,
        default="auto",
        help="Client processes each run's requests are split across (default auto: one per "
        f"{STREAMS_PER_CLIENT_PROCESS} requests that can be in flight, the cap or every "
        "request without one, at most half the CPUs; never more than can be in flight).",
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
