"""Published model shapes (their config.json fields) for benchmarks without a download.

`write_model_shape` writes a model directory with a shape's config.json and tokenizer files,
but no weights: load it with `--load-format dummy` (random weights drawn on the device), or
fill it with `srt.tools.make_random_checkpoint` to measure a real load. A shape with Llama 3's
vocabulary gets a tokenizer of that size and layout (`llama3_tokenizer`: its load is a real
model's), any other the tiny model's; either way text is gibberish, and benchmarks send ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
}


def check_shape_name(name: str) -> None:
    if name not in MODEL_SHAPES:
        raise ValueError(
            f"--model-shape: unknown shape {name!r}; choose one of {sorted(MODEL_SHAPES)}"
        )


def write_model_shape(name: str, directory: Path) -> Path:
    """`directory / name` with `name`'s config.json (bfloat16) and its tokenizer (see the
    module); no weight files."""
    from srt.tools import llama3_tokenizer
    from srt.tools.make_tiny_model import make_tiny_model

    check_shape_name(name)
    path = make_tiny_model(directory / name)
    for weights in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        weights.unlink()  # tiny weights of the wrong shape: never to be loaded by mistake
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("rope_parameters", None)
    config.update(
        MODEL_SHAPES[name],
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        torch_dtype="bfloat16",
        dtype="bfloat16",
        rms_norm_eps=1e-5,
    )
    if config["vocab_size"] == llama3_tokenizer.VOCAB_SIZE:
        llama3_tokenizer.install_tokenizer(path)
        config.update(bos_token_id=llama3_tokenizer.BOS_ID, eos_token_id=llama3_tokenizer.EOS_ID)
        config.pop("pad_token_id", None)  # the tiny one's: an ordinary token here
    config_file.write_text(json.dumps(config, indent=2))
    return path
