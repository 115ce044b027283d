"""Request models of the HTTP API (OpenAI's and SGLang's native /generate), and the pieces of
OpenAI-shaped responses that both completion endpoints share.

Models are strict (a string is not a number) and ignore fields they do not know, as the OpenAI
API does, except OpenAI options that this server does not implement: setting one is an error.
Null for an optional field means its default, as in the OpenAI API. The models check types
only: values are checked by the request front end, with the same rules for every endpoint
(`SamplingParams.verify`), and errors name the fields by the names given here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from srt.errors import InvalidRequest
from srt.sampling_params import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as the OpenAI API
MAX_CHOICES = 128

# OpenAI options this server does not implement, with the value that means "not used": a
# request that sets one to anything else is refused rather than silently served without it.
_UNSUPPORTED: dict[str, Any] = {
    "echo": False,
    "suffix": None,
    "best_of": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "tools": [],
    "functions": [],
    "response_format": {"type": "text"},
}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # extras are checked below

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_CHOICES)
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
            if name in _UNSUPPORTED and value != _UNSUPPORTED[name]:
                raise ValueError(f"{name} is not supported by this server")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(
        self, max_new_tokens: int | None, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        """The sampling parameters of every choice (the front end gives each its seed)."""
        return SamplingParams.from_dict(
            {
                "max_new_tokens": max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "min_p": self.min_p,
                "seed": self.seed,
                "stop": self.stop,
                "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos,
                "skip_special_tokens": self.skip_special_tokens,
                "logprobs": logprobs,
                "top_logprobs_num": top_logprobs,
            }
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None

    @property
    def names(self) -> dict[str, str]:
        """What the front end's messages call OpenAI's fields."""
        return {"max_new_tokens": "max_tokens", "top_logprobs_num": "logprobs"}

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        # A list of ints was returned above; mypy cannot narrow a list by its first element.
        return list(cast(list[str] | list[list[int]], p))

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs is not None, self.logprobs or 0)


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
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def names(self) -> dict[str, str]:
        """What the front end's messages call OpenAI's fields."""
        max_name = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {"max_new_tokens": max_name, "top_logprobs_num": "top_logprobs"}

    @property
    def top_logprobs_num(self) -> int | None:
        """None without logprobs, else how many alternatives each token lists."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self) -> SamplingParams:
        max_new = (
            self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        )
        return self._params(max_new, self.logprobs, self.top_logprobs or 0)


class GenerateRequest(_Request):
    """SGLang's native /generate: `text` or `input_ids`, one or a batch (the front end parses
    them, as it does `Engine.generate`'s)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False


# ---- response pieces -----------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an aborted sequence reports as stopped."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]],
    text_of: Callable[[int], str],
    offset: int,
) -> dict[str, Any]:
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


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]],
    text_of: Callable[[int], str],
) -> dict[str, Any]:
    """/v1/chat/completions `logprobs` object."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    rows = top or [[] for _ in token_ids]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in row]}
            for t, lp, row in zip(token_ids, logprobs, rows, strict=True)
        ]
    }
