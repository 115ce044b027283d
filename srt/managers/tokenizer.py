"""Loading the Hugging Face tokenizer, and incremental detokenization with stop strings."""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from srt.model_config import ModelLoadError

# The files a Hugging Face tokenizer is loaded from (fast, SentencePiece, BPE, WordPiece,
# tiktoken); a model directory with none of them has no tokenizer to load.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
)


def check_tokenizer_files(path: str | Path) -> None:
    """ModelLoadError, in one line naming the directory, if it holds no tokenizer files (checked
    before anything starts; loading the tokenizer takes longer, and happens in parallel)."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})"
        )


def load_tokenizer(path: str | Path) -> Any:
    try:
        if _names_plain_fast_tokenizer(Path(path)):
            # What AutoTokenizer would pick, without its import of every model config, which
            # imports torch (seconds, in a process that has no other use for it).
            with _torch_hidden_from_transformers():
                from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a bad directory
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


@contextmanager
def _torch_hidden_from_transformers() -> Iterator[None]:
    """In a process that has not imported torch (the launcher), have transformers import as if
    torch were absent. Why: transformers (5.17, for one) imports torch from its fast-tokenizer
    module whenever torch is installed, 4 s on a GPU host for a process that never uses it.
    A `None` entry in `sys.modules` makes `find_spec("torch")` answer None while transformers
    imports; the entry is gone afterwards, so torch can still be imported later. Its warning
    that PyTorch is missing, meant for those who lack it, is kept out of the log."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        yield  # torch is here already, or transformers has decided: nothing to save
        return
    verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read once, when transformers imports
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
        if verbosity is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = verbosity
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.set_verbosity(
                transformers_logging.log_levels.get(verbosity or "warning", 30)
            )


def _names_plain_fast_tokenizer(path: Path) -> bool:
    """Whether the directory's tokenizer is a plain `PreTrainedTokenizerFast` (as Llama 3's
    are): its tokenizer_config.json names that class and no remote code."""
    config = path / "tokenizer_config.json"
    if not (config.is_file() and (path / "tokenizer.json").is_file()):
        return False
    try:
        cfg = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False  # AutoTokenizer reports it
    return (
        isinstance(cfg, dict)
        and cfg.get("tokenizer_class") == "PreTrainedTokenizerFast"
        and "auto_map" not in cfg
    )


class StopStringMatcher:
    """Finds the first of several stop strings in a text that arrives piece by piece, in time
    linear in the text and the stop strings together (Aho-Corasick): each character moves the
    automaton one state, never rescanning what came before.

    The state is also the longest tail of the text that is still the beginning of some stop
    string: what a stream must hold back until it completes the stop string or cannot.
    """

    def __init__(self, stops: list[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # trie edges; state 0 is the empty prefix
        self._depth = [0]  # length of the prefix each state stands for
        self._match: list[str | None] = [None]  # the longest stop string ending at the state
        for stop in stops:
            state = 0
            for ch in stop:
                if ch not in self._next[state]:
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._match.append(None)
                    self._next[state][ch] = len(self._next) - 1
                state = self._next[state][ch]
            self._match[state] = stop
        # Failure links, breadth first: the longest proper suffix of a state that is a state.
        self._fail = [0] * len(self._next)
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self._next[state].items():
                queue.append(child)
                self._fail[child] = self._step(self._fail[state], ch)
                if self._match[child] is None:
                    self._match[child] = self._match[self._fail[child]]
        self.state = 0

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; at the first stop string completed, (the offset in `text` just
        past it, the stop string), and the rest of `text` is not read."""
        for i, ch in enumerate(text):
            self.state = self._step(self.state, ch)
            match = self._match[self.state]
            if match is not None:
                return i + 1, match
        return None

    @property
    def pending(self) -> int:
        """Characters at the end of the text fed so far that may begin a stop string."""
        return self._depth[self.state]


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Text is released only once it is final: bytes of an unfinished UTF-8 character wait for
    the next token, and a tail that could begin a stop string waits until it either completes
    the stop string (and is cut) or cannot any more. This is the one place stop strings are
    matched: the scheduler works on token ids only.

    Each push decodes a window of a few tokens and handles only the new text, so a step costs
    the same however long the output already is.
    """

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, stop: list[str] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._released: list[str] = []  # the deltas returned so far
        self._held = ""  # decoded but not yet returned (a possible stop string's beginning)
        self.stopped = False  # a stop string matched: the text ends before it, for good
        self.matched_stop: str | None = None
        self._matcher = StopStringMatcher(stop) if stop else None
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def text(self) -> str:
        """Everything decoded so far (cut before a matched stop string)."""
        return "".join(self._released) + self._held

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.stopped:
            return ""
        # Decode a short window: the tokens before the read offset give context for spacing.
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new = self._decode(self.ids[self._prefix_offset :])
        piece = ""
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            piece = new[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release(piece, final=False)

    def finish(self) -> str:
        """The rest of the text, cut before the first stop string."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self._prefix_offset :])
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        self._prefix_offset = self._read_offset = len(self.ids)
        return self._release(tail[len(prefix) :], final=True)

    def _release(self, piece: str, final: bool) -> str:
        held = self._held + piece
        end = len(held)
        if self._matcher is not None:
            hit = self._matcher.feed(piece)
            if hit is not None:
                # A stop string begins within the held tail (what came before could not).
                stop_end, self.matched_stop = len(self._held) + hit[0], hit[1]
                end = max(stop_end - len(hit[1]), 0)
                held = held[:end]
                self.stopped = True
            elif not final:
                end -= self._matcher.pending
        delta, self._held = held[:end], held[end:]
        if delta:
            self._released.append(delta)
        return delta
