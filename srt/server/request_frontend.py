"""The request front end: the one place a generation request is parsed, validated, tokenized and
normalised, for `Engine.generate` and every HTTP endpoint alike.

What comes out is a list of `Seq`: token ids and fully resolved sampling parameters, each of
which the scheduler can serve (`check_seq` is the rule, and the scheduler applies the same one
to whatever reaches it). Tokenizing runs in whatever thread calls this: the server calls it off
its event loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from srt.errors import InvalidRequest
from srt.request_limits import RequestLimits, check_seq
from srt.sampling_params import SamplingParams, is_encodable

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, for /generate and Engine.generate
# The prompt's length in characters is checked before tokenizing, against the most characters
# that the context's tokens could hold. A token holds at most as many characters as the
# longest vocabulary entry, and Unicode normalisation can fold a few characters into one.
_NORMALISATION_FOLD = 4

Prompt = str | list[int]


@dataclass
class Seq:
    """One sequence, ready for the scheduler."""

    input_ids: list[int]
    params: SamplingParams


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request seeded with `seed`: the seed itself for the
    first, a 64-bit mix of both for the others (seed + choice would leave the 64-bit range and
    make neighbouring seeds share streams)."""
    if seed is None or choice == 0:
        return seed
    x = (seed + choice * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # SplitMix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x  # as a signed 64-bit integer


def parse_native_prompts(
    text: Any, input_ids: Any, text_name: str = "text"
) -> tuple[bool, list[Prompt]]:
    """(whether one prompt was given, the prompts) of SGLang's native form: `text_name` (a
    string or a list of them) or `input_ids` (a list of ids or a list of such lists)."""
    if (text is None) == (input_ids is None):
        raise InvalidRequest(f"give exactly one of {text_name} and input_ids")
    if text is not None:
        if isinstance(text, str):
            return True, [text]
        if not (isinstance(text, list) and all(isinstance(p, str) for p in text)):
            raise InvalidRequest(
                f"{text_name} must be a string or a list of strings", param=text_name
            )
        return False, list(text)
    if not isinstance(input_ids, list | tuple):
        raise InvalidRequest(
            "input_ids must be a list of token ids or a list of such lists", param="input_ids"
        )
    nested = [isinstance(i, list | tuple) for i in input_ids]
    if input_ids and all(nested):
        return False, [list(i) for i in input_ids]
    if any(nested):
        raise InvalidRequest("input_ids mixes token ids and lists of token ids", param="input_ids")
    return True, [list(input_ids)]


def native_params(raw: Any, n: int) -> list[SamplingParams]:
    """Per-prompt parameters from SGLang's `sampling_params`: one dict for all, or a list."""
    if isinstance(raw, list):
        if len(raw) != n:
            raise InvalidRequest(
                f"sampling_params list must match the number of prompts: "
                f"{len(raw)} entries for {n} prompts",
                param="sampling_params",
            )
        return [SamplingParams.from_dict(p) for p in raw]
    return [SamplingParams.from_dict(raw) for _ in range(n)]


class RequestFrontend:
    def __init__(self, tokenizer: Any, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        longest_token = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = limits.context_length * longest_token * _NORMALISATION_FOLD

    # ---- prompts ------------------------------------------------------------------------

    def check_text(self, text: str, what: str = "the prompt", param: str = "prompt") -> None:
        """Reject text that cannot be tokenized, or that is too long to, before trying."""
        if len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"{what} has {len(text)} characters; at most {self.max_prompt_chars} can fit "
                f"in the context length of {self.limits.context_length} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if not is_encodable(text):
            raise InvalidRequest(
                f"{what} is not valid Unicode (a lone surrogate cannot be encoded)", param=param
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids of a chat, through the model's chat template."""
        for m in messages:
            self.check_text(m["content"], what="a message", param="messages")
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja raises its own types for templates that reject input
            raise InvalidRequest(f"cannot apply the chat template: {e}", param="messages") from e
        return self.encode(prompt, add_special_tokens=False)  # the template has them

    # ---- whole requests -----------------------------------------------------------------

    def seqs(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        num_choices: int = 1,
        default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
        names: Mapping[str, str] | None = None,
    ) -> list[Seq]:
        """`num_choices` sequences per prompt (prompt-major), each prompt with its params.

        An unset max_new_tokens is `default_max_new_tokens` (None: no default) cut to what the
        context leaves; a set one that does not fit is an error. `names` maps parameter names
        to the caller's own, for messages.
        """
        out = []
        for prompt, p in zip(prompts, params, strict=True):
            p.verify(self.limits.vocab_size, names)
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            max_new = p.max_new_tokens
            if max_new is None:
                left = max(self.limits.context_length - len(ids), 0)
                max_new = (
                    left if default_max_new_tokens is None else min(default_max_new_tokens, left)
                )
            p = dataclasses.replace(p, max_new_tokens=max_new)
            check_seq(ids, p, self.limits, names)
            out += [
                Seq(ids, dataclasses.replace(p, seed=choice_seed(p.seed, i)))
                for i in range(num_choices)
            ]
        return out

    def native(
        self, text: Any, input_ids: Any, sampling_params: Any, text_name: str = "text"
    ) -> tuple[bool, list[Seq]]:
        """SGLang's native request (/generate, Engine.generate): (single, sequences)."""
        single, prompts = parse_native_prompts(text, input_ids, text_name)
        return single, self.seqs(prompts, native_params(sampling_params, len(prompts)))
