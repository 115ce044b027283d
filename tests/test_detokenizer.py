"""Incremental detokenization: deltas add up to the full decode; stop strings are held back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from srt.ipc.messages import TokenOutput
from srt.model_config import ModelLoadError
from srt.sampling_params import SamplingParams
from srt.server.detokenizer import IncrementalDetokenizer, StopStringMatcher, fast_decode
from srt.server.hf_tokenizer import load_tokenizer
from srt.server.seq_outputs import SeqDecoder

UNICODE_TEXT = "héllo ✓ 日本語 🙂 naïve café — “quoted” 12345\n\tthe end. Ωμέγα 한국어 👩‍👩‍👧"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request: pytest.FixtureRequest, tiny_model_factory) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_factory(request.param))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Push `ids` `chunk` at a time; every delta, the finish() one last."""
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.finish()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_add_up_to_the_full_decode(tokenizer: Any, chunk: int) -> None:
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    assert len(ids) > 40  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == detok.text == UNICODE_TEXT
    assert not any("\ufffd" in d for d in deltas)  # half characters are never released


def test_random_ids_match_the_full_decode(tokenizer: Any) -> None:
    """What a random-weight model emits (byte soup, stray continuation bytes) still adds up."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer)
        assert "".join(stream(detok, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello there") + [tokenizer.eos_token_id]
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(stream(skipped, ids)) == "Hello there"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "<|begin_of_text|>Hello there<|end_of_text|>"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["before"], "The lighthouse keeper woke "),
        (["zzz", "keeper w"], "The lighthouse "),
        (["ke"], "The lighthouse "),
        (["日本"], "The lighthouse keeper woke before the gulls, héllo "),
        (["gulls, hé"], "The lighthouse keeper woke before the "),
        (["s, h"], "The lighthouse keeper woke before the gull"),
    ],
)
@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_is_never_emitted(
    tokenizer: Any, stop: list[str], expected: str, chunk: int
) -> None:
    ids = tokenizer.encode(
        "The lighthouse keeper woke before the gulls, héllo 日本語 🙂", add_special_tokens=False
    )
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    emitted = ""
    for delta in stream(detok, ids, chunk):
        emitted += delta
        assert expected.startswith(emitted), (emitted, expected)  # never a char past the cut
    assert emitted == detok.text == expected
    assert detok.push(tokenizer.encode(" more", add_special_tokens=False)) == ""
    assert detok.finish() == "" and detok.text == expected


def test_possible_stop_prefix_held_then_released(tokenizer: Any) -> None:
    text = "The lighthouse keeper wi"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["keeper wins"])
    emitted = ""
    for i in range(len(ids)):
        emitted += detok.push(ids[i : i + 1])
        if detok.text.endswith("keeper"):
            assert emitted == "The lighthouse "  # "keeper" might begin the stop string
    assert emitted == "The lighthouse "  # "keeper wi" might still become "keeper wins"
    emitted += detok.finish()
    assert emitted == text


def test_stop_prefix_released_once_impossible(tokenizer: Any) -> None:
    ids = tokenizer.encode("a keeper of bees", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["keeper wins"])
    emitted = "".join(detok.push([i]) for i in ids)
    assert emitted == "a keeper of bees"  # released without finish(): it can't be the stop


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The reference: the stop string that ends first in `text` (the longest of those ending
    there), as (its end, it)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def test_stop_matcher_finds_what_a_scan_finds() -> None:
    rng = random.Random(0)
    for _ in range(500):
        stops = [
            "".join(rng.choice("ab") for _ in range(rng.randrange(1, 5)))
            for _ in range(rng.randrange(1, 4))
        ]
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 20)))
        matcher, fed, hit = StopStringMatcher(stops), 0, None
        while fed < len(text) and hit is None:  # fed in random pieces, as tokens arrive
            piece = text[fed : fed + rng.randrange(1, 4)]
            found = matcher.feed(piece)
            hit = (fed + found[0], found[1]) if found else None
            fed += len(piece)
        assert hit == first_stop(text, stops), (text, stops)
        if hit is None:  # what may still begin a stop string: the longest such tail
            assert matcher.pending == max(
                (
                    n
                    for n in range(len(text) + 1)
                    for s in stops
                    if n < len(s) and text.endswith(s[:n])
                ),
                default=0,
            )


def test_stop_check_reads_each_character_once(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop check is linear: however many stop strings (64 of 1 KB here, each a near
    miss of the text), each character of the output is fed to the matcher once, rather than
    the whole text searched for every stop string at every token."""
    fed: list[int] = []
    feed = StopStringMatcher.feed
    monkeypatch.setattr(
        StopStringMatcher, "feed", lambda self, text: fed.append(len(text)) or feed(self, text)
    )
    ids = tokenizer.encode(UNICODE_TEXT * 4, add_special_tokens=False)
    stops = [UNICODE_TEXT[:5] * 200 + str(i) for i in range(64)]
    detok = IncrementalDetokenizer(tokenizer, stop=stops)
    text = "".join(stream(detok, ids))
    assert text == UNICODE_TEXT * 4 and not detok.stopped
    assert sum(fed) == len(text)


def test_load_tokenizer_errors_name_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


class CountingTokenizer:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_push_decodes_a_window_not_the_whole_output(tokenizer: Any) -> None:
    ids = tokenizer.encode(UNICODE_TEXT * 4, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, stop=["never appears"])
    assert "".join(stream(detok, ids)) == UNICODE_TEXT * 4
    # A window spans the tokens of the last character or two, however long the output.
    assert max(counting.decoded) <= 16 < len(ids)


@pytest.mark.parametrize("stop", [None, ["日本"]], ids=["no-stop", "stop-string"])
def test_a_sequence_decodes_the_same_however_its_steps_are_grouped(
    tokenizer: Any, stop: list[str] | None
) -> None:
    """A consumer that fell behind gets several steps' tokens in one output: its text and kept
    ids are those of one token at a time (pushed at once without stop strings, one by one to
    find the token that completes a stop string)."""
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids), stop=stop)

    def run(groups: list[list[int]]) -> tuple[str, list[int], str | None]:
        decoder = SeqDecoder(0, tokenizer, params)
        text, kept, reason = "", [], None
        for k, group in enumerate(groups):
            last = k == len(groups) - 1
            update, _ = decoder.update(TokenOutput("r", group, "length" if last else None))
            text, kept, reason = text + update.text, kept + update.token_ids, update.finish_reason
            if reason is not None:
                break
        return text, kept, reason

    one_by_one = run([[t] for t in ids])
    assert run([ids[i : i + 7] for i in range(0, len(ids), 7)]) == one_by_one
    if stop:
        assert one_by_one[2] == "stop" and one_by_one[0] == UNICODE_TEXT.split("日本")[0]
    else:
        assert one_by_one == (UNICODE_TEXT, ids, "length")


def test_the_rust_decode_only_where_it_is_the_same_decode(tokenizer: Any) -> None:
    """Streams decode with the Rust tokenizer's own decode when transformers' wrapper adds
    nothing (it does not clean up spaces), and give the wrapper's text for any ids, special
    or not; a tokenizer that cleans up spaces keeps the wrapper."""
    assert not tokenizer.clean_up_tokenization_spaces
    decode = fast_decode(tokenizer)
    assert decode == tokenizer.backend_tokenizer.decode
    rng = random.Random(1)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert fast_decode(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False
