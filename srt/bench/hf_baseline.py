"""The alternatives and the limits, on the same model shape and device as srt's benchmarks:
Hugging Face transformers decoding (eager with its dynamic cache; `generate` with the static
cache; the whole decode forward under `torch.compile(mode="reduce-overhead")` on a static cache,
gpt-fast style), the bandwidth floor of a decode step, and the bare cuBLAS matmul chain of one
decode step captured in one CUDA graph.

    python -m srt.bench.hf_baseline --model-shape llama-3.2-1b --batch-size 1 32 \\
        --result-file hf.jsonl

The floor: a decode step reads every weight once (all but an untied input embedding, of which
it reads a row per request), so weight bytes over the measured device-to-device copy bandwidth
(bytes read plus bytes written, over a buffer far larger than the cache) is the least time it
can take. The chain: per layer the QKV, output, gate-up and down matmuls, then the LM head, on
the model's shapes with distinct weights, nothing else: what a step costs with perfect kernels
for everything but the matmuls. One JSON line per (method, batch size) is appended to
`--result-file`; the table is printed last.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from srt.bench.report import append_jsonl, format_table, machine
from srt.tools.model_shapes import MODEL_SHAPES, write_model_shape

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What AutoModelForCausalLM loads: a model that also generates."""


logger = logging.getLogger("srt.bench.hf_baseline")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], Any], n: int, device: torch.device) -> list[float]:
    """Seconds of each of `n` calls of `step`, each finished on the device."""
    times = []
    for _ in range(n):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def load_hf_model(
    path: Path, random_weights: bool, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    import transformers

    if not random_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy types as an
        # unbound function wanting `self` as its first argument.
        return model.to(device).eval()  # type: ignore[arg-type]
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def static_cache(model: CausalLM, batch: int, length: int) -> Any:
    """A transformers StaticCache, whichever of its two signatures this version has."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    if "max_batch_size" in params:  # transformers 4.x allocates up front
        kwargs.update(max_batch_size=batch, device=model.device, dtype=model.dtype)
    return StaticCache(**kwargs)


def prompt(model: CausalLM, batch: int, input_len: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, input_len), generator=gen)
    return ids.to(model.device)


@torch.inference_mode()
def eager_decode(
    model: CausalLM, batch: int, input_len: int, output_len: int, seed: int
) -> dict[str, Any]:
    """Greedy decoding, one `model(...)` call per step with the dynamic cache."""
    from transformers import DynamicCache

    ids = prompt(model, batch, input_len, seed)
    cache = DynamicCache()
    state = {"next": model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)}

    def step() -> None:
        out = model(state["next"][:, None], past_key_values=cache, use_cache=True)
        state["next"] = out.logits[:, -1].argmax(-1)

    steps = timed_steps(step, output_len - 1, model.device)
    return {"decode_ms_per_step": round(statistics.median(steps) * 1000, 3)}


@torch.inference_mode()
def generate_static(
    model: CausalLM, batch: int, input_len: int, output_len: int, seed: int
) -> dict[str, Any]:
    """`generate` with `cache_implementation="static"`, uncompiled (transformers would
    otherwise compile the forward by itself; the compiled row below does that explicitly).
    A step: the time of `output_len` tokens less that of 1, over `output_len - 1`."""
    ids = prompt(model, batch, input_len, seed)
    eos = model.config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos  # stops generate warning about it
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        kwargs = {
            "max_new_tokens": n,
            "min_new_tokens": n,
            "do_sample": False,
            "cache_implementation": "static",
            "disable_compile": True,
            "pad_token_id": pad,
        }
        return timed_steps(
            lambda: model.generate(ids, attention_mask=mask, **kwargs), 1, model.device
        )[0]

    first_call = run(output_len)
    long, short = run(output_len), run(1)
    return {
        "decode_ms_per_step": round((long - short) / (output_len - 1) * 1000, 3),
        "first_call_s": round(first_call, 3),
    }


@torch.inference_mode()
def compiled_decode(
    model: CausalLM, batch: int, input_len: int, output_len: int, seed: int
) -> dict[str, Any]:
    """The decode forward compiled whole with `torch.compile(mode="reduce-overhead",
    fullgraph=True)` over a static cache, prefill eager (gpt-fast's recipe). The compile and
    capture happen in the first steps; their seconds are reported apart."""
    ids = prompt(model, batch, input_len, seed)
    cache = static_cache(model, batch, input_len + 2 * output_len)
    logits = model(
        ids,
        past_key_values=cache,
        use_cache=True,
        cache_position=torch.arange(input_len, device=model.device),
    ).logits

    def decode(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = model(token, past_key_values=cache, use_cache=True, cache_position=position)
        return out.logits[:, -1].argmax(-1)

    compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    state = {"next": logits[:, -1].argmax(-1), "pos": input_len}

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        position = torch.tensor([state["pos"]], device=model.device)
        state["next"] = compiled(state["next"][:, None], position).clone()
        state["pos"] += 1

    # reduce-overhead records its CUDA graph on the call after the compiling one.
    warm = timed_steps(step, 3, model.device)
    steps = timed_steps(step, output_len - 1, model.device)
    return {
        "decode_ms_per_step": round(statistics.median(steps) * 1000, 3),
        "compile_s": round(warm[0], 3),
        "first_calls_ms": [round(t * 1000, 3) for t in warm],
    }


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = timed_steps(lambda: dst.copy_(src), reps, device)
    return 2 * nbytes / statistics.median(times)


def floor_weight_bytes(model: CausalLM) -> int:
    """Bytes one decode step must read: every parameter, but of an untied input embedding
    only the rows of the batch (counted as none)."""
    embed = model.get_input_embeddings().weight
    tied = model.config.tie_word_embeddings
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def matmul_chain(
    config: Any, batch: int, dtype: torch.dtype, device: torch.device, reps: int = 50
) -> dict[str, Any]:
    """The decode step's matmuls alone, each layer with its own weights, in one CUDA graph
    (on the CPU, run as is): ms per step."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    qkv_out = q_out + 2 * config.num_key_value_heads * head_dim
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen, dtype=dtype, device=device).mul_(0.02)

    shapes = [(qkv_out, hidden), (hidden, q_out), (2 * inter, hidden), (hidden, inter)]
    weights = [[weight(*s) for s in shapes] for _ in range(layers)]
    lm_head = weight(config.vocab_size, hidden)
    x = torch.randn(batch, hidden, generator=gen, dtype=dtype, device=device)

    def chain() -> torch.Tensor:
        h = x
        for qkv, o, gate_up, down in weights:
            attn = torch.nn.functional.linear(h, qkv)[:, :q_out]
            h = torch.nn.functional.linear(attn, o)
            act = torch.nn.functional.linear(h, gate_up)[:, :inter]
            h = torch.nn.functional.linear(act, down)
        return torch.nn.functional.linear(h, lm_head)

    run: Callable[[], Any] = chain
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()  # cuBLAS picks its kernels and workspace before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        run = graph.replay
    run()
    times = timed_steps(run, reps, device)
    nbytes = sum(w.numel() * w.element_size() for ws in weights for w in ws)
    nbytes += lm_head.numel() * lm_head.element_size()
    return {
        "decode_ms_per_step": round(statistics.median(times) * 1000, 3),
        "weight_bytes": nbytes,
        "cuda_graph": device.type == "cuda",
    }


METHODS: dict[str, Callable[..., dict[str, Any]]] = {
    "hf-eager": eager_decode,
    "hf-generate-static": generate_static,
    "hf-compile-reduce-overhead": compiled_decode,
}


def bench(ns: argparse.Namespace, path: Path, random_weights: bool) -> list[dict[str, Any]]:
    device = torch.device(
        ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = (
        DTYPES[ns.dtype]
        if ns.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    model = load_hf_model(path, random_weights, dtype, device)
    base = {
        "model": ns.model_shape or str(path),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "machine": machine(),
    }
    bandwidth = copy_bandwidth(device, ns.copy_mib * 2**20)
    weight_bytes = floor_weight_bytes(model)
    rows = [
        {
            **base,
            "method": "bandwidth-floor",
            "batch_size": b,
            # 6 decimals: the tiny model's floor is a few microseconds
            "decode_ms_per_step": round(weight_bytes / bandwidth * 1000, 6),
            "weight_bytes": weight_bytes,
            "copy_bandwidth_gbs": round(bandwidth / 1e9, 3),
        }
        for b in ns.batch_size
    ]
    work = [(m, b) for m in ns.methods for b in ns.batch_size]
    for method, b in tqdm(work, desc="methods x batch sizes"):
        try:
            if method == "cublas-chain":
                figures = matmul_chain(model.config, b, dtype, device)
            else:
                figures = METHODS[method](model, b, ns.input_len, ns.output_len, ns.seed)
        except Exception as e:  # one failing alternative must not hide the others' figures
            logger.exception("%s at batch %d failed", method, b)
            figures = {"error": f"{type(e).__name__}: {e}"}
        finally:
            torch._dynamo.reset()  # each compiled row starts from nothing
        rows.append({**base, "method": method, "batch_size": b, **figures})
    return rows


TABLE = [
    ("model", "model"),
    ("method", "method"),
    ("bs", "batch_size"),
    ("decode ms/step", "decode_ms_per_step"),
    ("compile s", "compile_s"),
    ("first call s", "first_call_s"),
    ("copy GB/s", "copy_bandwidth_gbs"),
    ("error", "error"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m srt.bench.hf_baseline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-path", help="A checkpoint (default: the built-in tiny model).")
    parser.add_argument(
        "--model-shape", choices=sorted(MODEL_SHAPES), help="A published shape with random weights."
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[*METHODS, "cublas-chain"],
        choices=[*METHODS, "cublas-chain"],
    )
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument(
        "--copy-mib",
        type=int,
        default=2048,
        help="Size of the buffer whose copy measures the bandwidth.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", help="Append one JSON line per row here.")
    ns = parser.parse_args(argv)
    if ns.output_len < 2 or ns.input_len < 1 or min(ns.batch_size) < 1 or ns.copy_mib < 1:
        parser.error(
            "--output-len must be at least 2; --input-len, --batch-size and --copy-mib positive"
        )
    if ns.model_path and ns.model_shape:
        parser.error("give --model-path or --model-shape, not both")
    with tempfile.TemporaryDirectory() as tmp:
        if ns.model_shape:
            rows = bench(ns, write_model_shape(ns.model_shape, Path(tmp)), random_weights=True)
        else:
            from srt.tools.make_tiny_model import resolve_model_path

            path = resolve_model_path(ns.model_path)
            rows = bench(ns, Path(path), random_weights=False)
    if ns.result_file:
        append_jsonl(ns.result_file, rows)
    print(format_table(rows, TABLE))


if __name__ == "__main__":
    main()
