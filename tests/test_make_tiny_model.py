"""The tiny checkpoints load with stock transformers and behave well enough to test against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from srt.tools.make_tiny_model import default_model_dir, make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PROMPTS = ["The lighthouse keeper", "héllo ✓ 12345", "a"]


def _safetensors_keys(model_dir: Path) -> dict[str, torch.dtype]:
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_auto_classes(tiny_model_factory, arch: str) -> None:
    path = tiny_model_factory(arch)
    assert (path / "model.safetensors").is_file()
    assert not (path / "model.safetensors.index.json").exists()
    assert (path / "generation_config.json").is_file()

    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert config.architectures == [ARCHS[arch]]
    assert type(model).__name__ == ARCHS[arch]
    assert (config.bos_token_id, config.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    assert len(tokenizer) <= config.vocab_size == 512
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id

    keys = _safetensors_keys(path)
    assert "lm_head.weight" in keys  # untied by default
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) == (arch == "qwen3")
    if arch == "qwen3":
        assert json.loads((path / "config.json").read_text())["head_dim"] == 16


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_and_chats(tiny_model_factory, arch: str) -> None:
    path = tiny_model_factory(arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) <= 512  # no extra tokens past the model's vocab
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token == "<|pad|>"
    for text in ["Hello, world!", "héllo ✓", "  tabs\tand\nnewlines 日本語 🙂", ""]:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id  # Llama-3 style: encode() prepends bos
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    # The corpus-trained merges make English compact.
    text = "The train left the city and climbed into the hills."
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= len(text) // 2
    # transformers rebuilds some tokenizers (Qwen2Tokenizer); it must agree with tokenizer.json.
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in ["Hello,   world!! 1234 don't\n\n\tx", "héllo ✓ 日本語 🙂", "<|end_of_text|>"]:
        assert tokenizer.encode(text) == raw.encode(text).ids

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith(tokenizer.bos_token) and text.count(tokenizer.bos_token) == 1
    assert "Be brief." in text and "Hello!" in text
    assert text.endswith("<|assistant|>\n\n")
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt.endswith(tokenizer.eos_token)
    # transformers 5 returns a BatchEncoding here by default; ask for plain ids explicitly.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_sharded_matches_single_file(tiny_model_factory, tiny_llama: Path) -> None:
    path = tiny_model_factory("llama", num_shards=3)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)

    sharded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    single = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_llama3_rope_scaling(tiny_model_factory) -> None:
    path = tiny_model_factory("llama", rope_scaling="llama3")
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == 500000.0
    assert raw["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    config = AutoConfig.from_pretrained(path)
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3"
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.arange(300).unsqueeze(0)).logits  # past original_max_position
    assert torch.isfinite(logits).all()

    with pytest.raises(ValueError, match="llama3"):
        make_tiny_model(path.parent / "bad", "qwen2", rope_scaling="llama3")


def test_tied_and_bf16(tiny_model_factory) -> None:
    path = tiny_model_factory("qwen3", tie_word_embeddings=True, dtype="bfloat16")
    keys = _safetensors_keys(path)
    assert "lm_head.weight" not in keys
    assert set(keys.values()) == {"BF16"}
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", num_layers=1, seed=3)
    b = make_tiny_model(tmp_path / "b", num_layers=1, seed=3)
    c = make_tiny_model(tmp_path / "c", num_layers=1, seed=4)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_logits_finite_and_separated(tiny_model_factory, arch: str) -> None:
    path = tiny_model_factory(arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        gaps = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(
                ids,
                max_new_tokens=64,
                min_new_tokens=64,  # don't stop early on eos: look at all 64 steps
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )
            logits = torch.stack(out.logits)[:, 0].float()
            assert torch.isfinite(logits).all(), (arch, dtype, prompt)
            top2 = logits.topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
        if dtype == torch.float32:  # bf16 logits are too coarse for this (exact ties happen)
            gaps = torch.cat(gaps)
            assert (gaps > 1e-3).float().mean() >= 0.97, gaps.sort().values[:10]
            assert gaps.median() > 0.1


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [sys.executable, "-m", "srt.tools.make_tiny_model", str(out)]
    cmd += ["--arch", "qwen2", "--num-layers", "1", "--num-shards", "2", "--seed", "7"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_hidden_layers"] == 1
    assert (out / "model.safetensors.index.json").is_file()


def test_default_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = tmp_path / "srt" / "tiny-llama-v1"
    assert results == [expected, expected]
    assert [p.name for p in (tmp_path / "srt").iterdir()] == ["tiny-llama-v1"]  # no temp leftovers
    config = json.loads((expected / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 512
    assert default_model_dir() == expected  # second call just finds it
