"""A tokenizer of Llama 3's size and layout, built without a download, for the model shapes'
directories: so that a startup bench loads what a real model's tokenizer process loads.

Llama 3's vocabulary: 128,000 byte-level BPE tokens, then 256 special tokens from id 128,000
(`<|begin_of_text|>`, `<|end_of_text|>`, the chat headers, `<|eot_id|>` and reserved ones).
The BPE here is built from its vocabulary, not trained: the 256 byte symbols, then merges of
two earlier tokens drawn from a seeded generator (shorter, older tokens more often, as in a
trained vocabulary) until there are 128,000, each merge's result a token of its own. Every
text encodes (every byte is a token) and decodes back; the ids mean nothing, as the random
weights behind them do not.

Built once into `$XDG_CACHE_HOME/srt/llama3-tokenizer-v2` (renamed into place whole) and
copied from there.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from srt.tools.user_cache import built_once

REGULAR_TOKENS = 128_000
SPECIAL_TOKENS = 256
VOCAB_SIZE = REGULAR_TOKENS + SPECIAL_TOKENS
BOS_ID, EOS_ID = 128_000, 128_001
_NAMED_SPECIALS = {
    128_000: "<|begin_of_text|>",
    128_001: "<|end_of_text|>",
    128_006: "<|start_header_id|>",
    128_007: "<|end_header_id|>",
    128_008: "<|eom_id|>",
    128_009: "<|eot_id|>",
}
_LONGEST_TOKEN = 16  # characters of the byte alphabet
_SEED = 0
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def special_tokens() -> list[str]:
    return [
        _NAMED_SPECIALS.get(i, f"<|reserved_special_token_{i - REGULAR_TOKENS}|>")
        for i in range(REGULAR_TOKENS, VOCAB_SIZE)
    ]


def bpe_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The regular tokens (id by token) and the merges that make them, in rank order."""
    from tokenizers import pre_tokenizers

    rng = random.Random(_SEED)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    while len(tokens) < REGULAR_TOKENS:
        # Squared draws favour the early (short, frequent) tokens, as BPE's merge order does.
        a = tokens[int(len(tokens) * rng.random() ** 2)]
        b = tokens[int(len(tokens) * rng.random() ** 2)]
        merged = a + b
        if len(merged) > _LONGEST_TOKEN or merged in vocab:
            continue
        vocab[merged] = len(tokens)
        tokens.append(merged)
        merges.append((a, b))
    return vocab, merges


def build_tokenizer() -> Any:
    """The tokenizer (a transformers PreTrainedTokenizerFast), built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = bpe_vocabulary()
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens()
    tok.add_special_tokens(specials)
    bos = specials[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS_ID)]),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=specials[EOS_ID - REGULAR_TOKENS],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(directory: Path) -> None:
    build_tokenizer().save_pretrained(directory)
    # The class Llama 3's files name (transformers 5 writes its own alias), which is what lets
    # the tokenizer process load it without AutoTokenizer's imports.
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=131072)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tokenizer_dir() -> Path:
    """The directory of the saved tokenizer, built on first use (see the module)."""
    return built_once("llama3-tokenizer-v2", "tokenizer.json", save_tokenizer)


def install_tokenizer(model_dir: Path) -> None:
    """Put the tokenizer's files into `model_dir`, over any tokenizer there."""
    for old in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_dir / old).unlink(missing_ok=True)
    for path in tokenizer_dir().iterdir():
        shutil.copy2(path, model_dir / path.name)
