"""Per-request sampling parameters (SGLang's names), validated once at submission."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
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
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        params = dict(params or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        for key in ("stop", "stop_token_ids"):
            if params.get(key) is None:
                params.pop(key, None)
        out = cls(**params)
        out.verify()
        return out

    def verify(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
              f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        check(_is_number(self.temperature) and self.temperature >= 0,
              f"temperature must be >= 0, got {self.temperature!r}")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1,
              f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
              f"top_k must be -1 or >= 1, got {self.top_k!r}")
        check(_is_number(self.min_p) and 0 <= self.min_p < 1,
              f"min_p must be in [0, 1), got {self.min_p!r}")
        check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63),
              f"seed must be a 64-bit integer, got {self.seed!r}")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
              "stop must be a non-empty string or a list of them")
        check(isinstance(self.stop_token_ids, list)
              and all(_is_int(t) for t in self.stop_token_ids),
              "stop_token_ids must be a list of integers")
        check(_is_int(self.top_logprobs_num) and 0 <= self.top_logprobs_num <= 20,
              f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num!r}")
        check(self.logprobs or not self.top_logprobs_num,
              "top_logprobs_num needs logprobs: true")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
