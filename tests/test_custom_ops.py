"""The `srt::attention` custom op: opcheck, the split-op registry, and the torch_native backend
on one batch that mixes a fresh prefill, an extend on a cached prefix, and a decode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from srt.batch_layout import ForwardMode
from srt.compilation.op_registry import opcheck, split_ops
from srt.forward_batch import ForwardBatch, pad_tokens
from srt.ipc.messages import BatchPlan
from srt.layers.attention.base import AttentionBackend
from srt.layers.attention.layer import attention_op, eager_forward_context
from srt.layers.attention.registry import create_attention_backend
from srt.model_executor.step_inputs import upload_step

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
NUM_SLOTS = 64
# (tokens already cached, tokens computed this step) per request: prefill, extend, decode.
REQUESTS = [(0, 5), (4, 3), (6, 1)]
PADDED_TOKENS = 12
SCALING = HEAD_DIM**-0.5


@dataclass
class Case:
    batch: ForwardBatch
    backend: AttentionBackend
    q: torch.Tensor  # [T, H*D], T padded
    k: torch.Tensor  # [T, Hkv*D]
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request, every key of its sequence [S, Hkv, D]
    values: list[torch.Tensor]


def make_case(device: str, dtype: torch.dtype = torch.float32) -> Case:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    slots = torch.randperm(NUM_SLOTS - 1, generator=gen) + 1  # never the dummy slot 0
    req_to_token = torch.zeros(len(REQUESTS), 16, dtype=torch.int32, device=device)
    k_cache = randn(NUM_SLOTS, KV_HEADS, HEAD_DIM)  # stale values everywhere
    v_cache = randn(NUM_SLOTS, KV_HEADS, HEAD_DIM)
    keys, values, new_k, new_v, locs, used = [], [], [], [], [], 0
    for row, (prefix, extend) in enumerate(REQUESTS):
        seq_slots = slots[used : used + prefix + extend].to(device)
        used += prefix + extend
        req_to_token[row, : prefix + extend] = seq_slots
        keys.append(randn(prefix + extend, KV_HEADS, HEAD_DIM))
        values.append(randn(prefix + extend, KV_HEADS, HEAD_DIM))
        k_cache[seq_slots[:prefix]] = keys[-1][:prefix]  # the cached prefix
        v_cache[seq_slots[:prefix]] = values[-1][:prefix]
        new_k.append(keys[-1][prefix:])
        new_v.append(values[-1][prefix:])
        locs.append(seq_slots[prefix:])
    num_tokens = sum(e for _, e in REQUESTS)
    batch = upload_step(
        BatchPlan.greedy(
            ForwardMode.EXTEND,
            input_ids=np.zeros(num_tokens, np.int64),
            positions=np.concatenate([np.arange(p, p + e) for p, e in REQUESTS]),
            out_cache_loc=torch.cat(locs).cpu().numpy(),
            req_pool_indices=np.arange(len(REQUESTS)),
            prefix_lens=np.array([p for p, _ in REQUESTS]),
            extend_lens=np.array([e for _, e in REQUESTS]),
        ),
        req_to_token,
    )
    batch = pad_tokens(batch, PADDED_TOKENS)
    pad = PADDED_TOKENS - num_tokens
    q = randn(PADDED_TOKENS, HEADS * HEAD_DIM)
    k = torch.cat([torch.cat(new_k).flatten(1), randn(pad, KV_HEADS * HEAD_DIM)])
    v = torch.cat([torch.cat(new_v).flatten(1), randn(pad, KV_HEADS * HEAD_DIM)])
    backend = create_attention_backend("torch_native", HEADS, KV_HEADS, HEAD_DIM)
    return Case(batch, backend, q, k, v, k_cache, v_cache, keys, values)


def reference_attention(case: Case) -> torch.Tensor:
    """Dense causal GQA attention per request, in float64, written out by hand."""
    outs = []
    q = case.q.double().view(PADDED_TOKENS, HEADS, HEAD_DIM)
    start = 0
    for (prefix, extend), keys, values in zip(REQUESTS, case.keys, case.values, strict=True):
        group = HEADS // KV_HEADS
        k = keys.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ehd,shd->hes", q[start : start + extend], k) * SCALING
        visible = (
            torch.arange(prefix + extend)[None, :] <= torch.arange(prefix, prefix + extend)[:, None]
        )
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        outs.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), v))
        start += extend
    return torch.cat(outs).flatten(1)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_attention_is_a_split_op() -> None:
    assert "srt::attention" in split_ops()


@pytest.mark.parametrize("device", DEVICES)
def test_torch_native_mixed_batch_matches_dense_reference(device: str) -> None:
    case = make_case(device)
    out = torch.full_like(case.q, float("nan"))
    k_cache_before = case.k_cache.clone()
    with eager_forward_context(case.batch, case.backend):
        attention_op(case.q, case.k, case.v, out, case.k_cache, case.v_cache, SCALING)
    num_tokens = case.batch.num_tokens
    torch.testing.assert_close(
        out[:num_tokens].double(), reference_attention(case), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))  # padded tail
    # The step's K went to its slots; the padded tokens only touched the dummy slot 0.
    locs = case.batch.out_cache_loc[:num_tokens]
    assert torch.equal(case.k_cache[locs].flatten(1), case.k[:num_tokens])
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[locs.cpu()] = False
    untouched[0] = False
    assert torch.equal(case.k_cache[untouched.to(device)], k_cache_before[untouched.to(device)])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_attention(device: str) -> None:
    case = make_case(device)
    out = torch.empty_like(case.q)
    with eager_forward_context(case.batch, case.backend):
        opcheck(attention_op, (case.q, case.k, case.v, out, case.k_cache, case.v_cache, SCALING))


def test_attention_outside_a_forward_context_is_an_error() -> None:
    case = make_case("cpu")
    with pytest.raises(RuntimeError, match="outside a forward_context"):
        attention_op(
            case.q, case.k, case.v, torch.empty_like(case.q), case.k_cache, case.v_cache, SCALING
        )


def test_unknown_attention_backend() -> None:
    with pytest.raises(ValueError, match="unknown backend 'flash'; choose one of"):
        create_attention_backend("flash", HEADS, KV_HEADS, HEAD_DIM)


def test_breakable_capture_sees_the_split_op_without_a_dispatch_mode() -> None:
    """On CUDA a breakable capture runs under its torch function mode alone (no dispatch mode,
    unlike the CPU emulation of capture): the attention op must still reach the mode as the
    split op, to be recorded instead of run."""
    from srt.model_executor.graphs.breakable import SplitAtOps

    class Session:
        def __init__(self) -> None:
            self.events: list[str] = []

        def begin(self) -> None:
            self.events.append("begin")

        def end(self) -> str:
            self.events.append("end")
            return "segment"

    case = make_case("cpu")
    out = torch.full_like(case.q, 7.0)
    session = Session()
    splitter = SplitAtOps(set(split_ops()), session)  # type: ignore[arg-type]
    with splitter:  # no forward context either: the op must not run
        attention_op(case.q, case.k, case.v, out, case.k_cache, case.v_cache, SCALING)
    assert [c.op.name() for c in splitter.calls] == ["srt::attention"]
    assert session.events == ["end", "begin"]
    assert torch.all(out == 7.0)
