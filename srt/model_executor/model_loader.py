"""Build a model and fill its weights from a Hugging Face directory, or randomly (dummy).

A checkpoint is read by a few threads at once, each copying tensors (or a rank's regions of
them) from the memory-mapped shards straight into the parameters; on CUDA through pinned
staging buffers and non_blocking copies on a stream per thread."""

from __future__ import annotations

import json
import math
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from srt.layers.linear import LinearShapeError, check_shape
from srt.model_config import ModelConfig, ModelLoadError
from srt.models.llama import LlamaForCausalLM
from srt.models.registry import get_model_class

# Checkpoint tensors that carry no parameter of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Reader threads of a load. Work is handed out by tensor, not by file: an 8B checkpoint's
# shards are 5.0, 5.0, 4.9 and 1.2 GB and a 1B's is one file, so a thread per file would leave
# most of the load to one thread. A tensor's read (page faults on the shard's mapping, and on
# CUDA the copy into pinned memory) happens inside torch ops that release the GIL and spread
# over the intra-op threads themselves; a few readers keep the disk's queue and the copy engine
# busy across one reader's gaps (small tensors, the Python between them). More would only
# oversubscribe the cores and pin more memory.
_READERS = 4
# Each CUDA reader's two pinned staging buffers (it fills one while the other's copy runs): a
# 16 MiB copy to the device takes about a millisecond, long beside the ~10 us a copy costs to
# issue and wait for.
_STAGING_BYTES = 16 * 2**20


def load_model(
    config: ModelConfig, device: torch.device, load_format: str = "auto", seed: int = 0
) -> tuple[LlamaForCausalLM, int]:
    """The model on `device` with its weights, and the checkpoint bytes read for them (0 for
    dummy weights)."""
    model = construct_model(config, device)
    return model, fill_weights(model, config, device, load_format, seed)


