"""Host cost of the scheduler per decode step, as the server's loop pays it: planning a decode
batch of long running requests, processing its sampled ids, and the output path (packing the
step's outputs and sending them over ipc to one or two tokenizer workers), with a stand-in
runner (no model, no device).

    python scripts/bench_scheduler.py --requests 32,128,256 --prompt-len 2000 --steps 300

Steps run as the server's loop runs them: overlapped `--overlap-depth` steps deep (0: each
step planned, run and processed in turn), outputs every `--stream-interval` tokens. Each
column is a median over the timed decode steps:

- plan ms: `Scheduler.schedule` (the timeline's start_to_planned);
- process ms: `Scheduler.process_result` of the oldest step in flight, which builds the
  step's `StepOutputs` (with the send, the timeline's received_to_outputs_sent);
- out 1w / out 2w ms: `OutputRoutes.send_outputs` to one or two tokenizer workers (the zmq
  send; with two, the split by worker, requests spread over the workers in turn);
- total ms: plan + process + out 1w, what the loop pays per step with one worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import zmq

from srt.ipc.channels import Endpoints, Receiver, Sender, dumps, loads, to_tokenizer
from srt.ipc.messages import BatchPlan, BatchResult, GenerateReq
from srt.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.scheduler_process import OutputRoutes
from srt.server_args import ServerArgs

VOCAB = 32000
EOS = 2
T = TypeVar("T")
COLUMNS = ("plan_ms", "process_ms", "out_1w_ms", "out_2w_ms", "total_ms")


class Workers:
    """`n` tokenizer workers' inboxes in this process, drained between steps (off the clock),
    and the routes the scheduler sends to them."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, n: int, rids: list[str]) -> None:
        self.inboxes = [Receiver(ctx, endpoints, to_tokenizer(w)) for w in range(n)]
        self.routes = OutputRoutes([Sender(ctx, endpoints, to_tokenizer(w)) for w in range(n)])
        for i, rid in enumerate(rids):
            self.routes.admit(rid, i % n)

    def drain(self) -> None:
        for inbox in self.inboxes:
            while inbox.poll(0):
                inbox.recv()

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.close()
        for sender in self.routes.senders:
            sender.close()


def bench(ns: argparse.Namespace, requests: int, ctx: zmq.Context) -> dict[str, float]:
    """Median ms per decode step of each column for `requests` running requests."""
    args = ServerArgs(
        max_running_requests=requests,
        max_prefill_tokens=1 << 30,
        chunked_prefill_size=1 << 30,
        enable_prefix_caching=False,
        overlap_depth=max(ns.overlap_depth, 1),
        stream_interval=ns.stream_interval,
    )
    steps = ns.warmup + ns.steps
    total = requests * (ns.prompt_len + steps + ns.overlap_depth + 2) + 1
    sched = Scheduler(
        args,
        num_slots=total,
        context_length=ns.prompt_len + steps + ns.overlap_depth + 2,
        vocab_size=VOCAB,
        eos_token_ids=[EOS],
    )
    rng = np.random.default_rng(0)
    rids = [str(i) for i in range(requests)]
    for rid in rids:
        prompt = rng.integers(0, VOCAB, ns.prompt_len).tolist()
        # Never finishes inside the window: every timed step decodes all of them.
        params = SamplingParams(max_new_tokens=steps + ns.overlap_depth + 1, temperature=0)
        sched.add_request(GenerateReq(rid, prompt, params))
    endpoints = Endpoints.create()
    one, two = Workers(ctx, endpoints, 1, rids), Workers(ctx, endpoints, 2, rids)
    marks: dict[str, float] = {}

    def launch(plan: BatchPlan) -> Callable[[], BatchResult]:
        marks["planned"] = time.perf_counter()
        # As the server's scheduler gets it: unpickled from the runner's message (read-only
        # arrays), ids that are never a stop token.
        ids = rng.integers(EOS + 1, VOCAB, plan.batch_size)
        result = loads(dumps(BatchResult(next_token_ids=ids, step=plan.step)))

        def wait() -> BatchResult:
            marks["received"] = time.perf_counter()
            return result

        return wait

    def forward(plan: BatchPlan) -> BatchResult:
        return launch(plan)()

    times: dict[str, list[float]] = {c: [] for c in COLUMNS}
    try:
        for i in range(steps):
            marks.clear()
            start = time.perf_counter()
            if ns.overlap_depth:
                outputs = sched.step_overlapped(launch)
                assert outputs is not None, "the requests never finish"
            else:
                outputs = sched.step(forward)
            end = time.perf_counter()
            out_1w = _timed(one.routes.send_outputs, outputs)
            out_2w = _timed(two.routes.send_outputs, outputs)
            one.drain()
            two.drain()
            if i < ns.warmup or "received" not in marks:
                continue
            assert len(outputs) == requests, "every request decodes every timed step"
            plan, process = marks["planned"] - start, end - marks["received"]
            times["plan_ms"].append(plan)
            times["process_ms"].append(process)
            times["out_1w_ms"].append(out_1w)
            times["out_2w_ms"].append(out_2w)
            times["total_ms"].append(plan + process + out_1w)
    finally:
        one.close()
        two.close()
        endpoints.remove()
    return {c: round(statistics.median(t) * 1000, 3) for c, t in times.items()}


def _timed(fn: Callable[[T], object], arg: T) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="32,128,256", help="comma-separated counts")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=20, help="steps before timing")
    parser.add_argument("--overlap-depth", type=int, default=2, help="0: no overlap")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON line per count")
    ns = parser.parse_args()
    ctx = zmq.Context()
    rows = [(int(n), bench(ns, int(n), ctx)) for n in ns.requests.split(",")]
    ctx.term()
    if ns.json:
        for n, row in rows:
            print(json.dumps({"requests": n, "prompt_len": ns.prompt_len, **row}))
        return
    print(f"overlap depth {ns.overlap_depth}, stream interval {ns.stream_interval}")
    print(
        "| requests | "
        + " | ".join(c.removesuffix("_ms").replace("_", " ") + " ms" for c in COLUMNS)
        + " |"
    )
    print("|---:|" + "---:|" * len(COLUMNS))
    for n, row in rows:
        print(f"| {n} | " + " | ".join(f"{row[c]:.3f}" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
