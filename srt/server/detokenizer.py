"""Incremental detokenization with stop strings: the one place stop strings are matched (the
scheduler works on token ids only)."""

from __future__ import annotations

from collections import deque
from typing import Any


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


def fast_decode(tokenizer: Any) -> Any:
    """`tokenizer.decode`, or the same decode without transformers' wrapper around it (a
    third of the time; a stream decodes twice per event): the Rust tokenizer's own, where
    the wrapper adds nothing, i.e. a fast tokenizer that does not clean up spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


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
        self._decode_ids = fast_decode(tokenizer)
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
    def has_stop_strings(self) -> bool:
        return self._matcher is not None

    @property
    def text(self) -> str:
        """Everything decoded so far (cut before a matched stop string)."""
        return "".join(self._released) + self._held

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

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
