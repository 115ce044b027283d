"""Loading the Hugging Face tokenizer, and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from srt.model_config import ModelLoadError


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a bad directory
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Text is released only once it is final: bytes of an unfinished UTF-8 character wait for
    the next token, and a tail that could begin a stop string waits until it either completes
    the stop string (and is cut) or cannot any more.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` already returned
        self.stopped = False  # a stop string matched: the text ends before it, for good
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.stopped:
            return ""
        # Decode a short window: the tokens before the read offset give context for spacing.
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        new = self._decode(self.ids[self._prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.text += new[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, cut before the first stop string."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self._prefix_offset:])
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        self.text += tail[len(prefix):]
        self._prefix_offset = self._read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            end = cut
            self.stopped = True
        elif not final:
            end -= self._stop_prefix_len()
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
