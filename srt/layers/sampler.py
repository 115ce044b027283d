"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness comes from a counter-based hash of (seed, position, token id), not from a
generator's state: a seeded request draws the same tokens whatever batch it lands in, on any
device, and the whole batch samples in a few vectorised ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from srt.op_selection import HAS_TRITON

_MASK32 = 0xFFFFFFFF


def greedy_ids(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax, [B, V] -> [B] int64 (into `out` if given): two Triton launches on
    CUDA (torch's argmax is one latency-bound block per row), torch's argmax elsewhere; the
    same ids either way."""
    if logits.is_cuda and HAS_TRITON:
        from srt.layers.triton_ops.argmax import argmax_rows

        return argmax_rows(logits, out)
    return torch.argmax(logits, dim=-1, out=out)


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [B] float32; 0 = greedy
    top_ps: torch.Tensor  # [B] float32 in (0, 1]
    top_ks: torch.Tensor  # [B] int64; >= vocab disables
    min_ps: torch.Tensor  # [B] float32 in [0, 1)
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int32 or int64, the position of the token being sampled


@dataclass
class SamplingArrays:
    """A batch's sampling parameters on the host, one entry per request (as a plan has them)."""

    temperatures: np.ndarray  # float32
    top_ps: np.ndarray  # float32
    top_ks: np.ndarray  # int64
    min_ps: np.ndarray  # float32
    seeds: np.ndarray  # int64


class SamplingBuffers:
    """Device buffers for the sampling parameters of up to `capacity` requests, filled from the
    host in two copies (the floats, the ints): each copy costs a host-device round trip. A
    captured sampler reads the views of one row count, the same addresses every step."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        # Uninitialised: `load` writes every row it hands out (a memset would be two more
        # launches on every eager step with sampling).
        self.floats = torch.empty(3 * capacity, dtype=torch.float32, device=device)
        self.ints = torch.empty(2 * capacity, dtype=torch.int64, device=device)

    def load(
        self, arrays: SamplingArrays, positions: torch.Tensor, rows: int | None = None
    ) -> SamplingBatch:
        """`arrays` in, as a `SamplingBatch` of `rows` rows (default: one per request); rows
        beyond the requests are greedy. `positions`: [rows] of the token each row samples."""
        n = len(arrays.temperatures)
        rows = n if rows is None else rows
        if n > rows or rows > self.capacity:
            raise ValueError(f"{n} requests in {rows} rows of {self.capacity} buffered")
        floats = np.zeros((3, rows), dtype=np.float32)
        floats[:, :n] = (arrays.temperatures, arrays.top_ps, arrays.min_ps)
        floats[1, n:] = 1.0  # top_p of the greedy padding rows: no filter
        ints = np.zeros((2, rows), dtype=np.int64)
        ints[:, :n] = (arrays.top_ks, arrays.seeds)
        # non_blocking: the host may be a step ahead of the device (overlap scheduling).
        self.floats[: 3 * rows].copy_(torch.from_numpy(floats.ravel()), non_blocking=True)
        self.ints[: 2 * rows].copy_(torch.from_numpy(ints.ravel()), non_blocking=True)
        temperatures, top_ps, min_ps = self.floats[: 3 * rows].split(rows)
        top_ks, seeds = self.ints[: 2 * rows].split(rows)
        return SamplingBatch(temperatures, top_ps, top_ks, min_ps, seeds, positions)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # Integer mixer on 32-bit values held in int64, so no product overflows.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, position, token id); all 64
    bits of the seed count (the high half is hashed in on its own, so seeds that differ only
    there draw different streams)."""
    positions = positions.long()
    high = _hash32(((seeds >> 32) & _MASK32) + 0x7F4A7C15)
    row = _hash32((seeds & _MASK32) ^ high ^ _hash32((positions & _MASK32) + 0x9E3779B9))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _hash32(row[:, None] ^ _hash32(ids + 0x632BE5AB)[None, :])
    return ((h >> 8).float() + 0.5) / float(1 << 24)


def filter_probs(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Zero every token outside the top-k, the top-p nucleus or the min-p floor."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    outside = ranks >= top_ks[:, None]
    # A token is kept while the mass before it is below top_p (the top token always is).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    outside |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1.0)
    outside |= sorted_probs < sorted_probs[:, :1] * min_ps[:, None]
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample(
    logits: torch.Tensor, batch: SamplingBatch | None, greedy: torch.Tensor | None = None
) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] int64. `batch` None: every request is greedy,
    which the caller knows from the host (then no sampling parameters need be on the
    device). `greedy`: `logits.argmax(-1)`, where the caller has it already (a captured
    graph computes it)."""
    if greedy is None:
        greedy = greedy_ids(logits)
    if batch is None:
        return greedy
    temps = torch.where(batch.temperatures > 0, batch.temperatures, 1.0)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    probs = filter_probs(probs, batch.top_ks, batch.top_ps, batch.min_ps)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
    noise = -torch.log(uniform_noise(batch.seeds, batch.positions, logits.shape[-1]))
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperatures > 0, sampled, greedy)


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int = 0
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Log-probabilities (of the model's distribution) of `token_ids`, and the top `top_n`
    (values and ids; None when `top_n` is 0)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, token_ids[:, None]).squeeze(-1)
    if top_n <= 0:
        return chosen, None
    top_vals, top_ids = logp.topk(top_n, dim=-1)
    return chosen, (top_vals, top_ids)
