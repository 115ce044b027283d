"""What a sequence produced, as the callers of generation see it: text deltas per step, folded
into whole results, for `Engine.generate` and the HTTP API alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srt.ipc.messages import TokenOutput
from srt.sampling_params import SamplingParams
from srt.server.detokenizer import IncrementalDetokenizer


@dataclass
class SeqUpdate:
    """What one step added to one sequence (`index` is its place in the request)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class SeqResult:
    """A whole sequence: the updates of one index folded together."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, u: SeqUpdate) -> None:
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs
        self.top_logprobs += u.top_logprobs
        self.finish_reason, self.matched_stop = u.finish_reason, u.matched_stop
        self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens
        self.cached_tokens = u.cached_tokens

    def native(self) -> dict[str, Any]:
        """SGLang's result shape: text, output_ids and meta_info, with (logprob, token id)
        pairs when logprobs were asked for."""
        meta: dict[str, Any] = {
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.logprobs:
            meta["output_token_logprobs"] = list(zip(self.logprobs, self.token_ids, strict=True))
        if self.top_logprobs:
            meta["output_top_logprobs"] = [[(v, t) for t, v in row] for row in self.top_logprobs]
        return {"text": self.text, "output_ids": self.token_ids, "meta_info": meta}


def coalesce(outputs: list[TokenOutput]) -> list[TokenOutput]:
    """Outputs of the same sequence folded into one, in order of first arrival: a consumer that
    fell behind by several steps handles (and streams) them as one update, not one each."""
    if len(outputs) == 1:
        return outputs
    merged: dict[str, TokenOutput] = {}
    for out in outputs:
        prev = merged.get(out.rid)
        if prev is None:
            merged[out.rid] = out
            continue
        merged[out.rid] = TokenOutput(
            rid=out.rid,
            new_token_ids=prev.new_token_ids + out.new_token_ids,
            finished_reason=out.finished_reason,
            matched_stop=out.matched_stop,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=prev.logprobs + out.logprobs,
            top_logprobs=prev.top_logprobs + out.top_logprobs,
            error=prev.error or out.error,
        )
    return list(merged.values())


class SeqDecoder:
    """Turns one sequence's token outputs from the scheduler into updates: text deltas, cut at
    the sequence's first stop string. The scheduler sees only ids, so a sequence that a stop
    string ends is still running there: `update` says so, and the caller aborts it."""

    def __init__(self, index: int, tokenizer: Any, params: SamplingParams) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop)
        self.completion_tokens = 0
        self.finished = False

    def update(self, out: TokenOutput) -> tuple[SeqUpdate, bool]:
        """(the update, whether the scheduler must be told to stop the sequence)."""
        text, kept = "", 0
        finish, matched = out.finished_reason, out.matched_stop
        if self.detok.has_stop_strings:
            for token in out.new_token_ids:  # one at a time, to know which token ends it
                text += self.detok.push([token])
                kept += 1
                if self.detok.stopped:
                    finish, matched = "stop", self.detok.matched_stop
                    break
        else:
            # Every token is kept: the tokens of several steps (a consumer that fell behind)
            # decode in one push, not one push (two decodes) each.
            text, kept = self.detok.push(out.new_token_ids), len(out.new_token_ids)
        if finish is not None:
            text += self.detok.finish()
            self.finished = True
        self.completion_tokens += kept
        update = SeqUpdate(
            index=self.index,
            text=text,
            token_ids=out.new_token_ids[:kept],
            logprobs=out.logprobs[:kept],
            top_logprobs=out.top_logprobs[:kept],
            finish_reason=finish,
            matched_stop=matched,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=out.cached_tokens,
        )
        return update, finish is not None and out.finished_reason is None
