"""Loading the Hugging Face tokenizer: torch-free where it can be, its files checked up front."""

from __future__ import annotations

import json
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
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a bad directory
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


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
