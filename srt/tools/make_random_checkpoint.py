"""Write a random-weight safetensors checkpoint of a published model shape, for startup
benchmarks: dummy weights skip the load, which is the part of startup a real model pays.

    python -m srt.tools.make_random_checkpoint DIR --model-shape llama-3.2-1b

The directory gets the shape's config.json, its tokenizer (Llama 3's size, built without a
download: `srt.tools.llama3_tokenizer`) and `model-0000i-of-0000n`
safetensors shards with their index, as the hub writes them (bfloat16; N(0, 0.02) matrices and
unit norms, the rule of `--load-format dummy`). Tensor names and shapes come from transformers'
own model class for the config, built on the meta device, so the checkpoint is what
`from_pretrained` expects.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from srt.model_executor.model_loader import dummy_values
from srt.tools.model_shapes import MODEL_SHAPES, write_model_shape

DEFAULT_SHARD_BYTES = 5 * 2**30  # as the hub's Llama checkpoints


def checkpoint_tensors(path: Path) -> dict[str, torch.Size]:
    """Name -> shape of every tensor a checkpoint of the model in `path` holds."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding is saved once
    return {name: t.shape for name, t in state.items()}


def make_random_checkpoint(
    directory: Path,
    shape: str,
    *,
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    device: str | None = None,
) -> Path:
    """Write the checkpoint to `directory / shape`; returns that path."""
    dtype = torch.bfloat16
    path = write_model_shape(shape, directory)
    tensors = checkpoint_tensors(path)
    size = {name: math.prod(s) * dtype.itemsize for name, s in tensors.items()}
    shards: list[list[str]] = [[]]
    filled = 0
    for name in tensors:  # greedy, in the model's order, as the hub's splitter does
        if shards[-1] and filled + size[name] > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size[name]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    weight_map = {}
    with tqdm(total=sum(size.values()), unit="B", unit_scale=True, desc=f"writing {shape}") as bar:
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            shard = {}
            for name in names:
                shard[name] = dummy_values(name, tensors[name], dtype, dev, gen).cpu()
                weight_map[name] = file
                bar.update(size[name])
            save_file(shard, path / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(size.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.tools.make_random_checkpoint", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("directory", type=Path, help="the checkpoint goes to DIR/<shape>")
    parser.add_argument("--model-shape", required=True, choices=sorted(MODEL_SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shard-gib",
        type=float,
        default=DEFAULT_SHARD_BYTES / 2**30,
        help="Largest shard in GiB (default 5, as the hub's).",
    )
    parser.add_argument("--device", help="Where to draw the values (default: cuda if present).")
    ns = parser.parse_args(argv)
    if ns.shard_gib <= 0:
        parser.error("--shard-gib must be positive")
    start = time.perf_counter()
    path = make_random_checkpoint(
        ns.directory,
        ns.model_shape,
        seed=ns.seed,
        shard_bytes=int(ns.shard_gib * 2**30),
        device=ns.device,
    )
    print(f"{path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