def construct_model(config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
    """The model on `device`, its parameters allocated and not filled (`fill_weights`): every
    shape, dtype and device is final, so what is built on it (the KV cache's sizing, the
    graphs, a forward that compiles kernels) does not wait for the weights."""
    try:
        model_cls = get_model_class(config.architecture)
    except ModelLoadError as e:
        raise ModelLoadError(f"{config.path / 'config.json'}: {e}") from e
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def fill_weights(
    model: LlamaForCausalLM,
    config: ModelConfig,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> int:
    """Fill the constructed model's parameters in place (`load_format` auto: from the
    checkpoint; dummy: random); the checkpoint bytes read. Its device temporaries are a
    reader's cast of one staging buffer at most, so it fits beside a KV cache already sized.
    The norms put in the products (`put_norms_in_products`) get their weights folded in."""
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        bytes_read = 0
    elif load_format == "auto":
        bytes_read = load_weights(model, config.path, device)
        if device.type == "cuda":
            # Return the blocks of the load's temporaries (a cast's, on the readers' streams).
            torch.cuda.empty_cache()
    else:
        raise ValueError(f"--load-format: unknown format {load_format!r}; use auto or dummy")
    model.fold_norm_weights()
    return bytes_read


def dummy_values(
    name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """The random value of the parameter (or checkpoint tensor) `name`: N(0, 0.02) matrices,
    unit norms, zero biases. Drawn where it will live, in its dtype: an 8B model's weights take
    a minute to draw on the CPU and copy over, well under a second on the GPU."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(0.02)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights without reading any file (`dummy_values`), the same for the same seed
    on the same device."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = gens.get(param.device)
        if gen is None:
            gen = gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.copy_(dummy_values(name, param.shape, param.dtype, param.device, gen))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {path}")
    return files


class Copier:
    """How a reader thread puts checkpoint regions (host tensors: views of a shard's mapping)
    into parameters: a plain copy, where the parameters are in host memory, reads the page
    cache's pages straight into them."""

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around the reader's work: where its copies and its loaders' ops are issued."""
        yield

    def finish(self) -> None:
        """Wait for every copy issued so far (a plain copy is done when it returns)."""


class PinnedCopier(Copier):
    """Into CUDA memory: each region goes through one of two pinned staging buffers, then to
    the device by a non_blocking copy on the reader's own stream, so that the reader fills one
    buffer while the other's copy runs, and the readers' copies overlap. (A pageable tensor's
    copy is staged by the driver, in small pieces and synchronously: 4.8 GB/s on the H200.)"""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)
        # After what the model's construction queued (a parameter's initial fill, say): the
        # checkpoint's values must land last.
        self._stream.wait_stream(torch.cuda.current_stream(device))
        self._buffers: list[torch.Tensor] = []  # pinned in the reader's thread, in parallel
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]  # each buffer's last copy
        self._turn = 0

    @contextmanager
    def running(self) -> Iterator[None]:
        # The device too: a new thread's current device is cuda:0, whatever rank this is.
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            if not self._buffers:
                self._buffers = [
                    torch.empty(_STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                    for _ in self._copied
                ]
            yield

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        if src.dim() == 0:
            dest, src = dest.view(1), src.view(1)
        row_bytes = math.prod(src.shape[1:]) * src.element_size()
        if row_bytes > _STAGING_BYTES:  # rows too big for a buffer (no Llama's are): one by one
            for dest_row, src_row in zip(dest, src, strict=True):
                self.copy(dest_row, src_row)
            return
        step = _STAGING_BYTES // max(row_bytes, 1)
        for start in range(0, len(src), step):
            self._stage(dest[start : start + step], src[start : start + step])

    def _stage(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        turn, self._turn = self._turn, 1 - self._turn
        self._copied[turn].synchronize()  # the buffer's previous copy has left it
        nbytes = src.numel() * src.element_size()
        staged = self._buffers[turn][:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)  # the file's bytes are read here, from the page cache or the disk
        # A dtype that differs from the checkpoint's is cast on the device, as before.
        dest.copy_(staged, non_blocking=True)
        self._copied[turn].record(self._stream)

    def finish(self) -> None:
        self._stream.synchronize()


def copier_for(device: torch.device) -> Copier:
    return PinnedCopier(device) if device.type == "cuda" else Copier()


class SafetensorsTensor:
    """One tensor of an open safetensors file, not read yet: its shape, and a copy of one
    region of it (all of it, or the region a rank holds: a tensor-parallel rank never reads the
    rest) into a parameter, counting the bytes read."""

    def __init__(self, path: Path, file: Any, name: str, copier: Copier) -> None:
        self._path = path
        self._file = file
        self._name = name
        self._copier = copier
        self.shape = tuple(file.get_slice(name).get_shape())
        self.bytes_read = 0

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The region, on the host: a view of the file's mapping, read when it is copied."""
        try:
            return self._file.get_tensor(self._name)[index]
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {self._name} from {self._path}: {e}") from e

    def copy_to(self, dest: torch.Tensor, index: tuple[slice, ...] = ()) -> None:
        region = self.read(index)
        self._copier.copy(dest, region)
        self.bytes_read += region.numel() * region.element_size()


@contextmanager
def open_checkpoint(path: Path) -> Iterator[list[tuple[Path, Any]]]:
    """Every weight file of the checkpoint at `path` with its open safetensors handle (the
    file memory-mapped, nothing read yet), until the block ends."""
    with ExitStack() as files:
        opened = []
        for file in safetensors_files(path):
            try:
                handle = files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"cannot read weights from {file}: {e}") from e
            opened.append((file, handle))
        yield opened


@dataclass(frozen=True)
class _Job:
    """One checkpoint tensor and the parameter (and packed shard of it) that it fills."""

    file: Path
    handle: Any
    name: str
    param: nn.Parameter
    shard: int

    def run(self, copier: Copier) -> int:
        """Fill the parameter's part; the bytes read."""
        tensor = SafetensorsTensor(self.file, self.handle, self.name, copier)
        loader = getattr(self.param, "weight_loader", None)
        try:
            if loader is None:  # replicated: every rank holds all of it
                check_shape(tensor, tuple(self.param.shape))
                tensor.copy_to(self.param.data)
            else:
                loader(self.param, tensor, self.shard)
        except LinearShapeError as e:
            where = f"{self.file.name}: tensor {self.name}"
            raise ModelLoadError(f"{where} {e} (from config.json)") from e
        return tensor.bytes_read


def load_weights(model: LlamaForCausalLM, path: Path, device: torch.device) -> int:
    """Fill the parameters (on `device`) from the checkpoint at `path`, the bytes read;
    ModelLoadError, naming the file and tensor, for a tensor without a parameter, a shape
    mismatch or a gap. Every name is checked before any tensor is read."""
    with open_checkpoint(path) as files:
        return _read(_plan(model, path, files), device)


def _plan(model: LlamaForCausalLM, path: Path, files: list[tuple[Path, Any]]) -> list[_Job]:
    """Which parameter each checkpoint tensor fills, in checkpoint order; ModelLoadError for a
    tensor without one, a part that two tensors fill, or a part that none does."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    jobs: list[_Job] = []
    filled: dict[str, Path] = {}
    for file, handle in files:
        for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            target, shard = name, 0
            for ckpt_name, (ours, shard_id) in packed.items():
                if f".{ckpt_name}." in name:
                    target, shard = name.replace(f".{ckpt_name}.", f".{ours}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"{file.name}: tensor {name} has no matching model parameter")
            key = f"{target}#{shard}"
            if key in filled:  # read at once, the two would race for the parameter
                raise ModelLoadError(f"{file.name}: tensor {name} is in {filled[key].name} too")
            filled[key] = file
            jobs.append(_Job(file, handle, name, param, shard))
    missing = sorted(_expected_shards(model, params) - filled.keys())
    if missing:
        names = ", ".join(_checkpoint_name(m, packed) for m in missing[:8])
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensor(s): {names}")
    return jobs


def _read(jobs: list[_Job], device: torch.device) -> int:
    """Run the jobs on a few reader threads, each taking the next tensor in checkpoint order
    (the shards are read at once, each near-sequentially); the bytes read. A failure stops
    every reader after its tensor in hand; the first one in checkpoint order is raised once
    all have stopped and their copies are done (never a half-loaded model returned)."""
    todo: queue.SimpleQueue[tuple[int, _Job]] = queue.SimpleQueue()
    for item in enumerate(jobs):
        todo.put(item)
    stop = threading.Event()
    failures: list[tuple[int, Exception]] = []

    def reader(copier: Copier) -> int:
        read = 0
        try:
            with copier.running():
                while not stop.is_set():
                    try:
                        index, job = todo.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        read += job.run(copier)
                    except Exception as e:
                        failures.append((index, e))  # raised in the caller's thread, below
                        raise
        finally:
            # The tensors are all taken or something failed (here or in another reader, or
            # this reader's setup): every reader stops.
            stop.set()
            copier.finish()  # nothing left in flight from its buffers or into the parameters
        return read

    copiers = [copier_for(device) for _ in range(max(1, min(_READERS, len(jobs))))]
    pool = ThreadPoolExecutor(len(copiers), thread_name_prefix="srt-load")
    try:
        futures = [pool.submit(reader, copier) for copier in copiers]
        wait(futures)
    finally:
        stop.set()  # an interrupt while waiting: the readers stop after their tensor in hand
        pool.shutdown()
    if failures:
        raise min(failures, key=lambda failure: failure[0])[1]
    return sum(future.result() for future in futures)  # raises a reader's own failure


def _checkpoint_name(shard_key: str, packed: dict[str, tuple[str, int]]) -> str:
    """`...qkv_proj.weight#1` -> `...k_proj.weight`: the name the checkpoint should have."""
    name, shard = shard_key.rsplit("#", 1)
    for ckpt_name, (ours, shard_id) in packed.items():
        if f".{ours}." in name and shard_id == int(shard):
            return name.replace(f".{ours}.", f".{ckpt_name}.")
    return name


def _expected_shards(model: nn.Module, params: dict[str, nn.Parameter]) -> set[str]:
    expected: set[str] = set()
    for name in params:
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        shards = len(getattr(owner, "output_sizes", [0]))
        expected.update(f"{name}#{i}" for i in range(shards))
    return expected
