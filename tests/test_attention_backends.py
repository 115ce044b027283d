"""The CUDA attention backends against `torch_native` on random paged batches.

GPU tests (marked `gpu`) run the kernels for real, including inside a CUDA graph replayed
with other batches (the FlashInfer ones only where `flashinfer` is installed). On the CPU, one
test runs a small set of the Triton checks in a subprocess under the Triton interpreter
(TRITON_INTERPRET=1 must be set before the kernels are defined), when `triton` is installed;
others check the Triton backend's metadata without its kernels: its layout, and which batch's
metadata a forward runs on (the decode kernel replaced by plain PyTorch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from srt import flashinfer_support
from srt.batch_layout import ForwardMode
from srt.forward_batch import ForwardBatch, pad_tokens
from srt.ipc.messages import BatchPlan
from srt.layers.attention.base import AttentionInputs
from srt.layers.attention.registry import create_attention_backend
from srt.layers.attention.torch_native import TorchNativeBackend, attend
from srt.layers.rotary_embedding import Rope, RotaryEmbedding, rotary
from srt.model_config import ModelConfig
from srt.model_executor.graphs.static_batch import real_requests
from srt.model_executor.step_inputs import upload_step
from srt.server_args import ServerArgs, ServerArgsError

REPO = Path(__file__).resolve().parent.parent

# (prefix_len, extend_len) per request: lengths 1, exact and ragged block multiples, long
# prompts, and extends on top of cached prefixes.
EXTEND_SPECS = [(0, 1), (0, 64), (0, 200), (37, 1), (130, 70), (5, 3), (700, 129)]
DECODE_SPECS = [(0, 1), (1, 1), (63, 1), (64, 1), (300, 1), (2000, 1)]


@dataclass
class World:
    """The runner-side state a batch refers to: the slot table and one layer's KV cache."""

    req_to_token: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    next_row: int = 0
    next_slot: int = 1  # slot 0 is the dummy slot

    @classmethod
    def create(
        cls,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        rows: int = 32,
        context: int = 4096,
        slots: int = 32768,
    ) -> World:
        shape = (slots, num_kv_heads, head_dim)
        return cls(
            req_to_token=torch.zeros((rows, context), dtype=torch.int32, device=device),
            k_cache=torch.zeros(shape, dtype=dtype, device=device),
            v_cache=torch.zeros(shape, dtype=dtype, device=device),
        )

    def take_slots(self, n: int) -> torch.Tensor:
        # Shuffled, so that a request's slots are not contiguous.
        slots = self.next_slot + torch.randperm(n, device=self.k_cache.device)
        self.next_slot += n
        if self.next_slot > self.k_cache.shape[0]:
            raise ValueError("test world out of KV slots")
        return slots


