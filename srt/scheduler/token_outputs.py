"""What a sampled id does to its request: it joins the outputs, with its logprobs, and may
stop the request (a stop token, eos, or max_new_tokens); and the output that tells the
tokenizer side, when one is due (`--stream-interval`): a row of the step's `StepOutputs`."""

from __future__ import annotations

from typing import Any

from srt.ipc.messages import BatchResult, StepOutputsBuilder, TokenOutput
from srt.scheduler.req import Req


def take_sample(req: Req, token: int, result: BatchResult, i: int, eos_token_ids: set[int]) -> int:
    """Apply `token`, the id sampled at row `i` of `result`, to `req`, whose prompt is done:
    how many ids it adds (none for a request that asked for no new tokens: it is finished)."""
    if req.max_new_tokens == 0:
        req.finished_reason = "length"
        return 0
    req.output_ids.append(token)
    if result.logprobs is not None and req.params.logprobs:
        _record_logprobs(req, result, i)
    _check_finished(req, token, eos_token_ids)
    return 1


def add_output_if_due(req: Req, stream_interval: int, outputs: StepOutputsBuilder) -> None:
    """Add what `req` produced since its last output to `outputs`, if an output is due now:
    at its end always, and while it runs its first token at once (the time to first token is
    the client's) and then every `stream_interval` tokens."""
    unsent = len(req.output_ids) - req.sent_ids
    if req.finished_reason is None and (unsent == 0 or (req.sent_ids and unsent < stream_interval)):
        return
    new_ids = req.output_ids[req.sent_ids :]
    req.sent_ids = len(req.output_ids)
    outputs.add(*_output_fields(req, new_ids))


def token_output(req: Req, new_ids: list[int]) -> TokenOutput:
    return TokenOutput(*_output_fields(req, new_ids))


def _output_fields(req: Req, new_ids: list[int]) -> tuple[Any, ...]:
    """The fields of `req`'s output of `new_ids`, in `TokenOutput`'s order."""
    return (
        req.rid,
        new_ids,
        req.finished_reason,
        req.matched_stop,
        len(req.input_ids),
        len(req.output_ids),
        req.cached_tokens,
        req.logprobs[-len(new_ids) :] if new_ids and req.logprobs else [],
        req.top_logprobs[-len(new_ids) :] if new_ids and req.top_logprobs else [],
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


def _check_finished(req: Req, token: int, eos_token_ids: set[int]) -> None:
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        req.finished_reason, req.matched_stop = "stop", token
    elif len(req.output_ids) >= req.max_new_tokens:
        req.finished_reason = "length"
