"""A step's next tokens from its logits, and their way to the host.

Where the phase's graph took the argmax along (`full`, all greedy), those are the ids; where
it samples in a graph of its own (`full` with sampling), that graph's; otherwise the sampler
runs here. The ids stay on the device for the next plan (overlap), and are copied to the host
behind the step.
"""

from __future__ import annotations

import torch

from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan, BatchResult
from srt.layers.sampler import SamplingArrays, SamplingBuffers, logprobs_of, sample
from srt.model_executor.graphs.graph_runner import GraphRunner


class PendingResult:
    """A launched step's sampled ids (and logprobs) on their way to the host: copied behind
    the step, into pinned memory, with an event that says when they are there (on the CPU a
    copy made at once). A copy either way: the ids may be a view of a graph's static output,
    which the next step, launched before this result is read, writes over."""

    def __init__(self, tensors: list[torch.Tensor], step: int) -> None:
        self.step = step
        self.event: torch.cuda.Event | None = None
        if tensors[0].is_cuda:
            # non_blocking into a new CPU tensor pins it, so the copy is asynchronous.
            self.host = [t.to("cpu", non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event(enable_timing=True)  # the step's end (DeviceClock)
            self.event.record()
        else:
            self.host = [t.clone() for t in tensors]

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> BatchResult:
        if self.event is not None:
            self.event.synchronize()
        arrays = [t.numpy() for t in self.host]
        result = BatchResult(next_token_ids=arrays[0], step=self.step)
        if len(arrays) > 1:
            result.logprobs = arrays[1]
        if len(arrays) > 2:
            result.top_logprob_vals, result.top_logprob_ids = arrays[2], arrays[3]
        return result


def next_token_ids(
    plan: BatchPlan, batch: ForwardBatch, logits: torch.Tensor, runner: GraphRunner
) -> torch.Tensor:
    """Each request's next token from `logits` [B, V] of `runner`'s last run."""
    greedy = runner.take_greedy()
    if not plan.temperatures.any():  # all greedy: no parameters to upload
        return greedy if greedy is not None else sample(logits, None)
    arrays = SamplingArrays(plan.temperatures, plan.top_ps, plan.top_ks, plan.min_ps, plan.seeds)
    in_graph = runner.take_sampled(arrays)
    if in_graph is not None:
        return in_graph
    params = SamplingBuffers(len(arrays.seeds), logits.device)
    return sample(logits, params.load(arrays, batch.seq_lens[: batch.batch_size]), greedy)


def step_result(plan: BatchPlan, logits: torch.Tensor, next_ids: torch.Tensor) -> PendingResult:
    """The step's ids, with the logprobs the plan asks for, on their way to the host."""
    outputs = [next_ids]
    if plan.return_logprob:
        chosen, top = logprobs_of(logits, next_ids, plan.top_logprobs_num)
        outputs.append(chosen)
        if top is not None:
            outputs += top
    return PendingResult(outputs, plan.step)
