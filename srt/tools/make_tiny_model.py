"""Write a tiny random-weight Hugging Face checkpoint (config, safetensors, tokenizer).

The tiny llama written here is the built-in default model: it is what the server serves when no
model path is given (so the README's main job runs anywhere, without downloads), and the tests
build llama / qwen2 / qwen3 variants of it to exercise the real loading paths on CPU in seconds.

The weights are random, so the text is gibberish, but the checkpoint is a faithful one: it loads
with ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and its next-token logits are well
separated, so greedy decoding is reproducible across implementations.

    python -m srt.tools.make_tiny_model /tmp/tiny --arch qwen3 --num-shards 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from srt.model_config import DTYPE_NAMES
from srt.tools.cli import keyword_options
from srt.tools.user_cache import built_once

# torch and transformers are imported only where a model is made, so that finding the default
# model (as the server's launcher does before it starts anything) stays light.
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

# Llama-3-shaped turns, but the role headers are plain text (the tiny vocab has only 3 specials),
# and every turn ends with eos so that a generated answer stops on the model's eos token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n\\n' + (message['content'] | trim) + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split (as in transformers' tokenization_qwen2.py and Qwen's tokenizer.json).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Measured over 64 greedy tokens x 5 prompts x {llama,qwen2,qwen3} x {tied,untied}: the
# transformers default of 0.02 gives a median top-2 logit gap of ~0.03 with 1-2% of steps under
# 1e-3 (and tied models that repeat one token forever); 0.2 gives a median gap of ~0.35, almost
# no steps under 1e-3, varied output, and |logits| < 10, far from trouble in bf16/fp16.
INITIALIZER_RANGE = 0.2

# Original prose for training the byte-level BPE. Its content only shapes which merges exist;
# any text still round-trips through the byte-level alphabet.
CORPUS = """\
The lighthouse keeper woke before the gulls, as he had every morning for thirty-one years. He
lit the small stove, set the kettle on it, and stood at the window while the water began to
murmur. Out on the grey water a fishing boat was already turning for home, its lamps still
burning although the sky had gone the colour of weak tea. He wrote the time in the log, 5:42,
and under it a single word: calm. Most days the log said calm. The few that did not were the
ones people in the village still talked about over their evening bread.

A garden is a slow argument between a person and the weather. You plant the beans in April
because the book says April, and then it snows, and the beans sulk in the cold ground until
May. You water the tomatoes every evening, and one warm night a storm arrives and splits half
of them open. Still, by the end of summer there are jars on every shelf, and the kitchen smells
of vinegar and dill, and you find yourself making plans for next year as if this one had gone
exactly the way you intended.

When the new library opened on the corner of Mill Street, the children of the town discovered
that they were allowed to borrow twelve books at once. Twelve! Some of them carried their stacks
home in wheelbarrows. The librarian, a patient woman with silver glasses, kept a notebook in
which she recorded the strangest requests: a book about a dog who could count, a map of the
moon, a recipe for soup made only from stones, and a history of every bridge in the country.
She found most of them. The ones she could not find, she suggested the children write
themselves.

Computers do exactly what they are told, which is both their great strength and the source of
most of our trouble with them. A program that adds two numbers will add them a billion times
without complaint, but it will also, if asked, divide by zero with the same cheerful obedience.
Good engineers learn to ask small questions first. Does it start? Does it stop? Does it give the
same answer twice? Only then do they ask whether it is fast, and only much later whether it is
elegant.

The train left the city at a quarter past nine and climbed into the hills through a long series
of tunnels. Between them the passengers caught quick bright pictures of the valley below: a
river, a church with a green roof, a field of sheep that all seemed to be facing the same way.
An old man by the window named each village as it went by, quietly, as if greeting friends.
His granddaughter pretended to read her book, but she was listening, and years later she could
still recite the names in order, from the first station to the last.

Rain fell all afternoon. The market traders pulled their canvas roofs tight and sold apples,
cheese, honey, wool socks, and hot chestnuts to anyone brave enough to stop. By five o'clock
the square was nearly empty, and the puddles held the lights of the shops like coins at the
bottom of a fountain. Somebody was playing an accordion under the clock tower, not very well,
but nobody minded. It was that kind of evening: wet, dim, and somehow generous.
"""


def _train_tokenizer(arch: str, vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE on CORPUS and wrap it as a PreTrainedTokenizerFast."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, PAD]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be >= {256 + len(specials)} for a byte-level BPE")

    tok = Tokenizer(models.BPE())
    if arch == "llama":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        # transformers 5 loads qwen2/qwen3 tokenizers as Qwen2Tokenizer, which keeps only the
        # vocab/merges and rebuilds Qwen's NFC + split-regex front end. Use that same front end
        # so tokenizer.json and AutoTokenizer tokenize identically.
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    # Added after training so they sit at the end of the vocab, as Llama 3's specials do.
    tok.add_special_tokens(specials)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: encode() prepends bos (chat templates tokenize without special tokens).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def _rope(arch: str, rope_scaling: str | None) -> tuple[float, dict[str, Any] | None]:
    """The rope theta and scaling: the default, or Llama 3's (`rope_scaling="llama3"`)."""
    if rope_scaling is None:
        return 10000.0, None
    if rope_scaling != "llama3":
        raise ValueError(f"unsupported rope_scaling {rope_scaling!r} (only 'llama3')")
    if arch != "llama":
        raise ValueError("rope_scaling='llama3' is only valid for arch='llama'")
    return 500000.0, {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }


