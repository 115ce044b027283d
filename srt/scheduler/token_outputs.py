"""What a sampled id does to its request: it joins the outputs, with its logprobs, and may
stop the request (a stop token, eos, or max_new_tokens); and the outputs that tell the
tokenizer side, when one is due (`--stream-interval`): rows of the step's `StepOutputs`."""

from __future__ import annotations

from srt.ipc.messages import BatchResult, StepOutputsBuilder, TokenOutput
from srt.scheduler.req import Req


def take_sample(req: Req, token: int, result: BatchResult, i: int, eos_token_ids: set[int]) -> int:
    """Apply `token`, the id sampled at row `i` of `result`, to `req`, whose prompt is done:
    how many ids it adds (none for a request that asked for no new tokens: it is finished)."""
    if req.max_new_tokens == 0:
        req.finished_reason = "length"
        return 0
    output_ids = req.output_ids
    output_ids.append(token)
    p = req.params
    if result.logprobs is not None and p.logprobs:
        _record_logprobs(req, result, i)
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        req.finished_reason, req.matched_stop = "stop", token
    elif len(output_ids) >= req.max_new_tokens:
        req.finished_reason = "length"
    return 1


def add_outputs_if_due(reqs: list[Req], stream_interval: int, outputs: StepOutputsBuilder) -> None:
    """Add what each of `reqs` produced since its last output to `outputs`, if an output is
    due now: at its end always, and while it runs its first token at once (the time to first
    token is the client's) and then every `stream_interval` tokens."""
    due: list[Req] = []
    counts: list[int] = []
    token_ids: list[int] = []
    for req in reqs:
        sent, known = req.sent_ids, len(req.output_ids)
        if req.finished_reason is None and (
            known == sent or (sent and known - sent < stream_interval)
        ):
            continue
        due.append(req)
        counts.append(known - sent)
        token_ids += req.output_ids[sent:]
        req.sent_ids = known
    _add_outputs(due, counts, token_ids, outputs)


def token_output(req: Req) -> TokenOutput:
    """`req`'s output of no new ids, on its own (an abort's answer)."""
    outputs = StepOutputsBuilder()
    _add_outputs([req], [0], [], outputs)
    [output] = outputs.build().unpack()
    return output


def _add_outputs(
    reqs: list[Req], counts: list[int], token_ids: list[int], outputs: StepOutputsBuilder
) -> None:
    """Add the output of each of `reqs` to `outputs`, as columns: its `counts` new ids, the
    last ones it knows, concatenated in `token_ids`."""
    outputs.add(
        [r.rid for r in reqs],
        counts,
        token_ids,
        [r.finished_reason for r in reqs],
        [r.matched_stop for r in reqs],
        [r.prompt_len for r in reqs],
        [len(r.output_ids) for r in reqs],
        [r.cached_tokens for r in reqs],
        # A request's top logprobs are recorded with its logprobs, never alone.
        {
            j: (r.logprobs[-counts[j] :], r.top_logprobs[-counts[j] :])
            for j, r in enumerate(reqs)
            if r.logprobs and counts[j]
        },
    )


def _record_logprobs(req: Req, result: BatchResult, i: int) -> None:
    assert result.logprobs is not None, "only for a result that carries logprobs"
    req.logprobs.append(float(result.logprobs[i]))
    n = req.params.top_logprobs_num
    if n and result.top_logprob_ids is not None and result.top_logprob_vals is not None:
        req.top_logprobs.append(
            [
                (int(t), float(v))
                for t, v in zip(
                    result.top_logprob_ids[i][:n], result.top_logprob_vals[i][:n], strict=True
                )
            ]
        )
