"""Load against the HTTP API: streaming `/generate` requests of random token ids, sent at a
Poisson rate or with a cap on the requests in flight, one run per `--max-concurrency` value on
the same server. Per run: latency and throughput over the whole run and over its steady part,
what the server did meanwhile, and the runner ceiling the throughput is a fraction of. A JSON
file and a table, printed last.

    python -m srt.bench.serving --max-concurrency 1 32 64 128 --input-len 128 --output-len 64 \\
        --output-file serving.json -- --model-path DIR --cuda-graph-backend-decode full
    python -m srt.bench.serving --base-url http://127.0.0.1:30000 --max-concurrency 1 64 \\
        --runner-results runner.jsonl

Without `--base-url` it first measures the runner ceiling (below), then starts a server with the
flags after `--` and stops it at the end.

**Prompts.** Token ids (any tokenizer works: the vocabulary size comes from the server),
`--input-len` long, or uniform in [ratio x len, len] with `--range-ratio`; every request asks
for exactly `--output-len` tokens (`ignore_eos`), and one that gets any other count is an error.
Every prompt of a call, warm-up and runs, is its own: each run draws from a seed derived from
`--seed` and its index (the warm-up's from `--seed` and its burst), and a prompt whose first 4
tokens an earlier one of the call begins with is drawn again, so that no two prompts share more
than 3 leading tokens and the server's prefix cache serves no run (`prompts` in the JSON holds
the longest prefix two prompts share; `cached_tokens_in_window` what the cache served).
`--shared-prefix-len N` asks for the other workload: every prompt starts with the same N tokens
(column `prefix`), then its own.

**Requests per run.** `--num-prompts`, when given, is what each run sends. By default a run
sends 64 requests, and one in which more than 16 can be in flight (a cap above 16, or none) at
least `--min-requests-per-level` (1,024): a count, not a duration, so that the runs of one call
are the same work whatever the server's speed. At 64 output tokens, 128 requests at concurrency
128 last about a second, most of it ramp-up and tail.

**Warm-up.** Before the first timed run, untimed bursts of concurrent requests with the runs'
prompt lengths and `--warmup-output-len` tokens: one per run, of as many requests as the run
can have in flight, and one per decode bucket of the server (`graphs.decode.buckets` of
`/get_server_info`) up to the largest of those, since a run's batch passes through the smaller
buckets on its way up and down. Then up to three passes for every bucket a run can reach that
the server still lists as unmet: a decode bucket by a burst again (a burst does not meet its
bucket for certain: its first requests can finish before its last begin), a prefill bucket
by one `/generate` call of as many fresh prompts as fit it together (one call's prompts are
prefilled in one step; a run's prefill steps take however many requests arrived meanwhile,
up to the largest bucket); `passes` and `unmet` in the JSON. Lazy captures and first
compiles then happen before timing; `warmup` in the JSON counts those it caused (`captured`
names them). `--no-warmup` skips it.

**A profile of the runner** (`--profile-steps N`): the server's runner records N steps of
each run under `torch.profiler`, from `--profile-delay` seconds after the run's window opens
(`/start_profile`, `/stop_profile`); `runner_profile` in the run's JSON holds the trace file
and its summary per step (the device's span and busy time, kernels, the launch's host time,
the top kernels and host calls), a line of the notes the same. The profiler slows the host,
and its start and end each drain the steps in flight: a profiled call is for seeing where the
time goes, its figures are not the unprofiled ones.

**The load window** of a run opens when every client process is up, right before they are told
to go, and closes when the run's last request ends; the server's `/get_server_info` is taken at
both ends. Over that window:

- `cpu_busy`: each server process's CPU seconds per second of the window (near 1: the process
  was the bottleneck, or spinning); with several tokenizer workers also the busiest worker's
  (`tokenizer_workers_max`) and all of theirs (`tokenizer_workers_total`);
  `client_cpu_busy` the client processes' together,
  `client_cpu_busy_max` the busiest one's (near 1: the load measured the client);
- `timeline`: each process's step timeline over the steps begun in the window (of a window of
  more steps than a timeline keeps, 16,384, the last: `timeline_kept`, the `steps kept`
  column, says what share each kept); `decode bs` is the scheduler's mean decode
  batch (`kinds.decode.requests_mean`), `extend steps` and `extend time %` its prefill steps
  and their share of the step time; `step ms` the median period of a decode step on the
  device (the runner's CUDA events, `kinds.decode.medians_ms.device_period`), and `turn p50`
  (p10, p90) the scheduler's loop turns that launched a decode: with steps in flight a turn
  is not a step's period (results queued behind one another arrive in pairs, so turns
  alternate between waiting and not); `tokenizer_requests_by_worker` each tokenizer worker's
  requests begun in the window, as a timeline of their marks (arrived, sent to the
  scheduler, first token back, finished), and `tokenizer_requests` the one of the worker that
  served the most, whose `sent_to_first_token` median is the `TTFT in server` column: the
  time to first token less the HTTP stack's and the client's;
- `captures_in_window`, `jit_misses_in_window`: the CUDA graphs the runner captured and its JIT
  compiles after ready (`runner.graph_pool.captures`, `runner.jit_misses.count`): a figure paid
  for one of them is not the steady state's. `cached_tokens_in_window`: prompt tokens the prefix
  cache served (`scheduler.cached_tokens`).

**Whole-run figures**, over the run's requests (latencies: the completed ones), throughput over
the time from the first send to the last answer (`duration_s`): `request_throughput`,
`output_throughput` (tokens per second) and the latency summaries (mean, p50, p90, p99, ms):

- `ttft_ms`: from the send to the first token;
- `tpot_ms` (TPOT): a request's time after its first token per token after the first, the
  same whatever number of tokens the stream's events carried;
- `itl_ms` (ITL per event): the gaps between a stream's consecutive events. One decode step
  while the stream keeps up; a stream that falls behind gets several steps' tokens in one
  event, and fewer, longer gaps;
- `itl_token_ms` (ITL per token, as SGLang's bench reports ITL): each event's gap divided by
  the tokens it carried, once per token (the first event's tokens are the TTFT's);
- `e2e_ms`: from the send to the end of the stream.

**Steady figures** (`steady`): the same over the part of the run where the requests in flight
were at the cap (without a cap: at their peak), from the first moment they reached it to the
last moment they fell below it, which leaves out the ramp-up and the tail. Its throughputs
count the tokens and the request ends inside it per second of it (`duration_s`), its latencies
are those of the requests sent and finished inside it, `in_flight_mean` is the mean number in
flight over it. None when the run never had the cap in flight.

**Runner ceiling** (`runner_ceiling`, see `srt.bench.runner_ceiling`): B * output_len * 1000 /
(prefill_ms(B prompts) + output_len * decode_ms(B)) tok/s at the run's mean decode batch B, from
`srt.bench.one_batch` figures measured in the same call: without `--base-url`, this runs
one_batch with the server's flags at the input and output length of the runs, at batch 1 and
at each run's in-flight count, before it starts the server; with it, from `--runner-results`
(one_batch's JSON lines, of the same machine, configuration and input length). `of ceiling`
is each served throughput, whole run and steady, as a fraction of it; without runner figures
the columns are empty and a line above the table says why.

**Client processes.** One asyncio process saturates a CPU at some tens of streams, and then the
load measures the client rather than the server. So a run's requests are split across
`--client-processes` spawned client processes (request i goes to process i mod N; each gets an
even share of the concurrency cap, or of the request rate with a seed of its own) and their
records merged back in order. The default, `auto`, takes one process per 8 requests that can
be in flight (the cap, or every request of a run without one), at most half the CPUs (the
server needs the rest), so runs of up to 8 streams stay in this process. Each run records the
processes it used (`client_processes`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import multiprocessing as mp
import os
import random
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing import connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from srt.bench import runner_ceiling
from srt.bench.report import format_table, machine, summary, write_json
from srt.bench.runner_ceiling import RunnerFigures
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

    @property
    def itl_token_s(self) -> list[float]:
        """SGLang's ITL: each event's gap (`itl_s`) divided by the tokens the event brought,
        once per token; the first event's tokens have none (they are the TTFT's)."""
        # An event's tokens all carry its time.
        tokens_per_event = [len(list(same)) for _, same in itertools.groupby(self.token_times)]
        return [
            gap / tokens
            for gap, tokens in zip(self.itl_s, tokens_per_event[1:], strict=True)
            for _ in range(tokens)
        ]


# ---- prompts -------------------------------------------------------------------------------

# Two prompts of one call differ within the first DISTINCT_HEAD tokens after the shared prefix
# (when one is asked for), so the prefix cache serves any prompt at most DISTINCT_HEAD - 1 of
# those tokens from another's.
DISTINCT_HEAD = 4
_MAX_DRAWS = 100  # per prompt, before its space of heads counts as used up


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 1.0,
    seed: int | str = 0,
    *,
    prefix: Sequence[int] = (),
    heads: set[tuple[int, ...]] | None = None,
) -> list[RequestSpec]:
    """`num` prompts of random token ids, `input_len` long (or uniform in
    [range_ratio * input_len, input_len]), each asking for `output_len` tokens. Each starts with
    `prefix`, then tokens of its own. `heads` (the first DISTINCT_HEAD of those of the prompts
    drawn before; this adds the new ones) makes them distinct: a prompt that begins like an
    earlier one is drawn again; ValueError when that keeps happening (too short, too small a
    vocabulary)."""
    rng = random.Random(seed)
    low = max(len(prefix) + 1, math.ceil(input_len * range_ratio))
    specs = []
    for _ in range(num):
        length = rng.randint(low, input_len) - len(prefix)
        for _ in range(_MAX_DRAWS):
            own = [rng.randrange(vocab_size) for _ in range(length)]
            head = tuple(own[:DISTINCT_HEAD])
            if heads is None or head not in heads:
                break
        else:
            raise ValueError(
                f"no distinct prompt of {length} own tokens left in a vocabulary of {vocab_size}"
            )
        if heads is not None:
            heads.add(head)
        specs.append(RequestSpec([*prefix, *own], output_len))
    return specs


def longest_shared_prefix(prompts: Iterable[Sequence[int]]) -> int:
    """The most leading tokens two of `prompts` have in common (0 with fewer than two): in
    sorted order the longest common prefix is that of some neighbours."""
    ordered = sorted(tuple(p) for p in prompts)
    longest = 0
    for a, b in itertools.pairwise(ordered):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        longest = max(longest, min(len(a), len(b)) if same is None else same)
    return longest


# ---- one client process's load -------------------------------------------------------------


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
    except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError) as e:
        # Anything that breaks the stream is the request's error, never the run's: a run
        # reports what failed and how, and goes on.
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
    seed: int | str = 0,
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
        try:
            async with gate:
                await send_request(client, base_url, spec, record)
        finally:
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
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    bar.close()
    for record, outcome in zip(records, outcomes, strict=True):
        if isinstance(outcome, Exception):  # a client bug, named rather than lost
            record.error = record.error or f"client failed: {type(outcome).__name__}: {outcome}"
    for record in records:
        if record.done is None or (
            record.error is None and record.output_tokens < record.output_len
        ):
            record.error = record.error or f"cancelled after --max-duration {max_duration_s} s"
    return records


# ---- a run's load, from one or several client processes ------------------------------------

# Streams one client process is given before `auto` adds another: one asyncio process was on
# a CPU 89-97% of a run at 64 and 128 streams, and kept only 5-11 of them in flight; at 16
# streams of one token an event (two tokenizer workers at concurrency 32, r14d) each of two
# processes was on a CPU 0.98 of the run, the client's limit rather than the server's.
STREAMS_PER_CLIENT_PROCESS = 8


def most_in_flight(max_concurrency: int | None, num_requests: int) -> int:
    """The most requests a run can have in flight: its cap (None: none), or all of them."""
    return min(max_concurrency or num_requests, num_requests)


def client_processes_for_run(
    requested: int | None, max_concurrency: int | None, num_requests: int, cpu_count: int | None
) -> int:
    """The client processes a run uses: `requested` (None: `auto`, one per 8 requests that
    can be in flight, at most half of `cpu_count` as the server on the same host needs the
    rest), never more than the requests that can be in flight, each process driving one at
    least. Without a cap every request may be in flight: all of them at once, or at a rate
    whose overlap depends on the server's latency, which is unknown beforehand, so `auto`
    sizes such a run for the worst case (a process too many only idles)."""
    in_flight = most_in_flight(max_concurrency, num_requests)
    if requested is None:
        most = max(1, (cpu_count or 1) // 2)
        requested = min(math.ceil(in_flight / STREAMS_PER_CLIENT_PROCESS), most)
    return max(1, min(requested, in_flight))


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` as `parts` counts that differ by one at most, the larger first."""
    return [total // parts + (k < total % parts) for k in range(parts)]


class LoadWindow:
    """The timed window of a load: it opens right before the client processes are told to go
    (every one is up) and closes as the load's last request ends. `sample`, given the
    `clock_s` of the opening sample (None for the opening itself), takes the server's info at
    both ends: `before` and `after`, the latter's timelines over the steps of the window."""

    def __init__(self, sample: Callable[[float | None], dict[str, Any]] | None = None) -> None:
        self.sample = sample
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None
        self.opened = self.closed = math.nan  # perf_counter seconds
        # This process's CPU clock at both ends: the client's, when the load runs in it.
        self.cpu_opened = self.cpu_closed = math.nan

    def open(self) -> None:
        if self.sample is not None:
            self.before = self.sample(None)
        self.opened, self.cpu_opened = time.perf_counter(), time.process_time()

    def close(self) -> None:
        """Close the window (once: a later call does nothing)."""
        if not math.isnan(self.closed):
            return
        self.closed, self.cpu_closed = time.perf_counter(), time.process_time()
        if self.sample is not None and self.before is not None:
            self.after = self.sample(self.before["clock_s"])

    @property
    def seconds(self) -> float:
        return self.closed - self.opened


@dataclasses.dataclass
class ClientLoad:
    """A run's records, in the order of its specs, and what the load cost the client: the CPU
    seconds of each client process over the load, and the load window's seconds."""

    records: list[RequestRecord]
    cpu_s: list[float]
    wall_s: float

    def figures(self) -> dict[str, Any]:
        """The client's CPU share of the load window, all its processes together and the
        busiest one (the one that saturates first: near 1, the load measured the client)."""
        return {
            "load_window_s": round(self.wall_s, 3),
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
    seed: int | str,
    timeout_s: float,
    max_duration_s: float,
    headers: dict[str, str] | None,
    window: LoadWindow | None = None,
    progress: bool = True,
) -> ClientLoad:
    """`run_load` of `specs`, in this process (`processes` 1) or split across `processes`
    spawned client processes: request i goes to process i % processes, which gets its share
    of `max_concurrency` (even, one at least) and of `request_rate` with a seed of its own
    (N Poisson streams at rate/N make one at the rate). `window` (a new one by default) is
    opened once every process is up and closed as the last request ends. A client process
    that fails or dies fails the run."""
    window = LoadWindow() if window is None else window
    common: dict[str, Any] = {
        "timeout_s": timeout_s,
        "max_duration_s": max_duration_s,
        "headers": headers,
    }
    if processes == 1:
        ended = 0

        def request_done() -> None:
            nonlocal ended
            ended += 1
            if ended == len(specs):
                window.close()

        window.open()
        records = asyncio.run(
            run_load(
                base_url,
                specs,
                max_concurrency=max_concurrency,
                request_rate=request_rate,
                seed=seed,
                progress=progress,
                on_request_done=request_done,
                **common,
            )
        )
        window.close()  # if a request was cancelled, the last did not end
        return ClientLoad(records, [window.cpu_closed - window.cpu_opened], window.seconds)
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
    return load_from_processes(base_url, specs, shares, window, progress)


def load_from_processes(
    base_url: str,
    specs: Sequence[RequestSpec],
    shares: Sequence[dict[str, Any]],
    window: LoadWindow,
    progress: bool = True,
) -> ClientLoad:
    """`run_load` in a spawned client process per share (`run_load`'s settings), request i in
    process i % len(shares); the load (and `window`) starts once every process is up."""
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
        window.open()
        for conn in conns:
            conn.send("go")
        results: dict[int, tuple[list[RequestRecord], float]] = {}
        ended = 0
        with tqdm(total=len(specs), desc="requests", unit="req", disable=not progress) as bar:
            for k, message in receive(procs, conns, until="records"):
                if message[0] == "records":
                    results[k] = message[1], message[2]
                else:
                    bar.update()
                    ended += 1
                    if ended == len(specs):
                        window.close()
        window.close()  # if a request was cancelled, the last did not end
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
    return ClientLoad(records, [results[k][1] for k in range(processes)], window.seconds)


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


# ---- a run's figures -----------------------------------------------------------------------


def latency_figures(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """The latency summaries (ms) of completed requests: TTFT, TPOT, ITL per event and per
    token, end to end."""
    return {
        "ttft_ms": summary([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        "tpot_ms": summary([r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        "itl_ms": summary([gap * 1000 for r in ok for gap in r.itl_s]),
        "itl_token_ms": summary([gap * 1000 for r in ok for gap in r.itl_token_s]),
        "e2e_ms": summary([((r.done or r.sent) - r.sent) * 1000 for r in ok]),
    }


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
        **latency_figures(ok),
    }


def in_flight_steps(records: Sequence[RequestRecord]) -> list[tuple[float, int]]:
    """The requests in flight after each send and each end of the sent requests, in time
    order (at one instant, ends before sends)."""
    sent = [r for r in records if r.sent and r.done is not None]
    events = sorted([(r.sent, 1) for r in sent] + [(r.done or 0.0, -1) for r in sent])
    counts = itertools.accumulate(step for _, step in events)
    return [(t, count) for (t, _), count in zip(events, counts, strict=True)]


def steady_window(records: Sequence[RequestRecord], cap: int | None) -> tuple[float, float] | None:
    """(start, end) of the part of a run where the requests in flight were at `cap` (at most
    the run's requests; None: at their peak): from the first moment they reached it to the
    last moment they fell below it, leaving out the ramp-up and the tail. None if they never
    reached it, or fell below it for good at once."""
    steps = in_flight_steps(records)
    if not steps:
        return None
    target = min(cap, len(records)) if cap else max(count for _, count in steps)
    start = end = None
    before = 0
    for t, count in steps:
        if start is None and count >= target:
            start = t
        elif start is not None and before >= target > count:
            end = t
        before = count
    if start is None or end is None or end <= start:
        return None
    return start, end


def mean_in_flight(steps: Sequence[tuple[float, int]], start: float, end: float) -> float:
    """The mean of the requests in flight (`in_flight_steps`) over [start, end]."""
    total = 0.0
    for (t0, count), (t1, _) in itertools.pairwise(steps):
        total += count * max(0.0, min(t1, end) - max(t0, start))
    return total / (end - start)


def steady_figures(records: Sequence[RequestRecord], cap: int | None) -> dict[str, Any] | None:
    """The run's figures over its steady window (`steady_window`; None without one): the
    tokens and request ends inside it per second of it, the latencies of the requests sent
    and finished inside it, the mean in flight."""
    window = steady_window(records, cap)
    if window is None:
        return None
    start, end = window
    duration = end - start
    ok = [r for r in records if r.ok]
    inside = [r for r in ok if r.sent >= start and r.done is not None and r.done <= end]
    tokens = sum(start <= t <= end for r in ok for t in r.token_times)
    ends = sum(r.done is not None and start < r.done <= end for r in ok)
    return {
        "start_s": round(start - min(r.sent for r in records if r.sent), 3),
        "duration_s": round(duration, 3),
        "in_flight_mean": round(mean_in_flight(in_flight_steps(records), start, end), 2),
        "requests": len(inside),
        "output_tokens": tokens,
        "request_throughput": round(ends / duration, 3),
        "output_throughput": round(tokens / duration, 1),
        **latency_figures(inside),
    }


# ---- what the server says ------------------------------------------------------------------


def server_info(
    base_url: str, headers: dict[str, str] | None = None, timeline_since: float | None = None
) -> dict[str, Any]:
    params = {} if timeline_since is None else {"timeline_since": timeline_since}
    resp = httpx.get(f"{base_url}/get_server_info", headers=headers, params=params, timeout=30)
    resp.raise_for_status()
    info: dict[str, Any] = resp.json()
    return info


# Answers asked for per worker before `requests_by_worker` gives up on one: the kernel hashes
# each new connection to a worker, so a worker is missed k times in a row with odds 2^-k
# (two workers).
REQUESTS_TRIES_PER_WORKER = 8


def requests_by_worker(
    base_url: str, headers: dict[str, str] | None, since: float, info: dict[str, Any]
) -> dict[str, Any]:
    """Each tokenizer worker's own requests begun since `since` (`tokenizer.requests` of an
    answer from it), by worker: `info` came from whichever worker the kernel gave the
    connection, so the others are asked again, a new connection each time (a few tries per
    worker), until each has answered."""
    workers = max(1, len(info["tokenizer"].get("workers_cpu_s") or {}))
    seen = {info["tokenizer"].get("worker", 0): info["tokenizer"].get("requests")}
    for _ in range(REQUESTS_TRIES_PER_WORKER * workers):
        if len(seen) >= workers:
            break
        other = server_info(base_url, headers, since)["tokenizer"]
        seen.setdefault(other.get("worker", 0), other.get("requests"))
    return {str(worker): requests for worker, requests in sorted(seen.items())}


PROCESSES = ("scheduler", "runner", "tokenizer")
# Counters of the server's info: graphs the runner captured, its JIT compiles after ready, the
# prompt tokens the prefix cache served.
CAPTURES = ("runner", "graph_pool", "captures")
JIT_MISSES = ("runner", "jit_misses", "count")
CACHED_TOKENS = ("scheduler", "cached_tokens")


def nested(info: dict[str, Any], path: Sequence[str]) -> Any:
    """`info[path[0]][path[1]]...`, None where a level is missing."""
    value: Any = info
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def growth(before: dict[str, Any], after: dict[str, Any], *path: str) -> int | None:
    """How much a counter of the server's info (at `path`) grew from `before` to `after`;
    None where the server does not report it."""
    first, last = nested(before, path), nested(after, path)
    return last - first if isinstance(first, int) and isinstance(last, int) else None


def new_captures(before: dict[str, Any], after: dict[str, Any]) -> list[str] | None:
    """The labels of the graphs captured from `before` to `after` ("decode bucket 8"); None
    where the server does not name them."""
    first = nested(before, (*CAPTURES[:-1], "captured"))
    last = nested(after, (*CAPTURES[:-1], "captured"))
    if not isinstance(first, list) or not isinstance(last, list):
        return None
    seen = set(first)
    return [label for label in last if label not in seen]


def step_kind(timeline: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """A step timeline's figures of one step kind (`extend`, `decode`): its `steps`,
    `requests_mean`, `tokens_mean` and `ms_total`; empty where it had none. Older results
    files hold them flat (`decode_steps`, ...)."""
    timeline = timeline or {}
    if "kinds" in timeline:
        return dict(timeline["kinds"].get(kind) or {})
    fields = ("steps", "requests_mean", "tokens_mean", "ms_total")
    return {f: timeline[f"{kind}_{f}"] for f in fields if f"{kind}_{f}" in timeline}


def cpu_s(info: dict[str, Any], proc: str) -> float:
    return float(info[proc]["timeline"]["cpu_s"])


def tokenizer_workers_cpu_s(info: dict[str, Any]) -> dict[str, float]:
    """Every tokenizer worker's CPU seconds, by name (servers before the workers: none)."""
    return dict(info["tokenizer"].get("workers_cpu_s") or {})


def timeline_kept(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Per step process (scheduler, runner), the share of the steps it began in the window
    that its timeline kept for `after`'s summary (a ring: 1 unless the window outgrew it).
    Not the tokenizer's: with several workers, two answers may come from two of them."""
    kept = {}
    for proc in ("scheduler", "runner"):
        first, last = before[proc].get("timeline") or {}, after[proc].get("timeline") or {}
        begun = last.get("steps", 0) - first.get("steps", 0)
        if begun > 0 and "window_steps" in last:
            kept[proc] = round(min(1.0, last["window_steps"] / begun), 3)
    return kept


def window_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server did in a load window, from its info at the window's opening and
    closing (`after` taken with `timeline_since` the opening's clock): per process, its step
    timeline and its CPU seconds per second of the window; the graphs captured, the JIT
    misses and the prompt tokens served from the prefix cache in it."""
    wall = after["clock_s"] - before["clock_s"]
    cpu_busy = {
        proc: round((cpu_s(after, proc) - cpu_s(before, proc)) / wall, 3) for proc in PROCESSES
    }
    first, last = tokenizer_workers_cpu_s(before), tokenizer_workers_cpu_s(after)
    if len(last) > 1:
        # Each answer may come from another worker, whose timeline is its own: the shares
        # come from every worker's counters. "tokenizer" is the main process's.
        workers = {name: (last[name] - first[name]) / wall for name in last}
        cpu_busy["tokenizer"] = round(workers["tokenizer"], 3)
        cpu_busy["tokenizer_workers_max"] = round(max(workers.values()), 3)
        cpu_busy["tokenizer_workers_total"] = round(sum(workers.values()), 3)
    # The requests begun in the window as each tokenizer worker saw them (srt.timeline); the
    # figures read the worker that served the most (at concurrency 1: all of them).
    by_worker = after["tokenizer"].get("requests_by_worker") or {
        str(after["tokenizer"].get("worker", 0)): after["tokenizer"].get("requests")
    }
    busiest = max(by_worker.values(), key=lambda r: (r or {}).get("window_steps", 0))
    return {
        "timeline_kept": timeline_kept(before, after),
        "server_window_s": round(wall, 3),
        "timeline": {
            **{proc: after[proc].get("timeline") for proc in PROCESSES},
            "tokenizer_requests": busiest,
            "tokenizer_requests_by_worker": by_worker,
        },
        "cpu_busy": cpu_busy,
        "captures_in_window": growth(before, after, *CAPTURES),
        "captured_in_window": new_captures(before, after),
        "jit_misses_in_window": growth(before, after, *JIT_MISSES),
        "cached_tokens_in_window": growth(before, after, *CACHED_TOKENS),
    }


def kv_figures(info: dict[str, Any]) -> dict[str, Any]:
    """The KV slots requests still hold once a run is over (none, if every finished request
    gave its slots back; the prefix cache's are apart), and the prefix cache's."""
    scheduler = info["scheduler"]
    return {
        "kv_slots_held_after": scheduler["kv_slots_used"] - scheduler["kv_slots_cached"],
        "kv_slots_cached_after": scheduler["kv_slots_cached"],
    }


def phase_buckets(info: dict[str, Any], phase: str) -> list[int]:
    """The server's buckets of `phase` (decode: batch sizes, prefill: token counts) with a
    graph of their own, captured or not."""
    return sorted(b["bucket"] for b in nested(info, ("graphs", phase, "buckets")) or [])


# ---- the plan of a call --------------------------------------------------------------------

DEFAULT_REQUESTS = 64  # per run, without --num-prompts
# Passes after the warm-up's bursts for the buckets a run can reach that are still unmet.
WARMUP_PASSES = 3
# Runs with more requests in flight than this get at least --min-requests-per-level.
SHORT_RUN_IN_FLIGHT = 16


@dataclasses.dataclass
class RunPlan:
    """One timed run: its cap (None: none), its requests, the seed of its arrivals."""

    max_concurrency: int | None
    specs: list[RequestSpec]
    seed: str

    @property
    def in_flight(self) -> int:
        return most_in_flight(self.max_concurrency, len(self.specs))


@dataclasses.dataclass
class CallPlan:
    """Every request of a call: the warm-up's bursts (each sent with all its requests in
    flight), the timed runs, and the prefix every prompt starts with."""

    warmup: list[list[RequestSpec]]
    runs: list[RunPlan]
    shared_prefix: list[int]
    # More warm-up requests, distinct from every prompt drawn before: (count, seed) -> specs.
    draw_warmup: Callable[[int, str], list[RequestSpec]] = dataclasses.field(
        default=lambda num, seed: [], compare=False, repr=False
    )

    def prompts(self) -> Iterator[list[int]]:
        for burst in self.warmup:
            yield from (spec.input_ids for spec in burst)
        for run in self.runs:
            yield from (spec.input_ids for spec in run.specs)


def request_counts(ns: argparse.Namespace) -> list[int]:
    """Requests per run: `--num-prompts` as given (one value for all, or one per run); else
    DEFAULT_REQUESTS, and at least `--min-requests-per-level` where more than
    SHORT_RUN_IN_FLIGHT requests can be in flight (a larger cap, or none)."""
    if ns.num_prompts is not None:
        return (
            ns.num_prompts * len(ns.max_concurrency) if len(ns.num_prompts) == 1 else ns.num_prompts
        )
    return [
        max(DEFAULT_REQUESTS, ns.min_requests_per_level)
        if cap == 0 or cap > SHORT_RUN_IN_FLIGHT
        else DEFAULT_REQUESTS
        for cap in ns.max_concurrency
    ]


def runs_in_flight(ns: argparse.Namespace) -> list[int]:
    """The most requests each run can have in flight."""
    return [
        most_in_flight(cap, num)
        for cap, num in zip(ns.max_concurrency, request_counts(ns), strict=True)
    ]


def warmup_sizes(in_flight: Sequence[int], buckets: Sequence[int]) -> list[int]:
    """The warm-up's bursts: one of each run's in-flight count, and one per decode bucket up
    to the largest of those (a run's batch passes through the smaller ones on its way up and
    down)."""
    top = max(in_flight, default=0)
    return sorted({*in_flight, *(b for b in buckets if b <= top)})


def plan_call(ns: argparse.Namespace, vocab_size: int, buckets: Sequence[int]) -> CallPlan:
    """The requests of a call against a server of `vocab_size` tokens and these decode
    buckets: each run's from a seed of its own (`--seed` and its index), the warm-up's bursts
    (unless `--no-warmup`), every prompt distinct from every other (`random_requests`'s
    heads) after the shared prefix of `--shared-prefix-len` tokens."""
    prefix_rng = random.Random(f"{ns.seed}/prefix")
    prefix = [prefix_rng.randrange(vocab_size) for _ in range(ns.shared_prefix_len)]
    heads: set[tuple[int, ...]] = set()

    def draw(num: int, output_len: int, seed: str) -> list[RequestSpec]:
        return random_requests(
            num,
            ns.input_len,
            output_len,
            vocab_size,
            ns.range_ratio,
            seed,
            prefix=prefix,
            heads=heads,
        )

    runs = [
        RunPlan(
            cap or None,
            draw(num, ns.output_len, f"{ns.seed}/run{index}"),
            f"{ns.seed}/arrivals{index}",
        )
        for index, (cap, num) in enumerate(zip(ns.max_concurrency, request_counts(ns), strict=True))
    ]
    in_flight = [run.in_flight for run in runs]
    sizes = [] if ns.no_warmup else warmup_sizes(in_flight, buckets)
    output_len = min(ns.warmup_output_len, ns.output_len)
    warmup = [draw(size, output_len, f"{ns.seed}/warmup{size}") for size in sizes]
    return CallPlan(
        warmup, runs, prefix, lambda num, seed: draw(num, output_len, f"{ns.seed}/{seed}")
    )


def unseen_buckets(info: dict[str, Any], phase: str) -> list[int]:
    """The buckets of `phase` that have a graph of their own and have not been met yet."""
    buckets = nested(info, ("graphs", phase, "buckets")) or []
    return sorted(b["bucket"] for b in buckets if b.get("state") == "unseen")


@dataclasses.dataclass
class Unmet:
    """What would meet the buckets a run can reach that the server lists as unmet: bursts
    of streams in flight (decode buckets) and batches of prompts in one call (prefill)."""

    bursts: list[int]
    batches: list[int]

    def __bool__(self) -> bool:
        return bool(self.bursts or self.batches)


def unmet_buckets(info: dict[str, Any], top: int, input_len: int) -> Unmet:
    """For a run of at most `top` requests in flight: a decode bucket by a burst of as many
    requests as it holds (`top` at most) where that is more than the bucket below holds (a
    burst does not meet it for certain: its first requests can finish before its last
    begin); a prefill bucket by a batch of the most `input_len` prompts that fit it
    together, where they overflow the bucket below (one call's prompts are prefilled in one
    step, where prompts sent one by one arrive spread over several)."""

    def below(buckets: Sequence[int]) -> dict[int, int]:
        return dict(zip(buckets[1:], buckets, strict=False))

    bursts, batches = set(), set()
    decode_below = below(phase_buckets(info, "decode"))
    for bucket in unseen_buckets(info, "decode"):
        if decode_below.get(bucket, 0) < top:
            bursts.add(min(bucket, top))
    prefill_below = below(phase_buckets(info, "prefill"))
    for bucket in unseen_buckets(info, "prefill") if input_len else []:
        count = min(bucket // input_len, top)
        if count >= 1 and count * input_len > prefill_below.get(bucket, 0):
            batches.add(count)
    return Unmet(sorted(bursts), sorted(batches))


def send_batch(
    base_url: str, headers: dict[str, str] | None, specs: Sequence[RequestSpec], timeout: float
) -> int:
    """One `/generate` call of all `specs`' prompts, one token each (a prefill step of them
    all); how many failed."""
    body = {
        "input_ids": [spec.input_ids for spec in specs],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
    }
    try:
        resp = httpx.post(f"{base_url}/generate", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return len(specs)
    return 0 if resp.status_code == 200 else len(specs)


# ---- the call ------------------------------------------------------------------------------


def run_client_load(
    base_url: str,
    ns: argparse.Namespace,
    headers: dict[str, str] | None,
    specs: Sequence[RequestSpec],
    max_concurrency: int | None,
    request_rate: float,
    seed: int | str,
    window: LoadWindow | None = None,
    progress: bool = True,
) -> ClientLoad:
    """`client_load` from the client processes `--client-processes` gives the load, with the
    command line's timeouts."""
    processes = client_processes_for_run(
        ns.client_processes, max_concurrency, len(specs), os.cpu_count()
    )
    return client_load(
        base_url,
        specs,
        processes,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        seed=seed,
        timeout_s=ns.timeout,
        max_duration_s=ns.max_duration,
        headers=headers,
        window=window,
        progress=progress,
    )


def warm_up(
    base_url: str, ns: argparse.Namespace, headers: dict[str, str] | None, plan: CallPlan
) -> dict[str, Any]:
    """Send the warm-up's bursts, untimed, each with all its requests in flight; then, up to
    WARMUP_PASSES times, what would meet the buckets a run can reach that the server lists
    as unmet (`unmet_buckets`: bursts again, and batches of prompts for prefill); what it
    all made the server capture and compile."""
    before = server_info(base_url, headers)
    start = time.perf_counter()
    errors = 0

    def send(bursts: Sequence[list[RequestSpec]]) -> None:
        nonlocal errors
        for burst in bursts:
            load = run_client_load(
                base_url, ns, headers, burst, len(burst), math.inf, ns.seed, progress=False
            )
            errors += sum(not r.ok for r in load.records)

    send(plan.warmup)
    planned = [len(burst) for burst in plan.warmup]
    top = max(planned, default=0)
    passes: list[dict[str, list[int]]] = []
    after = server_info(base_url, headers)
    for attempt in range(WARMUP_PASSES if plan.warmup else 0):
        unmet = unmet_buckets(after, top, ns.input_len)
        if not unmet:
            break
        bursts = [plan.draw_warmup(n, f"pass{attempt}/burst{n}") for n in unmet.bursts]
        batches = [plan.draw_warmup(n, f"pass{attempt}/batch{n}") for n in unmet.batches]
        plan.warmup.extend([*bursts, *batches])  # their prompts are the call's too
        send(bursts)
        for batch in batches:
            errors += send_batch(base_url, headers, batch, ns.timeout)
        passes.append(dataclasses.asdict(unmet))
        after = server_info(base_url, headers)
    left = unmet_buckets(after, top, ns.input_len) if plan.warmup else None
    return {
        "bursts": planned,
        # Per pass, the bursts and prefill batches sent for buckets a run can reach that the
        # server still listed as unmet; what would meet those left after the last.
        "passes": passes,
        "unmet": dataclasses.asdict(left) if left else None,
        "output_len": plan.warmup[0][0].output_len if plan.warmup else None,
        "errors": errors,
        "duration_s": round(time.perf_counter() - start, 3),
        "captures": growth(before, after, *CAPTURES),
        "captured": new_captures(before, after),
        "jit_misses": growth(before, after, *JIT_MISSES),
    }


class RunProfile:
    """`--profile-steps`: the server's runner profiled over that many steps of a run, from
    `--profile-delay` seconds after its load window opens (past the ramp-up); the outcome of
    `/stop_profile` (trace file, per-step summary) once the run is over."""

    def __init__(
        self, base_url: str, headers: dict[str, str] | None, ns: argparse.Namespace
    ) -> None:
        self.base_url, self.headers = base_url, headers
        body = {"num_steps": ns.profile_steps, "output_dir": ns.profile_dir}
        self.timer = threading.Timer(ns.profile_delay, self._post, ("/start_profile", body))
        self.error: str | None = None

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The endpoint's answer; {} where it failed (`error` says how: a profile that did
        not start is the run's note, never the run's end)."""
        try:
            resp = httpx.post(f"{self.base_url}{path}", json=body, headers=self.headers, timeout=60)
        except httpx.HTTPError as e:
            self.error = f"{path}: {type(e).__name__}: {e}"
            return {}
        if resp.status_code != 200:
            self.error = f"{path}: HTTP {resp.status_code}: {resp.text[:200]}"
            return {}
        return dict(resp.json())

    def start(self) -> None:
        self.timer.start()

    def outcome(self) -> dict[str, Any]:
        """What the profile recorded (nothing if the run ended before the delay)."""
        self.timer.cancel()
        self.timer.join()
        stopped = self._post("/stop_profile")
        return {**stopped, "error": self.error} if self.error else stopped


def timed_run(
    base_url: str,
    ns: argparse.Namespace,
    headers: dict[str, str] | None,
    run: RunPlan,
    runner: RunnerFigures,
) -> dict[str, Any]:
    """One timed run and its figures: whole run, steady window, the server's load window,
    the KV slots once it is over, the client's share, the runner ceiling; with
    `--profile-steps`, the runner's profile over part of it."""
    profile = RunProfile(base_url, headers, ns) if ns.profile_steps else None

    def sample(since: float | None) -> dict[str, Any]:
        info = server_info(base_url, headers, since)
        if since is None and profile is not None:  # the window opens
            profile.start()
        if since is not None:  # the window closes: every worker's requests
            info["tokenizer"]["requests_by_worker"] = requests_by_worker(
                base_url, headers, since, info
            )
        return info

    window = LoadWindow(sample)
    load = run_client_load(
        base_url, ns, headers, run.specs, run.max_concurrency, ns.request_rate, run.seed, window
    )
    assert window.before is not None and window.after is not None  # it sampled both ends
    rate = ns.request_rate if math.isfinite(ns.request_rate) else None  # None: at once
    figures: dict[str, Any] = {
        "max_concurrency": run.max_concurrency,
        "request_rate": rate,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "range_ratio": ns.range_ratio,
        "shared_prefix_len": ns.shared_prefix_len,
        **metrics(load.records),
        "steady": steady_figures(load.records, run.max_concurrency),
        **window_figures(window.before, window.after),
        **kv_figures(server_info(base_url, headers)),
        # The client's own share: a saturated client under-reports the server.
        **load.figures(),
    }
    if profile is not None:
        figures["runner_profile"] = profile.outcome()
    batch = step_kind(figures["timeline"]["scheduler"], "decode").get("requests_mean")
    ceiling = runner.ceiling(batch, ns.output_len)
    figures["runner_ceiling"] = ceiling
    figures["of_ceiling"] = fraction(figures["output_throughput"], ceiling["tok_s"])
    steady = figures["steady"]
    if steady is not None:
        steady["of_ceiling"] = fraction(steady["output_throughput"], ceiling["tok_s"])
    return figures


def fraction(value: float, of: float | None) -> float | None:
    return round(value / of, 3) if of else None


def bench(
    base_url: str, ns: argparse.Namespace, headers: dict[str, str] | None, runner: RunnerFigures
) -> dict[str, Any]:
    """The warm-up, then every run; with what the prompts of the call share."""
    info = server_info(base_url, headers)
    plan = plan_call(ns, int(info["model"]["vocab_size"]), phase_buckets(info, "decode"))
    warmup = warm_up(base_url, ns, headers, plan)
    runs = [timed_run(base_url, ns, headers, run, runner) for run in plan.runs]
    return {
        "prompts": {
            "count": sum(1 for _ in plan.prompts()),
            "shared_prefix_len": len(plan.shared_prefix),
            "longest_shared_prefix": longest_shared_prefix(plan.prompts()),
        },
        "warmup": warmup,
        "runs": runs,
    }


# ---- the table -----------------------------------------------------------------------------

TABLE = [
    ("conc", "max_concurrency"),
    ("rate", "request_rate"),
    ("prefix", "shared_prefix_len"),  # tokens every prompt starts with (--shared-prefix-len)
    ("done", "completed"),
    ("errors", "errors"),
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
    ("ceiling tok/s", "ceiling_tok_s"),
    ("of ceiling", "of_ceiling"),
    # The part of the run with the cap in flight: no ramp-up, no tail.
    ("steady s", "steady_s"),
    ("steady tok/s", "steady_output_throughput"),
    ("steady of ceiling", "steady_of_ceiling"),
    ("TTFT p50", "ttft_p50"),
    ("TTFT p99", "ttft_p99"),
    # From the request sent to the scheduler to its first token back in the tokenizer
    # process (the answering worker's requests): TTFT less the HTTP stack and the client.
    ("TTFT in server p50", "server_first_token_p50"),
    ("TPOT p50", "tpot_p50"),
    ("steady TPOT p50", "steady_tpot_p50"),
    ("ITL/event p50", "itl_p50"),
    ("ITL/event p99", "itl_p99"),
    ("ITL/token p50", "itl_token_p50"),  # SGLang's ITL
    ("E2E p50", "e2e_p50"),
    # What a timed figure paid for besides serving: it should be none.
    ("captures in window", "captures_in_window"),
    ("JIT misses in window", "jit_misses_in_window"),
    ("cached tok in window", "cached_tokens_in_window"),
    ("KV held after", "kv_slots_held_after"),
    # Where the time went: the server's decode batch, its extend (prefill) steps and their
    # share of the run, and whether a process (or this client) was on a CPU all along.
    ("decode bs", "decode_bs"),
    # The server's decode step: its period on the device (the runner's CUDA events, from the
    # previous step's end to its own; median), against the runner's alone at that batch (the
    # ceiling's); what the device did per decode step, busy and idle waiting for the host
    # (means); and the scheduler's loop turns that launched a decode (median, p10, p90): with
    # steps in flight a turn is not a step (results queued behind one another come in pairs).
    ("step ms", "server_step_ms"),
    ("runner step ms", "runner_step_ms"),
    ("device busy ms", "device_busy_ms"),
    ("device idle ms", "device_idle_ms"),
    ("turn p50", "turn_p50_ms"),
    ("turn p10", "turn_p10_ms"),
    ("turn p90", "turn_p90_ms"),
    # The share of the window's steps the timelines kept (below 1, the figures above describe
    # the window's end only).
    ("steps kept", "steps_kept"),
    ("extend steps", "extend_steps"),
    ("extend time %", "extend_share"),
    ("CPU sched", "cpu_scheduler"),
    ("CPU runner", "cpu_runner"),
    ("CPU tok", "cpu_tokenizer"),  # the main process's
    ("CPU tok max", "cpu_tokenizer_workers_max"),  # with several workers, the busiest one's
    ("CPU client", "client_cpu_busy"),  # all its processes together
    ("client procs", "client_processes"),
    ("CPU client max", "client_cpu_busy_max"),  # its busiest process
]


def table_row(run: dict[str, Any]) -> dict[str, Any]:
    """A run's row of the printed table (latencies in ms); the figures an older results file
    lacks are left empty."""
    sched = (run.get("timeline") or {}).get("scheduler")
    runner_decode = step_kind((run.get("timeline") or {}).get("runner"), "decode")
    device = runner_decode.get("means_ms") or {}
    request_gaps = ((run.get("timeline") or {}).get("tokenizer_requests") or {}).get("gaps_ms")
    extend, decode = step_kind(sched, "extend"), step_kind(sched, "decode")
    turns = decode.get("periods_ms") or {}
    total = extend.get("ms_total", 0.0) + decode.get("ms_total", 0.0)
    steady = run.get("steady") or {}
    return {
        **run,
        "ceiling_tok_s": (run.get("runner_ceiling") or {}).get("tok_s"),
        "steady_s": steady.get("duration_s"),
        "steady_output_throughput": steady.get("output_throughput"),
        "steady_of_ceiling": steady.get("of_ceiling"),
        "steady_tpot_p50": (steady.get("tpot_ms") or {}).get("p50"),
        "server_first_token_p50": (request_gaps or {}).get("sent_to_first_token"),
        "decode_bs": decode.get("requests_mean"),
        # The device's period where the runner measured it; otherwise (off CUDA, older files)
        # the scheduler's decode turns' median, or all its turns'.
        "server_step_ms": (runner_decode.get("medians_ms") or {}).get(
            "device_period", turns.get("p50", (sched or {}).get("period_ms"))
        ),
        "runner_step_ms": (run.get("runner_ceiling") or {}).get("decode_ms"),
        "device_busy_ms": device.get("device_busy"),
        "device_idle_ms": device.get("device_idle"),
        "turn_p50_ms": turns.get("p50"),
        "turn_p10_ms": turns.get("p10"),
        "turn_p90_ms": turns.get("p90"),
        "steps_kept": min(run.get("timeline_kept", {}).values(), default=None),
        "extend_steps": extend.get("steps"),
        "extend_share": round(100 * extend.get("ms_total", 0.0) / total, 1) if total else None,
        **{f"cpu_{proc}": share for proc, share in (run.get("cpu_busy") or {}).items()},
        **{
            f"{m}_{p}": (run.get(f"{m}_ms") or {}).get(p)
            for m in ("ttft", "tpot", "itl", "itl_token", "e2e")
            for p in ("p50", "p99")
        },
    }


def notes(result: dict[str, Any]) -> list[str]:
    """What the table's columns rest on: the prompts, the warm-up, the runner figures."""
    prompts, warmup, runner = result["prompts"], result["warmup"], result["runner"]
    shared = (
        f"every one starts with the same {prompts['shared_prefix_len']} tokens"
        if prompts["shared_prefix_len"]
        else "every one its own"
    )
    lines = [
        f"prompts: {prompts['count']}, {shared}; the longest prefix two share: "
        f"{prompts['longest_shared_prefix']} tokens",
        f"warm-up: bursts of {warmup['bursts']} requests, {warmup['captures']} captures and "
        f"{warmup['jit_misses']} JIT misses in it, {warmup['errors']} errors",
    ]
    if warmup.get("passes") or warmup.get("unmet"):  # older results files have neither
        lines.append(
            f"warm-up passes for unmet buckets: {warmup['passes']}; unmet after them: "
            f"{warmup['unmet']}"
        )
    for run in result["runs"]:
        paths = [
            f"{proc} " + ", ".join(f"{gap} {ms}" for gap, ms in gaps.items())
            for proc in ("scheduler", "runner")
            if (gaps := step_kind(nested(run, ("timeline", proc)), "extend").get("gaps_ms"))
        ]
        if paths:  # a prefill's way to its first token, median ms (older files lack it)
            lines.append(
                f"extend steps at concurrency {run['max_concurrency']}: " + "; ".join(paths)
            )
        summary = (run.get("runner_profile") or {}).get("summary")
        if summary and summary["steps"]:
            lines.append(
                f"runner profile at concurrency {run['max_concurrency']}: {summary['steps']} "
                f"steps, {summary['device_span_ms'] / summary['steps']:.3f} ms of device span "
                f"and {summary['gpu_ms_per_step']} busy a step, "
                f"{summary['kernels_per_step']} kernels, launch host "
                f"{summary['wall_ms_per_step']} ms ({run['runner_profile']['trace']})"
            )
        if run.get("captured_in_window"):
            lines.append(
                f"captured in the window of concurrency {run['max_concurrency']}: "
                + ", ".join(run["captured_in_window"])
            )
    if runner["rows"]:
        batches = [r["batch_size"] for r in runner["rows"]]
        lines.append(f"runner ceiling: from {runner['source']}, batches {batches}")
    else:
        lines.append(f"runner ceiling: none ({runner['error']}); no 'of ceiling' figures")
    return lines


# ---- the command line ----------------------------------------------------------------------


def client_processes_arg(text: str) -> int | None:
    """`--client-processes`: a count of one or more, or `auto` (None)."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', not {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
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
        help=f"Requests per run: one value, or one per --max-concurrency (default "
        f"{DEFAULT_REQUESTS}, and --min-requests-per-level where more than "
        f"{SHORT_RUN_IN_FLIGHT} can be in flight).",
    )
    parser.add_argument(
        "--min-requests-per-level",
        type=int,
        default=1024,
        help=f"Without --num-prompts, the fewest requests a run with more than "
        f"{SHORT_RUN_IN_FLIGHT} in flight (a larger cap, or none) sends.",
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
        "--shared-prefix-len",
        type=int,
        default=0,
        help="Every prompt starts with the same this many tokens (default 0: no two prompts "
        f"share more than {DISTINCT_HEAD - 1}).",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="No untimed bursts before the first run.",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="Profile the server's runner over this many steps of each run (its "
        "/start_profile, /stop_profile); the trace and its summary per step are in the run's "
        "runner_profile. The profiler slows the runner: a profiled run's figures are not "
        "the unprofiled ones.",
    )
    parser.add_argument(
        "--profile-delay",
        type=float,
        default=1.0,
        help="Seconds after a run's load window opens that its profile starts.",
    )
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="The server's directory for the traces (default: its own, $SRT_PROFILE_DIR or "
        "the temporary directory).",
    )
    parser.add_argument(
        "--warmup-output-len",
        type=int,
        default=64,
        help="Tokens each warm-up request asks for (at most --output-len): enough that a "
        "burst's first requests are still decoding when its last arrive.",
    )
    parser.add_argument(
        "--runner-results",
        type=Path,
        help="srt.bench.one_batch's JSON lines for the runner ceiling, of this machine, the "
        "server's configuration and --input-len (default: without --base-url, measured "
        "before the server starts; with it, none).",
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
        help="Seconds to wait for a server this tool starts (and for the runner ceiling's "
        "one_batch).",
    )
    parser.add_argument("--output-file", type=Path, help="Write the JSON results here.")
    parser.add_argument(
        "--server-log",
        type=Path,
        help="Keep the log of the server this starts here (default: dropped after the run).",
    )
    add_server_flags_arg(parser, "-- then the flags of the server to start (without --base-url).")
    return parser


def check_args(parser: argparse.ArgumentParser, ns: argparse.Namespace, flags: list[str]) -> None:
    """Refuse (`parser.error`) what the bench cannot run."""
    if ns.base_url and flags:
        parser.error("give either --base-url or server flags after --, not both")
    counts = ns.num_prompts or [1]
    if min(counts) < 1 or ns.input_len < 1 or ns.output_len < 1 or ns.warmup_output_len < 1:
        parser.error(
            "--num-prompts, --input-len, --output-len and --warmup-output-len must be positive"
        )
    if len(counts) not in (1, len(ns.max_concurrency)):
        parser.error("--num-prompts takes one value or one per --max-concurrency value")
    if ns.min_requests_per_level < 1:
        parser.error("--min-requests-per-level must be positive")
    if (ns.profile_steps is not None and ns.profile_steps < 1) or ns.profile_delay < 0:
        parser.error("--profile-steps must be positive and --profile-delay at least 0")
    if not 0 < ns.range_ratio <= 1 or ns.request_rate <= 0 or min(ns.max_concurrency) < 0:
        parser.error(
            "--range-ratio must be in (0, 1], --request-rate positive, --max-concurrency at least 0"
        )
    shortest = max(1, math.ceil(ns.input_len * ns.range_ratio))
    if not 0 <= ns.shared_prefix_len < shortest:
        parser.error(
            f"--shared-prefix-len must be at least 0 and below the shortest prompt ({shortest} "
            "tokens), so that every prompt has a token of its own"
        )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ns = parser.parse_args(argv)
    flags = server_flags(ns)
    check_args(parser, ns, flags)
    runner = None
    if ns.runner_results:
        try:
            runner = runner_ceiling.read(ns.runner_results, ns.input_len)
        except (OSError, ValueError) as e:
            parser.error(f"--runner-results: {e}")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else None
    result: dict[str, Any] = {"machine": machine(), "base_url": ns.base_url, "server_flags": flags}
    if ns.base_url:
        runner = runner or RunnerFigures(
            None, error="against --base-url, the runner figures come from --runner-results"
        )
        result["runner"] = runner.json()
        result.update(bench(ns.base_url.rstrip("/"), ns, headers, runner))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            # Before the server, which would hold the device's memory.
            runner = runner or runner_ceiling.measure(
                flags,
                sorted({1, *runs_in_flight(ns)}),
                ns.input_len,
                ns.output_len,
                Path(tmp),
                ns.ready_timeout,
            )
            result["runner"] = runner.json()
            with ServerProcess(
                flags, ns.server_log or Path(tmp) / "server.log", api_key=ns.api_key
            ) as server:
                result["server_ready_s"] = round(server.wait_ready(ns.ready_timeout), 3)
                result.update(bench(server.url, ns, server.headers, runner))
    if ns.output_file:
        write_json(ns.output_file, result)
    print("\n".join(notes(result)))
    print(format_table([table_row(r) for r in result["runs"]], TABLE))


if __name__ == "__main__":
    main()
