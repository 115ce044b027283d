"""The main process alone: how many streamed tokens a second the HTTP front end (tokenizer
manager, detokenization, event streams) delivers when the steps come at the runner's pace.

    python -m srt.bench.frontend --step-ms 2 --max-concurrency 32 64 128 --output-len 256 \
        [--tokenizer-worker-num N]

A stand-in scheduler process answers every request with one token per step, a step every
`--step-ms` (the runner's overlapped step at that batch, from `srt.bench.one_batch`), for all
running requests at once, in the scheduler's own messages. The real tokenizer manager and HTTP
app serve the streams in this process, loaded by `srt.bench.serving`'s client processes. No
model runs, so the figures are the front end's: its CPU time per token and per stream event,
its share of a CPU over the load, and the delivered rate as a fraction of what the steps offer
(`concurrency / step`). Near 1 the front end keeps up; a front end on a CPU all of the load
falls behind, batches several steps per event and delays every request's end and start.
With `--tokenizer-worker-num N` the server's N-1 other tokenizer workers serve beside this
process, as the launcher runs them; the CPU figures are then all of theirs together, and the
busiest one's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import multiprocessing as mp
import os
import time
from multiprocessing.synchronize import Event
from typing import Any

from srt.bench.report import format_table, machine, write_json
from srt.bench.serving import (
    LoadWindow,
    client_processes_for_run,
    load_from_processes,
    metrics,
    random_requests,
    split_evenly,
)
from srt.ipc.channels import TO_SCHEDULER, Endpoints, Receiver, Sender, to_tokenizer
from srt.ipc.messages import AbortReq, GenerateReq, StepOutputs, TokenOutput
from srt.ipc.reports import ProcessStartup, ServerStartup
from srt.process import process_cpu_s

_IDLE_POLL_MS = 50


def stand_in_scheduler(
    endpoints_dir: str, step_s: float, stream_interval: int, workers: int, stop: Event
) -> None:
    """Every `step_s`, one token for each running request; a request ends after its
    `max_new_tokens` ("length"); aborts drop it. Its tokens go out as the scheduler sends
    them: the first at once, then every `stream_interval`, the rest with the end, to the
    tokenizer worker that sent it."""
    import zmq

    endpoints = Endpoints(endpoints_dir)
    ctx = zmq.Context()
    inbox = Receiver(ctx, endpoints, TO_SCHEDULER)
    outboxes = [Sender(ctx, endpoints, to_tokenizer(w)) for w in range(workers)]
    # rid -> [prompt tokens, produced, asked for, sent, its worker]
    running: dict[str, list[int]] = {}
    next_step = time.perf_counter()
    while not stop.is_set():
        while inbox.poll(0 if running else _IDLE_POLL_MS):
            msg = inbox.recv()
            if isinstance(msg, GenerateReq):
                asked = msg.sampling_params.max_new_tokens
                assert asked is not None, "the front end fills in max_new_tokens"
                running[msg.rid] = [len(msg.input_ids), 0, asked, 0, msg.tokenizer_worker]
            elif isinstance(msg, AbortReq):
                running.pop(msg.rid, None)
        if not running:
            next_step = time.perf_counter()
            continue
        outputs: dict[int, list[TokenOutput]] = {}
        for rid, state in list(running.items()):
            state[1] += 1
            done = state[1] >= state[2]
            if not done and state[3] and state[1] - state[3] < stream_interval:
                continue
            # Ordinary ids of any vocabulary, past the specials.
            tokens = [3 + t % 200 for t in range(state[3] + 1, state[1] + 1)]
            state[3] = state[1]
            outputs.setdefault(state[4], []).append(
                TokenOutput(
                    rid,
                    tokens,
                    "length" if done else None,
                    prompt_tokens=state[0],
                    completion_tokens=state[1],
                )
            )
            if done:
                del running[rid]
        for worker, group in outputs.items():
            outboxes[worker].send(StepOutputs.pack(group))
        next_step += step_s
        time.sleep(max(0.0, next_step - time.perf_counter()))
        next_step = max(next_step, time.perf_counter() - step_s)  # never a burst to catch up


def serve_and_load(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """The front end in this process (uvloop, as the server runs it), and the other tokenizer
    workers if asked for, against the stand-in; one load per concurrency, each with fresh
    prompts."""
    import uvloop

    from srt.model_config import ModelConfig
    from srt.server.launcher import order_workers, spawn_tokenizer_workers
    from srt.server.listening import bind
    from srt.server.tokenizer_worker import ServeFrom, StopServing
    from srt.server_args import ServerArgs
    from srt.tools.make_tiny_model import resolve_model_path

    args = ServerArgs(
        model_path=resolve_model_path(ns.model_path),
        device="cpu",
        port=0,
        tokenizer_worker_num=ns.tokenizer_worker_num,
    )
    assert args.model_path is not None
    model_config = ModelConfig.from_path(args.model_path, args.dtype, None)
    endpoints = Endpoints.create()
    sock = bind(args)
    args.port = sock.getsockname()[1]  # the workers bind the same port
    workers = spawn_tokenizer_workers(args, endpoints, time.perf_counter())
    # With workers, prometheus_client may be imported only now (spawn_tokenizer_workers).
    from srt.server.http.uvicorn_server import http_server
    from srt.server.tokenizer_manager import TokenizerManager

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    scheduler = ctx.Process(
        target=stand_in_scheduler,
        args=(endpoints.dir, ns.step_ms / 1000, ns.stream_interval, len(workers) + 1, stop),
        daemon=True,
    )
    manager = TokenizerManager(args, endpoints, model_config)
    scheduler.start()
    manager.load_tokenizer()
    started = time.perf_counter()
    while not all(child.report for child, _ in workers.values()):
        for child, _ in workers.values():
            child.check(started)
        time.sleep(0.01)
    startup = ServerStartup(
        0.0,
        time.time(),
        endpoints.dir,
        {
            "tokenizer": ProcessStartup(os.getpid(), 0.0, {}),
            **{name: child.startup({}) for name, (child, _) in workers.items()},
        },
    )
    context = ns.input_len + ns.output_len + 1
    orders = {name: conn for name, (_, conn) in workers.items()}
    order_workers(orders, ServeFrom(context, context * max(ns.max_concurrency), startup))
    manager.mark_ready(context, context * max(ns.max_concurrency), startup)
    pids = [entry.pid for entry in startup.processes.values()]
    base_url = f"http://127.0.0.1:{args.port}"
    server = http_server(manager)
    runs: list[dict[str, Any]] = []

    async def serve() -> None:
        outputs = asyncio.create_task(manager.handle_outputs())
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        loop = asyncio.get_running_loop()
        heads: set[tuple[int, ...]] = set()
        for concurrency in ns.max_concurrency:
            num = max(ns.min_requests, 8 * concurrency)
            specs = random_requests(
                num,
                ns.input_len,
                ns.output_len,
                model_config.vocab_size,
                seed=f"fe{concurrency}",
                heads=heads,
            )
            # Client processes always (the load's CPU must not count as the front end's).
            procs = client_processes_for_run(None, concurrency, num, os.cpu_count())
            shares = [
                {"max_concurrency": cap, "request_rate": math.inf, "seed": k, "timeout_s": 600.0}
                for k, cap in enumerate(split_evenly(concurrency, procs))
            ]
            window = LoadWindow()
            cpu = [process_cpu_s(pid) or 0.0 for pid in pids]
            load = await loop.run_in_executor(
                None,
                functools.partial(load_from_processes, base_url, specs, shares, window, False),
            )
            used = [(process_cpu_s(pid) or 0.0) - c for pid, c in zip(pids, cpu, strict=True)]
            runs.append(
                run_figures(ns, concurrency, load.records, used, load.wall_s, load.figures())
            )
        server.should_exit = True
        await serving
        outputs.cancel()

    try:
        uvloop.run(serve())
    finally:
        order_workers(orders, StopServing("the benchmark is over"))
        for child, conn in workers.values():
            child.join()
            conn.close()
        stop.set()
        scheduler.join()
        manager.close()
        endpoints.remove()
    return runs


def run_figures(
    ns: argparse.Namespace,
    concurrency: int,
    records: list[Any],
    front_cpu_s: list[float],
    wall_s: float,
    client: dict[str, Any],
) -> dict[str, Any]:
    """A level's figures; `front_cpu_s`: each tokenizer worker's CPU seconds in the load."""
    figures = metrics(records)
    total_cpu_s = sum(front_cpu_s)
    tokens = figures["total_output_tokens"]
    events = sum(len(r.chunk_times) for r in records if r.ok)
    offered = concurrency / (ns.step_ms / 1000)
    return {
        "max_concurrency": concurrency,
        "step_ms": ns.step_ms,
        **figures,
        "events": events,
        "tokens_per_event": round(tokens / max(events, 1), 3),
        "offered_tok_s": round(offered, 1),
        "of_offered": round(figures["output_throughput"] / offered, 3),
        "tokenizer_workers": len(front_cpu_s),
        "front_cpu_busy": round(total_cpu_s / wall_s, 3),
        "front_cpu_busy_max": round(max(front_cpu_s) / wall_s, 3),
        "front_cpu_us_per_token": round(total_cpu_s / max(tokens, 1) * 1e6, 2),
        "front_cpu_us_per_event": round(total_cpu_s / max(events, 1) * 1e6, 2),
        **client,
    }


COLUMNS = [
    ("conc", "max_concurrency"),
    ("done", "completed"),
    ("errors", "errors"),
    ("out tok/s", "output_throughput"),
    ("offered tok/s", "offered_tok_s"),
    ("of offered", "of_offered"),
    ("tok/event", "tokens_per_event"),
    ("workers", "tokenizer_workers"),
    ("front CPU", "front_cpu_busy"),  # all the workers together
    ("front CPU max", "front_cpu_busy_max"),  # the busiest one
    ("µs/token", "front_cpu_us_per_token"),
    ("µs/event", "front_cpu_us_per_event"),
    ("TTFT p50", "ttft_p50"),
    ("TPOT p50", "tpot_p50"),
    ("CPU client max", "client_cpu_busy_max"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m srt.bench.frontend",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--step-ms", type=float, default=2.0, help="The stand-in's step period.")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="Tokens per output after the first, as the server's --stream-interval.",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=256,
        help="Requests per level, at least (else 8 x the concurrency).",
    )
    p.add_argument(
        "--tokenizer-worker-num",
        type=int,
        default=1,
        help="Tokenizer workers serving the port, this process included (the server's flag).",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--model-path", default=None, help="Whose tokenizer (default: the tiny one).")
    p.add_argument("--output-file", default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    runs = serve_and_load(ns)
    for run in runs:
        run["ttft_p50"], run["tpot_p50"] = run["ttft_ms"]["p50"], run["tpot_ms"]["p50"]
    if ns.output_file:
        write_json(ns.output_file, {"machine": machine(), "args": vars(ns), "runs": runs})
    print(format_table(runs, COLUMNS))


if __name__ == "__main__":
    main()
