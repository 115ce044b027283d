"""The dummy steps the model runner runs before it reports ready (unless `--skip-warmup`).

What compiles or initialises on its first use (Triton's attention kernels of both phases,
cuBLAS/cuBLASLt handles and heuristics, the sampler's and logprobs' kernels, the kernels of an
Inductor-compiled general graph) would otherwise be paid by the first requests. The runner
sends each plan here through the same path as a scheduler's plan, except that the phase runs
its general (uncaptured) path: no graph is captured and no bucket, counter or manifest entry
moves.

Each plan is one request on table row `WARMUP_ROW` whose every token, cached or new, maps to
the dummy slot, so KV writes land in the dummy slot only; the runner restores the row after.
Prefill: a prompt from scratch, then a few new tokens over a cached prefix (the extend kernel
over a prefix; the flashinfer backend runs the two on different kernels), greedy. Decode:
batch 1 over the same prefix, seeded top-k / top-p / min-p sampling with logprobs.
Sampling draws from a hash of (seed, position), not from generator state, so it moves no
random state that serving sees.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from srt.batch_layout import DUMMY_SLOT, ForwardMode
from srt.ipc.messages import BatchPlan

WARMUP_ROW = 0
WARMUP_PREFIX = 16  # cached tokens before the new ones: more than one KV block of the kernels
WARMUP_EXTEND = 8  # new tokens of the prefill step


def warmup_plan(mode: ForwardMode, prefix: int, extend: int, sampled: bool) -> BatchPlan:
    """One request of `extend` new tokens after `prefix` cached ones, all on the dummy slot;
    greedy, or (`sampled`) seeded top-k / top-p / min-p sampling with top-2 logprobs."""
    seq = prefix + extend
    ints = np.int32

    def one(value: float, dtype: type[np.generic] = ints) -> np.ndarray:
        return np.array([value], dtype=dtype)

    plan = BatchPlan.greedy(
        mode,
        input_ids=np.zeros(extend, ints),
        positions=np.arange(prefix, seq, dtype=ints),
        out_cache_loc=np.full(extend, DUMMY_SLOT, ints),
        req_pool_indices=one(WARMUP_ROW),
        prefix_lens=one(prefix),
        extend_lens=one(extend),
        table=(
            np.full(seq, WARMUP_ROW, ints),
            np.arange(seq, dtype=ints),
            np.full(seq, DUMMY_SLOT, ints),
        ),
    )
    if not sampled:
        return plan
    return dataclasses.replace(
        plan,
        temperatures=one(0.7, np.float32),
        top_ps=one(0.9, np.float32),
        top_ks=one(20, np.int64),
        min_ps=one(0.05, np.float32),
        seeds=one(1234, np.int64),
        return_logprob=True,
        top_logprobs_num=2,
    )


def warmup_plans(context_length: int) -> list[BatchPlan]:
    """The two prefill warm-up steps (from scratch, over a prefix) and the decode one,
    shortened to fit `context_length` tokens."""
    prompt = min(WARMUP_PREFIX + WARMUP_EXTEND, context_length)
    prefill_prefix = min(WARMUP_PREFIX, context_length // 2)
    prefill_extend = max(1, min(WARMUP_EXTEND, context_length - prefill_prefix))
    decode_prefix = min(WARMUP_PREFIX, context_length - 1)
    return [
        warmup_plan(ForwardMode.EXTEND, 0, prompt, sampled=False),
        warmup_plan(ForwardMode.EXTEND, prefill_prefix, prefill_extend, sampled=False),
        warmup_plan(ForwardMode.DECODE, decode_prefix, 1, sampled=True),
    ]
