"""Per-request sampling parameters (SGLang's names), and the one place their values are checked.

Types are checked as strictly as JSON allows (a string is not a boolean, a float is not an
integer), and every number has both bounds, so that no value can overflow a fixed-width array
further down.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from srt.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20  # as the OpenAI API
# Stop strings are matched on every step of a request; these bound the matcher's size.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
_INT64 = 2**63


# A rule of `SamplingParams.verify`: (field, whether it holds, the rule, the value to show, or
# `_HIDDEN` to show none).
Rule = tuple[str, bool, str, Any]
_HIDDEN = object()


@dataclass
class SamplingParams:
    # None: the API's default, cut to what the context leaves after the prompt. The front end
    # resolves it before a request reaches the scheduler.
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs_num: int = 0

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> SamplingParams:
        """Parameters from a dict of SGLang's names; null means the default, as in the OpenAI
        API. Values are checked by `verify`."""
        if params is not None and not isinstance(params, Mapping):
            raise InvalidRequest(
                f"sampling_params must be an object, got {params!r}", param="sampling_params"
            )
        given = {k: v for k, v in (params or {}).items() if v is not None}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise InvalidRequest(
                f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0]
            )
        if isinstance(given.get("stop"), str):
            given["stop"] = [given["stop"]]
        return cls(**given)

    def verify(self, vocab_size: int, names: Mapping[str, str] | None = None) -> None:
        """InvalidRequest for a value out of its type or range. `names` maps a field to what
        the caller calls it (OpenAI's `max_tokens` for `max_new_tokens`), for the message."""
        rules = chain(
            self._number_rules(vocab_size), self._list_rules(vocab_size), self._output_rules()
        )
        for name, ok, rule, value in rules:
            if not ok:
                called = (names or {}).get(name, name)
                got = "" if value is _HIDDEN else f", got {value!r}"
                raise InvalidRequest(f"{called} {rule}{got}", param=called)

    def _number_rules(self, vocab_size: int) -> Iterator[Rule]:
        """(field, whether it holds, the rule, the value to show), checked in this order; each
        is computed only once those before it held."""
        m = self.max_new_tokens
        yield (
            "max_new_tokens",
            m is None or (_is_int(m) and m >= 0),
            "must be a non-negative integer",
            m,
        )
        t = self.temperature
        yield "temperature", _is_finite(t) and t >= 0, "must be >= 0", t
        yield (
            "top_p",
            _is_finite(self.top_p) and 0 < self.top_p <= 1,
            "must be in (0, 1]",
            self.top_p,
        )
        k = self.top_k
        in_vocab = f"must be -1 or in [1, {vocab_size}] (the vocabulary)"
        yield "top_k", _is_int(k) and (k == -1 or 1 <= k <= vocab_size), in_vocab, k
        yield (
            "min_p",
            _is_finite(self.min_p) and 0 <= self.min_p < 1,
            "must be in [0, 1)",
            self.min_p,
        )
        seed = self.seed
        in_range = seed is None or (_is_int(seed) and -_INT64 <= seed < _INT64)
        yield "seed", in_range, "must be a 64-bit integer", seed

    def _list_rules(self, vocab_size: int) -> Iterator[Rule]:
        stop = self.stop
        strings = isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
        yield "stop", strings, "must be a non-empty string or a list of them", _HIDDEN
        many = f"takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}"
        yield "stop", len(stop) <= MAX_STOP_STRINGS, many, _HIDDEN
        long = f"strings must be at most {MAX_STOP_STRING_CHARS} characters"
        yield "stop", all(len(s) <= MAX_STOP_STRING_CHARS for s in stop), long, _HIDDEN
        unicode = "must be valid Unicode (a lone surrogate cannot be encoded)"
        yield "stop", all(is_encodable(s) for s in stop), unicode, _HIDDEN
        ids = self.stop_token_ids
        valid = isinstance(ids, list) and all(_is_int(t) and 0 <= t < vocab_size for t in ids)
        yield "stop_token_ids", valid, f"must be a list of token ids in [0, {vocab_size})", _HIDDEN

    def _output_rules(self) -> Iterator[Rule]:
        for flag in ("ignore_eos", "skip_special_tokens", "logprobs"):
            value = getattr(self, flag)
            yield flag, isinstance(value, bool), "must be a boolean", value
        n = self.top_logprobs_num
        top = f"must be in [0, {MAX_TOP_LOGPROBS}]"
        yield "top_logprobs_num", _is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS, top, n
        yield "top_logprobs_num", self.logprobs or not n, "needs logprobs: true", _HIDDEN


def is_encodable(text: str) -> bool:
    """Whether `text` is valid Unicode: JSON's \\ud800 escapes give lone surrogates, which no
    tokenizer (nor UTF-8) can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
