"""What a single sequence may ask of the served model and KV cache: the one rule, applied by the
request front end before a request is sent and by the scheduler to whatever it admits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from srt.errors import InvalidRequest
from srt.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What the served model and KV cache allow a single sequence."""

    vocab_size: int
    context_length: int
    kv_capacity: int


def check_seq(
    input_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    names: Mapping[str, str] | None = None,
) -> None:
    """InvalidRequest for a sequence that can never be served (its max_new_tokens resolved)."""
    if not input_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    vocab = limits.vocab_size
    bad = [
        t
        for t in input_ids
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)
    ]
    if bad:
        raise InvalidRequest(
            f"invalid token id {bad[0]!r}: ids must be in [0, {vocab})", param="prompt"
        )
    context = limits.context_length
    if len(input_ids) >= context:
        raise InvalidRequest(
            f"the prompt has {len(input_ids)} tokens; the context length is {context}",
            param="prompt",
            code="context_length_exceeded",
        )
    if params.max_new_tokens is None:
        raise TypeError("max_new_tokens is resolved by the front end before this check")
    need = len(input_ids) + params.max_new_tokens
    if need > context:
        raise InvalidRequest(
            f"the context length is {context} tokens, but the request asks for {need} "
            f"({len(input_ids)} in the prompt, {params.max_new_tokens} to generate)",
            param=(names or {}).get("max_new_tokens", "max_new_tokens"),
            code="context_length_exceeded",
        )
    if need > limits.kv_capacity:
        raise InvalidRequest(
            f"the request needs {need} KV slots; the KV cache holds {limits.kv_capacity}"
        )