def _make_config(
    arch: str,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rope_scaling: str | None,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
) -> PretrainedConfig:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    rope_theta, rope = _rope(arch, rope_scaling)
    common: dict[str, Any] = dict(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rms_norm_eps=1e-5,
        initializer_range=INITIALIZER_RANGE,
        # transformers 5 folds these into `rope_parameters`; 4.x reads them as given.
        rope_theta=rope_theta,
        rope_scaling=rope,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":  # Qwen2Attention always has q/k/v bias; there is no config switch.
        return Qwen2Config(**common)
    if arch == "qwen3":  # q/k RMSNorm are built in; head_dim is a config field, written explicitly.
        return Qwen3Config(**common, head_dim=hidden_size // num_heads)
    raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")


def _max_shard_size(model: torch.nn.Module, num_shards: int) -> int:
    """Smallest max_shard_size (bytes) for which save_pretrained writes <= num_shards files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    state = model.state_dict()

    def count(size: int) -> int:
        split = split_torch_state_dict_into_shards(state, max_shard_size=size)
        return len(split.filename_to_tensors)

    # The splitter is greedy in key order, so the shard count only falls as the size grows.
    lo, hi = 1, sum(t.numel() * t.element_size() for t in state.values())
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= num_shards else (mid + 1, hi)
    return lo


def _patch_for_compat(path: Path, arch: str) -> None:
    """Make the saved files look like real hub checkpoints, loadable by transformers 4.x and 5.x.

    transformers 5 writes ``rope_parameters`` and ``dtype``; hub checkpoints (and 4.x) use
    ``rope_theta`` / ``rope_scaling`` / ``torch_dtype``, so write both. The tokenizer class is
    set the way the real models declare it; for Qwen2Tokenizer, ``unk_token: null`` stops it
    adding a default ``<|endoftext|>`` token past the end of the vocab.
    """
    config_file = path / "config.json"
    cfg = json.loads(config_file.read_text())
    rope = cfg.get("rope_parameters")
    if rope is not None:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tok_file = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_file.read_text())
    if arch == "llama":
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    else:
        tok_cfg.update(tokenizer_class="Qwen2Tokenizer", unk_token=None)
    tok_file.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def _check_choices(arch: str, dtype: str, num_shards: int) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_NAMES)}")
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: str | None = None,
    num_shards: int = 1,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a random-weight ``{Llama,Qwen2,Qwen3}ForCausalLM`` checkpoint to ``path``.

    Writes config.json, generation_config.json, safetensors weights (one ``model.safetensors``,
    or ``num_shards`` shards plus ``model.safetensors.index.json``; fewer shards only if there are
    fewer tensors) and a byte-level BPE tokenizer with a chat template. The tokenizer vocab may be
    smaller than ``vocab_size``. The output is a pure function of the arguments (the same seed
    gives the same bytes). Returns ``path``.
    """
    import transformers

    _check_choices(arch, dtype, num_shards)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(arch, vocab_size, max_position_embeddings)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = _make_config(
        arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        **ids,
    )
    model = _random_model(arch, config, dtype, seed)
    model.generation_config = transformers.GenerationConfig(**ids)
    _save_weights(model, path, num_shards)
    tokenizer.save_pretrained(path)
    _patch_for_compat(path, arch)
    return path


def _random_model(arch: str, config: PretrainedConfig, dtype: str, seed: int) -> PreTrainedModel:
    """The model of `config` with weights drawn from `seed`, in `dtype`."""
    import torch
    import transformers

    # Initialise in float32 whatever the target dtype, so one seed gives the same model in all;
    # fork_rng leaves the caller's global RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, ARCHITECTURES[arch])(config)
    return model.to(getattr(torch, dtype))


def _save_weights(model: PreTrainedModel, path: Path, num_shards: int) -> None:
    """Write the model: config.json, generation_config.json and the weights, in `num_shards`
    safetensors files (fewer if there are fewer tensors)."""
    import transformers

    shard_size = _max_shard_size(model, num_shards) if num_shards > 1 else "1000GB"
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" noise
    try:
        # safetensors is the default format in transformers 4.x and the only one in 5.x.
        model.save_pretrained(path, max_shard_size=shard_size)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def default_model_dir() -> Path:
    """The per-user default tiny llama checkpoint, made on first use: `tiny-llama-v1` under
    the user's cache (`user_cache.built_once`)."""
    return built_once("tiny-llama-v1", "config.json", lambda tmp: make_tiny_model(tmp, "llama"))


def resolve_model_path(model_path: str | None) -> str:
    """The model to serve: the given path, else the built-in tiny model (made on first use)."""
    if model_path:
        return model_path
    return str(default_model_dir())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.tools.make_tiny_model",
        description="Write a tiny random-weight Hugging Face checkpoint for tests and demos.",
    )
    parser.add_argument("path", type=Path, help="output directory")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--rope-scaling", choices=["llama3"], default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.path, args.arch, **keyword_options(args, make_tiny_model)))


if __name__ == "__main__":
    main()