def make_batch(
    world: World,
    mode: ForwardMode,
    specs: list[tuple[int, int]],
    num_heads: int,
    padded_tokens: int | None = None,
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of fresh requests with random cached prefixes, and its random q, k, v."""
    device = world.k_cache.device
    _, num_kv_heads, head_dim = world.k_cache.shape
    dtype = world.k_cache.dtype
    rows, locs = [], []
    for prefix, extend in specs:
        row, world.next_row = world.next_row, world.next_row + 1
        slots = world.take_slots(prefix + extend)
        world.req_to_token[row, : prefix + extend] = slots.to(torch.int32)
        cached = slots[:prefix]
        world.k_cache[cached] = torch.randn_like(world.k_cache[cached])
        world.v_cache[cached] = torch.randn_like(world.v_cache[cached])
        rows.append(row)
        locs.append(slots[prefix:])
    num_tokens = sum(e for _, e in specs)
    batch = upload_step(
        BatchPlan.greedy(
            mode,
            input_ids=np.zeros(num_tokens, np.int64),
            positions=np.concatenate([np.arange(p, p + e) for p, e in specs]),
            out_cache_loc=torch.cat(locs).cpu().numpy(),
            req_pool_indices=np.array(rows),
            prefix_lens=np.array([p for p, _ in specs]),
            extend_lens=np.array([e for _, e in specs]),
        ),
        world.req_to_token,
    )
    batch = pad_tokens(batch, padded_tokens or num_tokens)
    t = batch.padded_tokens
    q = torch.randn(t, num_heads * head_dim, dtype=dtype, device=device)
    k = torch.randn(t, num_kv_heads * head_dim, dtype=dtype, device=device)
    v = torch.randn(t, num_kv_heads * head_dim, dtype=dtype, device=device)
    return batch, q, k, v


def reference(
    world: World,
    batch: ForwardBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_native's output and the caches it leaves, computed on copies of the caches."""
    _, num_kv_heads, head_dim = world.k_cache.shape
    native = TorchNativeBackend(q.shape[1] // head_dim, num_kv_heads, head_dim)
    k_cache, v_cache = world.k_cache.clone(), world.v_cache.clone()
    out = torch.empty_like(q)
    native.forward(batch, AttentionInputs(q, k, v, out, k_cache, v_cache, head_dim**-0.5))
    return out, k_cache, v_cache


def assert_matches(
    world: World,
    expected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    num_tokens: int,
) -> None:
    ref_out, ref_k, ref_v = expected
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[out.dtype]
    torch.testing.assert_close(out[:num_tokens], ref_out[:num_tokens], atol=tol, rtol=tol)
    assert torch.count_nonzero(out[num_tokens:]) == 0, "padded tail not zeroed"
    # Slot 0 takes the padded tokens' K and V in any order; every other slot must match.
    assert torch.equal(world.k_cache[1:], ref_k[1:]) and torch.equal(world.v_cache[1:], ref_v[1:])


def check_eager(
    backend_name: str,
    mode: ForwardMode,
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    pad: int = 0,
) -> None:
    world = World.create(num_kv_heads, head_dim, dtype, device)
    backend = create_attention_backend(backend_name, num_heads, num_kv_heads, head_dim)
    batch, q, k, v = make_batch(world, mode, specs, num_heads, sum(e for _, e in specs) + pad)
    expected = reference(world, batch, q, k, v)
    out = torch.full_like(q, 7.0)  # garbage that the padded tail must lose
    backend.init_forward_metadata(batch)
    backend.forward(
        batch, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, head_dim**-0.5)
    )
    assert_matches(world, expected, out, batch.num_tokens)


def check_static_replay(
    backend_name: str,
    mode: ForwardMode,
    batches_specs: list[list[tuple[int, int]]],
    bucket: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    max_bs: int = 8,
) -> None:
    """The graph path, as the `full` runner drives it: capture with the first batch, then
    replay later batches of the same bucket through the static buffers.

    On CUDA the forward is captured in a real CUDA graph and replayed. Elsewhere (the Triton
    interpreter) the forward re-runs on the replayed batch, its metadata checked to launch as
    captured.
    """
    world = World.create(num_kv_heads, head_dim, dtype, device)
    backend = create_attention_backend(backend_name, num_heads, num_kv_heads, head_dim)
    backend.init_graph_state(max_bs, max_tokens=bucket)
    scale = head_dim**-0.5
    # As the runner does: the batch's token tensors are static buffers, padded to the bucket.
    batch, q, k, v = make_batch(world, mode, batches_specs[0], num_heads, bucket)
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    static_loc = batch.out_cache_loc.clone()
    static_out = torch.empty_like(q)
    batch = dataclasses.replace(batch, out_cache_loc=static_loc)
    backend.init_forward_metadata_capture(batch)
    captured = batch.attn_metadata

    def run(batch: ForwardBatch) -> None:
        backend.forward(
            batch,
            AttentionInputs(
                static_q, static_k, static_v, static_out, world.k_cache, world.v_cache, scale
            ),
        )

    graph = None
    if device == "cuda":
        backup = world.k_cache.clone(), world.v_cache.clone()
        run(batch)  # the warm-up: compiles (and plans) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(batch)
        world.k_cache.copy_(backup[0])
        world.v_cache.copy_(backup[1])

    for specs in batches_specs:
        live, q, k, v = make_batch(world, mode, specs, num_heads, bucket)
        expected = reference(world, live, q, k, v)
        for static, new in zip(
            (static_q, static_k, static_v, static_loc), (q, k, v, live.out_cache_loc), strict=True
        ):
            static.copy_(new)
        static_out.fill_(7.0)
        replayed = dataclasses.replace(live, out_cache_loc=static_loc)
        backend.init_forward_metadata_replay(replayed, bucket)
        if graph is not None:
            graph.replay()
        else:
            step = replayed.attn_metadata
            assert step.layout == captured.layout
            assert step.fields.data_ptr() == captured.fields.data_ptr()
            assert step.out_cache_loc.data_ptr() == captured.out_cache_loc.data_ptr()
            run(replayed)
        assert_matches(world, expected, static_out, live.num_tokens)


def check_metadata_stays_with_its_batch(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> None:
    """Two batches prepared back to back, of the same size so that only their metadata tells
    them apart: the first one's forward still runs on its own. A batch no hook ran for and a
    forward of another token count are refused; the copies that reshape a batch start
    without metadata."""
    world = World.create(num_kv_heads, head_dim, dtype, device)
    backend = create_attention_backend("triton", num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    first, q, k, v = make_batch(world, ForwardMode.DECODE, [(5, 1), (70, 1)], num_heads)
    second, *_ = make_batch(world, ForwardMode.DECODE, [(30, 1), (2, 1)], num_heads)
    expected = reference(world, first, q, k, v)
    backend.init_forward_metadata(first)
    backend.init_forward_metadata(second)
    out = torch.full_like(q, 7.0)
    backend.forward(first, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, scale))
    assert_matches(world, expected, out, first.num_tokens)

    unprepared = dataclasses.replace(first, attn_metadata=None)
    with pytest.raises(RuntimeError, match="no metadata for a step of 2 tokens"):
        backend.forward(
            unprepared, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, scale)
        )
    q3, k3, v3 = (torch.cat([t, t[:1]]) for t in (q, k, v))
    with pytest.raises(RuntimeError, match="no metadata for a step of 3 tokens"):
        backend.forward(
            first,
            AttentionInputs(q3, k3, v3, torch.empty_like(q3), world.k_cache, world.v_cache, scale),
        )
    for copy in (pad_tokens(first, 4), real_requests(first)):
        assert copy.attn_metadata is None


def decode_in_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    arrivals: torch.Tensor,
    scaling: float,
) -> None:
    """`decode_attention`'s contract in plain PyTorch, to check the backend around it where
    the kernel cannot run: request i's one query attends its first `seq_lens[i]` table slots
    (zeros for length 0, a padded request)."""
    for i, (row, n) in enumerate(zip(req_rows.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, :n]
        o[i] = attend(q[i : i + 1], k_cache[slots], v_cache[slots], n - 1, scaling)[0] if n else 0


def check_decode_kernel(
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> None:
    """`decode_attention` itself against `decode_in_torch` on a shuffled cache, its output
    poisoned first: requests of one chunk and of many (merged by the chunk that arrives last),
    and a padded one (length 0); called twice, since the arrival counters it leaves must be
    zeros again for the next layer."""
    from srt.layers.attention.triton_ops.decode_attention import decode_attention, num_decode_splits

    batch, longest = len(lens), max(lens)
    slots = batch * longest + 1
    k_cache = torch.randn(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
    table = (1 + torch.randperm(slots - 1)).view(batch, longest).to(torch.int32).to(device)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    splits = num_decode_splits(batch, num_kv_heads)
    part_out = torch.empty(batch, num_heads, splits, head_dim, device=device)
    part_lse = torch.empty(batch, num_heads, splits, device=device)
    arrivals = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device)
    expected = torch.empty_like(q)
    decode_in_torch(
        q, k_cache, v_cache, expected, table, rows, seq_lens, part_out, part_lse, arrivals, 0.125
    )
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(
            q, k_cache, v_cache, out, table, rows, seq_lens, part_out, part_lse, arrivals, 0.125
        )
        tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
        assert not arrivals.any(), arrivals


# ---- GPU ----

GQA = [(8, 8), (16, 4), (32, 4)]  # group sizes 1, 4, 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_triton_matches_torch_native(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, mode: ForwardMode
) -> None:
    specs = EXTEND_SPECS if mode == ForwardMode.EXTEND else DECODE_SPECS
    check_eager("triton", mode, specs, *heads, head_dim, dtype, "cuda", pad=3)
    check_eager("triton", mode, specs[:1], *heads, head_dim, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", [1, 8, 40])
def test_triton_decode_kernel_merges_its_chunks(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, batch: int
) -> None:
    """Requests of one chunk and of many (4,100 keys in 13 at batch 1), at batch sizes whose
    buckets split short (1, 8) and long (40 requests x 8 KV heads: splits of 256 keys or
    more, 4 per request at most)."""
    torch.manual_seed(batch)
    lens = ([4100, 0, 1, 63, 300, 2000, 257, 1024] * batch)[:batch]
    check_decode_kernel(lens, *heads, head_dim, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_triton_cuda_graph_replays_other_batches(mode: ForwardMode) -> None:
    if mode == ForwardMode.DECODE:
        batches = [[(10, 1)] * 8, [(3, 1), (900, 1), (0, 1)], [(2500, 1)] * 8]
        bucket = 8
    else:
        batches = [[(0, 64)], [(0, 5), (100, 30), (7, 1)], [(2000, 50), (0, 14)]]
        bucket = 64
    check_static_replay("triton", mode, batches, bucket, 32, 8, 128, torch.bfloat16, "cuda")


# Each kind of step the flashinfer backend runs on its own FlashInfer wrapper: decode, prefill
# from scratch (ragged: the new K and V alone) and prefill over cached prefixes (paged).
FLASHINFER_STEPS = {
    "decode": (ForwardMode.DECODE, DECODE_SPECS),
    "prefill": (ForwardMode.EXTEND, [(0, 1), (0, 64), (0, 200), (0, 129), (0, 1000)]),
    "prefill-over-prefixes": (ForwardMode.EXTEND, EXTEND_SPECS),
}
# Llama-3's 32 query heads over 8 KV heads, 8 over 8 (decode on FlashInfer's CUDA cores) and a
# group of 8.
FLASHINFER_HEADS = [(32, 8), (8, 8), (32, 4)]


def flashinfer_installed() -> None:
    if not flashinfer_support.installed():
        pytest.skip("flashinfer is not installed (pip install 'srt[flashinfer]')")


@pytest.mark.gpu
@pytest.mark.parametrize("step", list(FLASHINFER_STEPS))
@pytest.mark.parametrize("heads", FLASHINFER_HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_matches_triton_and_torch_native(
    step: str, heads: tuple[int, int], head_dim: int
) -> None:
    """The same batch through triton (on copies of the caches) and flashinfer: both within
    bf16 tolerance of torch_native and of each other; flashinfer's KV writes exact."""
    flashinfer_installed()
    mode, specs = FLASHINFER_STEPS[step]
    num_heads, num_kv_heads = heads
    world = World.create(num_kv_heads, head_dim, torch.bfloat16, "cuda")
    batch, q, k, v = make_batch(world, mode, specs, num_heads, sum(e for _, e in specs) + 3)
    expected = reference(world, batch, q, k, v)
    scale = head_dim**-0.5
    triton_out = torch.empty_like(q)
    triton = create_attention_backend("triton", num_heads, num_kv_heads, head_dim)
    triton_batch = dataclasses.replace(batch, attn_metadata=None)
    triton.init_forward_metadata(triton_batch)
    triton.forward(
        triton_batch,
        AttentionInputs(q, k, v, triton_out, world.k_cache.clone(), world.v_cache.clone(), scale),
    )
    out = torch.full_like(q, 7.0)
    backend = create_attention_backend("flashinfer", num_heads, num_kv_heads, head_dim)
    backend.init_forward_metadata(batch)
    backend.forward(batch, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, scale))
    assert_matches(world, expected, out, batch.num_tokens)
    torch.testing.assert_close(out, triton_out, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", FLASHINFER_HEADS[:2], ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_cuda_graph_replays_other_decode_batches(
    heads: tuple[int, int], head_dim: int
) -> None:
    flashinfer_installed()
    batches = [[(10, 1)] * 8, [(3, 1), (900, 1), (0, 1)], [(2500, 1)] * 8, [(4000, 1)]]
    check_static_replay(
        "flashinfer", ForwardMode.DECODE, batches, 8, *heads, head_dim, torch.bfloat16, "cuda"
    )


@pytest.mark.gpu
def test_flashinfer_eager_steps_planned_ahead_run_on_their_own_plans() -> None:
    """Steps prepared back to back (as overlap scheduling prepares them ahead of the device)
    each run on their own plan: eager steps take turns over several wrappers, and a step whose
    wrapper was planned for another since is planned again."""
    flashinfer_installed()
    world = World.create(8, 128, torch.bfloat16, "cuda")
    backend = create_attention_backend("flashinfer", 32, 8, 128)
    scale = 128**-0.5
    steps = [
        make_batch(world, ForwardMode.DECODE, [(p, 1) for p in lens], 32)
        for lens in ([5, 70], [300, 2, 9], [1000], [17, 17], [3, 4000])
    ]
    for batch, *_ in steps:  # more steps than wrappers: the first ones are replanned
        backend.init_forward_metadata(batch)
    for batch, q, k, v in steps:
        expected = reference(world, batch, q, k, v)  # over the KV the steps before wrote
        out = torch.full_like(q, 7.0)
        backend.forward(batch, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, scale))
        assert_matches(world, expected, out, batch.num_tokens)


BF16 = {"atol": 2e-2, "rtol": 2e-2}
ROPE_BACKENDS = [
    pytest.param("torch_native", "cpu"),
    pytest.param("torch_native", "cuda", marks=pytest.mark.gpu),
    pytest.param("triton", "cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("backend_name", "device"), ROPE_BACKENDS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_rope_with_the_kv_write_attends_with_the_rotated_q_and_k(
    backend_name: str, device: str, mode: ForwardMode
) -> None:
    """q and k handed over unrotated, with the rotation (`Rope`: the rotary kernel fused with
    the KV write on CUDA): the output and the caches those of q and k rotated by the rotary
    reference first, within bf16 tolerance, and the padded tail zeroed."""
    num_heads, num_kv_heads, head_dim = 16, 4, 64
    world = World.create(num_kv_heads, head_dim, torch.bfloat16, device)
    specs = EXTEND_SPECS if mode == ForwardMode.EXTEND else DECODE_SPECS
    batch, q, k, v = make_batch(world, mode, specs, num_heads, sum(e for _, e in specs) + 3)
    rotary_layer = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(device)
    rope = Rope(batch.positions, rotary_layer.cos_cache, rotary_layer.sin_cache)
    q_rot, k_rot = rotary(rope.positions, q, k, rope.cos_cache, rope.sin_cache)
    expected = reference(world, batch, q_rot, k_rot, v)
    backend = create_attention_backend(backend_name, num_heads, num_kv_heads, head_dim)
    backend.init_forward_metadata(batch)
    out = torch.full_like(q, 7.0)
    x = AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, head_dim**-0.5, rope)
    backend.forward(batch, x)
    ref_out, ref_k, ref_v = expected
    torch.testing.assert_close(out[: batch.num_tokens], ref_out[: batch.num_tokens], **BF16)
    assert torch.count_nonzero(out[batch.num_tokens :]) == 0, "padded tail not zeroed"
    torch.testing.assert_close(world.k_cache[1:], ref_k[1:], **BF16)
    assert torch.equal(world.v_cache[1:], ref_v[1:])


# ---- CPU ----


def test_flashinfer_missing_names_the_flag() -> None:
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed")
    with pytest.raises(ImportError, match="--attention-backend"):
        create_attention_backend("flashinfer", 8, 2, 64)


def test_flashinfer_imports_on_a_thread_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner starts FlashInfer's import before the device and the weights; the backend
    takes the module from it (a stand-in package here, which notes where it was imported)."""
    package = tmp_path / "flashinfer"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import threading\nimported_on = threading.current_thread().name\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)  # a real one comes back after
    monkeypatch.setattr(flashinfer_support, "_importing", None)
    try:
        flashinfer_support.start_import()
        module = flashinfer_support.module()
        assert module.imported_on.startswith("srt-flashinfer-import")
        assert flashinfer_support.module() is module
    finally:
        # The stand-in must not outlive the test: later ones would take it for FlashInfer.
        sys.modules.pop("flashinfer", None)


def stand_in_flashinfer(root: Path, version: str, part_needs_init: bool) -> None:
    """A package named flashinfer under `root`, installed as `flashinfer-python` `version`:
    its `__init__` notes that it ran; its parts (`PARTS`) are there, the prefill one
    importing only after the `__init__` if `part_needs_init`."""
    package = root / "flashinfer"
    (package / "jit").mkdir(parents=True)
    (package / "__init__.py").write_text("init_ran = True\nfrom . import decode, prefill\n")
    (package / "decode.py").write_text("from .jit import env\nWrapper = 'decode'\n")
    check = "import flashinfer\nassert flashinfer.init_ran\n" if part_needs_init else ""
    (package / "prefill.py").write_text(check + "Wrapper = 'prefill'\n")
    (package / "jit" / "__init__.py").write_text("")
    (package / "jit" / "env.py").write_text("FLASHINFER_JIT_DIR = 'jit'\n")
    dist = root / f"flashinfer_python-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n"
    )


@pytest.mark.parametrize(
    ("version", "part_needs_init", "whole"),
    [
        (flashinfer_support.TESTED_VERSION, False, False),  # its parts alone
        ("0.0.1", False, True),  # another version: as it comes
        (flashinfer_support.TESTED_VERSION, True, True),  # a part needs the rest: as it comes
    ],
)
def test_flashinfer_imports_only_the_parts_the_backend_uses(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    part_needs_init: bool,
    whole: bool,
) -> None:
    stand_in_flashinfer(tmp_path, version, part_needs_init)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "flashinfer"]:
        monkeypatch.delitem(sys.modules, name)  # a real one comes back after
    try:
        assert flashinfer_support.version() == version
        module = flashinfer_support.import_package()
        assert getattr(module, "init_ran", False) is whole
        assert (module.decode.Wrapper, module.prefill.Wrapper) == ("decode", "prefill")
        assert module.jit.env.FLASHINFER_JIT_DIR == "jit"
        assert flashinfer_support.import_package() is module  # once
    finally:
        # The stand-in must not outlive the test: later ones would take it for FlashInfer.
        for name in [m for m in sys.modules if m.split(".")[0] == "flashinfer"]:
            sys.modules.pop(name)


def test_flashinfer_missing_is_refused_with_the_flags() -> None:
    if flashinfer_support.installed():
        pytest.skip("flashinfer is installed")
    with pytest.raises(
        ServerArgsError,
        match=r"^argument --attention-backend: flashinfer needs the flashinfer-python package",
    ):
        ServerArgs(attention_backend="flashinfer").check()
    ServerArgs(attention_backend="triton").check()  # only the chosen backend's needs count


def test_flashinfer_on_an_explicit_cpu_is_refused_with_the_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flashinfer_support, "installed", lambda: True)
    with pytest.raises(ServerArgsError, match=r"^argument --attention-backend: .* not on cpu"):
        ServerArgs(attention_backend="flashinfer", device="cpu").check()
    ServerArgs(attention_backend="flashinfer").check()  # auto: the runner checks the device


@pytest.mark.parametrize(
    ("facts", "message"),
    [
        ({"device_type": "cpu"}, "runs on CUDA GPUs only, not on cpu"),
        ({"device_type": "mps"}, "runs on CUDA GPUs only, not on mps"),
        ({"capability": (7, 5)}, "compute capability 8.0 or newer; this one's is 7.5"),
        ({"capability": (6, 1)}, "compute capability 8.0 or newer; this one's is 6.1"),
        ({"head_dim": 96}, "supports head sizes 64, 128, 256; the model's is 96"),
        ({"head_dim": 512}, "supports head sizes 64, 128, 256; the model's is 512"),
    ],
)
def test_flashinfer_refuses_what_it_cannot_run(facts: dict[str, Any], message: str) -> None:
    with pytest.raises(ServerArgsError, match=r"^argument --attention-backend: flashinfer ") as e:
        flashinfer_support.check_flashinfer(**facts)
    assert message in str(e.value) and "--attention-backend triton" in str(e.value)


@pytest.mark.parametrize(
    "facts",
    [
        {"installed": True, "device_type": "cuda", "capability": (8, 0), "head_dim": 64},
        {"capability": (9, 0), "head_dim": 128},
        {"capability": (12, 0), "head_dim": 256},
        {},
    ],
)
def test_flashinfer_runs_what_it_supports(facts: dict[str, Any]) -> None:
    flashinfer_support.check_flashinfer(**facts)


def test_flashinfer_head_size_is_checked_with_the_model(tiny_llama: Path) -> None:
    config = ModelConfig.from_path(str(tiny_llama), "float32", None)
    args = ServerArgs(attention_backend="flashinfer")
    for head_dim in flashinfer_support.HEAD_SIZES:
        args.check_model(dataclasses.replace(config, head_dim=head_dim))
    with pytest.raises(ServerArgsError, match=r"^argument --attention-backend: .* is 80;"):
        args.check_model(dataclasses.replace(config, head_dim=80))
    ServerArgs(attention_backend="triton").check_model(dataclasses.replace(config, head_dim=80))


def test_kv_indices_gather_each_requests_slots() -> None:
    """FlashInfer's pages at page size 1: each request's first `len` table entries, end to
    end (here under Triton's interpreter where there is no CUDA)."""
    pytest.importorskip("triton")
    from srt.layers.attention.triton_ops.kv_indices import BLOCK, kv_indices

    device = "cuda" if torch.cuda.is_available() else "cpu"
    width = 2 * BLOCK + 3
    table = torch.randint(1, 2**30, (6, width), dtype=torch.int32, device=device)
    rows = [4, 0, 4, 2, 5]
    lens = [1, width, BLOCK, 0, BLOCK + 1]  # one slot, a whole row, a block, none, past one
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(indptr[-1])
    out = torch.full((total + 2,), -1, dtype=torch.int32, device=device)
    kv_indices(
        table,
        torch.tensor(rows, dtype=torch.int32, device=device),
        torch.from_numpy(indptr).to(device),
        out,
        max(lens),
    )
    expected = torch.cat([table[r, :n] for r, n in zip(rows, lens, strict=True)])
    assert torch.equal(out[:total], expected)
    assert out[total:].tolist() == [-1, -1]  # nothing written past the last request


# Shapes for the CPU (fp16: Triton's interpreter multiplies bf16 as raw integers).
SMALL = dict(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu")


def run_interpreter_checks() -> None:
    """The CPU checks, for a process started with TRITON_INTERPRET=1."""
    torch.manual_seed(0)
    check_eager("triton", ForwardMode.EXTEND, [(0, 1), (0, 70), (60, 9)], pad=2, **SMALL)
    check_eager("triton", ForwardMode.DECODE, [(0, 1), (130, 1), (1100, 1)], pad=1, **SMALL)
    check_decode_kernel([1100, 0, 130, 1], **SMALL)
    check_static_replay(
        "triton", ForwardMode.EXTEND, [[(0, 16)], [(3, 2), (65, 5)]], 16, max_bs=4, **SMALL
    )
    check_static_replay(
        "triton", ForwardMode.DECODE, [[(5, 1)] * 4, [(70, 1)]], 4, max_bs=4, **SMALL
    )
    check_metadata_stays_with_its_batch(**SMALL)


def test_triton_kernels_under_interpreter() -> None:
    triton = pytest.importorskip("triton")
    import numpy as np
    from packaging.version import Version

    if Version(np.__version__) >= Version("2.4") and Version(triton.__version__) < Version("3.7"):
        pytest.skip("triton < 3.7's interpreter fails on numpy >= 2.4 (triton issue 9171)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = "from tests.test_attention_backends import run_interpreter_checks as r; r()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_triton_metadata_rows_start_16_byte_aligned(mode: ForwardMode) -> None:
    """Triton compiles a kernel variant per pattern of 16-byte-aligned pointer arguments: with
    every metadata row aligned, batches of any request and tile count share the variant that
    the warm-up compiled."""
    pytest.importorskip("triton")
    world = World.create(2, 64, torch.float16, "cpu")
    backend = create_attention_backend("triton", 8, 2, 64)
    backend.init_graph_state(8, max_tokens=512)
    lens = [(0, 1), (3, 70), (9, 130), (0, 5), (64, 1), (1, 200), (7, 9)]
    for n in range(1, len(lens) + 1):
        specs = [(p + e - 1, 1) for p, e in lens[:n]] if mode == ForwardMode.DECODE else lens[:n]
        batch, *_ = make_batch(world, mode, specs, 8, sum(e for _, e in specs) + n % 3)
        for init in (
            backend.init_forward_metadata,
            lambda b: backend.init_forward_metadata_replay(b, b.padded_tokens),
        ):
            init(batch)
            step = batch.attn_metadata
            base = step.fields.untyped_storage().data_ptr()
            rows = [*step.fields, *step.tiles]
            assert all((row.data_ptr() - base) % 16 == 0 for row in rows), (n, init)
            assert [row.is_contiguous() for row in rows] == [True] * len(rows)


def test_triton_forward_runs_on_its_own_batch_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metadata travels on the batch (here without the decode kernel, which the
    interpreter checks run for real where they can)."""
    pytest.importorskip("triton")
    from srt.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "decode_attention", decode_in_torch)
    torch.manual_seed(0)
    check_metadata_stays_with_its_batch(**SMALL)


def test_triton_refuses_static_metadata_refilled_for_another_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Graph metadata views the static buffers, which every replay hook refills: a forward on
    an earlier batch's views is refused rather than run on the later batch's layout, and the
    latest batch's runs (with the decode kernel in plain PyTorch)."""
    pytest.importorskip("triton")
    from srt.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "decode_attention", decode_in_torch)
    torch.manual_seed(0)
    world = World.create(2, 64, torch.float16, "cpu")
    backend = create_attention_backend("triton", 8, 2, 64)
    backend.init_graph_state(4, max_tokens=4)
    first, *_ = make_batch(world, ForwardMode.DECODE, [(5, 1), (70, 1)], 8, padded_tokens=4)
    second, q, k, v = make_batch(world, ForwardMode.DECODE, [(30, 1)], 8, padded_tokens=4)
    expected = reference(world, second, q, k, v)
    backend.init_forward_metadata_replay(first, 4)
    backend.init_forward_metadata_replay(second, 4)
    out = torch.full_like(q, 7.0)
    with pytest.raises(RuntimeError, match="refilled for another batch"):
        backend.forward(
            first, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, 64**-0.5)
        )
    backend.forward(second, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, 64**-0.5))
    assert_matches(world, expected, out, second.num_tokens)
