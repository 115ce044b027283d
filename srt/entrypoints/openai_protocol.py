"""Request models of the HTTP API (OpenAI's and SGLang's native /generate), and the pieces of
OpenAI-shaped responses that both completion endpoints share.

Models are strict (a string is not a number) and ignore fields they do not know, as the OpenAI
API does, except OpenAI options that this server does not implement: setting one is an error.
Sampling values are range-checked once more by `SamplingParams.verify`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from srt.sampling_params import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as the OpenAI API

# OpenAI options this server does not implement, with the value that means "not used": a
# request that sets one to anything else is refused rather than silently served without it.
_UNSUPPORTED = {"echo": False, "suffix": None, "best_of": 1, "presence_penalty": 0,
                "frequency_penalty": 0, "logit_bias": {}, "tools": [], "functions": [],
                "response_format": {"type": "text"}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # extras are checked below

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions with SGLang's and vLLM's names (the OpenAI client sends them in extra_body).
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingRequest:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in (None, _UNSUPPORTED[name]):
                raise ValueError(f"{name} is not supported by this server")
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_new_tokens: int, top_logprobs: int | None,
                        choice: int) -> SamplingParams:
        """Parameters of one choice; with a seed, choice i draws with seed + i."""
        return SamplingParams.from_dict({
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": None if self.seed is None else self.seed + choice,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": top_logprobs is not None,
            "top_logprobs_num": top_logprobs or 0,
        })


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def top_logprobs_num(self) -> int | None:
        """None without logprobs, else how many alternatives each token lists."""
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(_Request):
    """SGLang's native /generate: `text` or `input_ids`, one or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False

    def batch(self) -> tuple[bool, list[str | list[int]]]:
        """(single, prompts)."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if isinstance(self.text, str):
            return True, [self.text]
        if self.text is not None:
            prompts: list[Any] = self.text
        elif self.input_ids and isinstance(self.input_ids[0], int):
            return True, [self.input_ids]
        else:
            prompts = self.input_ids or []
        if not prompts:
            raise ValueError("the batch of prompts is empty")
        return False, list(prompts)

    def params_for(self, n: int) -> list[SamplingParams]:
        if isinstance(self.sampling_params, list):
            if len(self.sampling_params) != n:
                raise ValueError(f"sampling_params has {len(self.sampling_params)} entries "
                                 f"for {n} prompts")
            return [SamplingParams.from_dict(p) for p in self.sampling_params]
        return [SamplingParams.from_dict(self.sampling_params) for _ in range(n)]


# ---- response pieces -----------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an aborted sequence reports as stopped."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_logprobs(token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], text_of: Callable[[int], str],
                        offset: int) -> dict[str, Any]:
    """/v1/completions `logprobs` object; `offset` is where these tokens start in the text."""
    tokens = [text_of(t) for t in token_ids]
    # Keyed by text, as OpenAI has it: tokens that decode alike (partial characters) share a
    # key, and the likelier one, listed first, must win.
    top_dicts = [{text_of(t): v for t, v in reversed(row)} for row in top]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top_dicts or None,
        "text_offset": offsets,
    }


def chat_logprobs(token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], text_of: Callable[[int], str]
                  ) -> dict[str, Any]:
    """/v1/chat/completions `logprobs` object."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    rows = top or [[] for _ in token_ids]
    return {"content": [
        {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in row]}
        for t, lp, row in zip(token_ids, logprobs, rows, strict=True)
    ]}
