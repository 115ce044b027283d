"""Host cost of the scheduler per decode step: plan building and result processing for a
batch of long running requests, with a stand-in runner (no model, no device).

    python scripts/bench_scheduler.py --requests 256 --prompt-len 2000 --steps 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from srt.ipc.messages import BatchPlan, BatchResult, GenerateReq
from srt.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=50)
    ns = parser.parse_args()
    args = ServerArgs(
        max_running_requests=ns.requests,
        max_prefill_tokens=1 << 30,
        chunked_prefill_size=1 << 30,
        enable_prefix_caching=False,
    )
    total = ns.requests * (ns.prompt_len + ns.steps + 1) + 1
    sched = Scheduler(
        args,
        num_slots=total,
        context_length=ns.prompt_len + ns.steps + 2,
        vocab_size=32000,
        eos_token_ids=[],
    )
    rng = np.random.default_rng(0)
    for i in range(ns.requests):
        prompt = rng.integers(0, 32000, ns.prompt_len).tolist()
        params = SamplingParams(max_new_tokens=ns.steps + 1, temperature=0, ignore_eos=True)
        sched.add_request(GenerateReq(str(i), prompt, params))

    def runner(plan: BatchPlan) -> BatchResult:
        return BatchResult(next_token_ids=np.ones(plan.batch_size, np.int64))

    sched.step(runner)  # prefill every request
    plan_ms, process_ms = [], []
    for _ in range(ns.steps):
        start = time.perf_counter()
        scheduled = sched.schedule()
        assert scheduled is not None
        planned = time.perf_counter()
        sched.process_result(scheduled, runner(scheduled.plan))
        plan_ms.append((planned - start) * 1000)
        process_ms.append((time.perf_counter() - planned) * 1000)
    print(
        json.dumps(
            {
                "requests": ns.requests,
                "prompt_len": ns.prompt_len,
                "steps": ns.steps,
                "plan_ms": round(statistics.median(plan_ms), 3),
                "process_ms": round(statistics.median(process_ms), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
