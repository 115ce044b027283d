"""Sampling: greedy, temperature, top-k / top-p / min-p filters, seeded reproducibility."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srt import Engine
from srt.layers.sampler import SamplingBatch, filter_probs, sample

DRAWS = 20_000


def batch(
    n: int,
    *,
    temperature: float = 1.0,
    top_k: int = 1 << 30,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.full((n,), temperature),
        top_ps=torch.full((n,), top_p),
        top_ks=torch.full((n,), top_k, dtype=torch.int64),
        min_ps=torch.full((n,), min_p),
        seeds=torch.arange(n, dtype=torch.int64) if seeds is None else seeds,
        positions=torch.full((n,), 7, dtype=torch.int64) if positions is None else positions,
    )


def draws(logits: torch.Tensor, **kwargs) -> torch.Tensor:
    """DRAWS samples from one row of logits: one per seed (distinct random streams)."""
    return sample(logits.expand(DRAWS, -1), batch(DRAWS, **kwargs))


def chi_square_excess(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of the draws against `probs`, in standard deviations above its
    mean (chi-square with k degrees of freedom has mean k and variance 2k). Tokens expected
    fewer than 5 times are pooled into one bin, as the test requires."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs.double() * len(samples)
    assert counts[expected == 0].sum() == 0, "drew a token of probability 0"
    rare = (expected > 0) & (expected < 5)
    keep = expected >= 5
    counts = torch.cat([counts[keep], counts[rare].sum().reshape(1)])
    expected = torch.cat([expected[keep], expected[rare].sum().reshape(1)])
    counts, expected = counts[expected > 0], expected[expected > 0]
    dof = len(expected) - 1
    if dof == 0:
        return 0.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    return (stat - dof) / (2 * dof) ** 0.5


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(1, 40, generator=torch.Generator().manual_seed(0)) * 2


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    b = batch(64, temperature=0.0)
    assert torch.equal(sample(logits, b), logits.argmax(-1))
    assert torch.equal(sample(logits, None), logits.argmax(-1))  # known greedy: no parameters
    b.temperatures[::2] = 1.0  # a mixed batch: greedy rows stay argmax
    out = sample(logits, b)
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])
    assert not torch.equal(out[::2], logits.argmax(-1)[::2])


# Within 5 standard deviations is loose (draws are deterministic here, so no flakiness either
# way), yet a wrong temperature, an off-by-one in the filters or biased noise is far outside.
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_draws_follow_softmax(logits: torch.Tensor, temperature: float) -> None:
    probs = torch.softmax(logits[0] / temperature, -1)
    assert chi_square_excess(draws(logits, temperature=temperature), probs) < 5
    # One request's stream over positions (a fixed seed) follows it too.
    positions = torch.arange(DRAWS, dtype=torch.int64)
    per_position = sample(
        logits.expand(DRAWS, -1),
        batch(
            DRAWS, temperature=temperature, seeds=torch.full((DRAWS,), 1234), positions=positions
        ),
    )
    assert chi_square_excess(per_position, probs) < 5


def test_draws_with_wrong_temperature_fail_the_check(logits: torch.Tensor) -> None:
    """The check above has power: sampling at 1.0 is rejected as a sample at 0.7."""
    wrong = torch.softmax(logits[0] / 0.7, -1)
    assert chi_square_excess(draws(logits, temperature=1.0), wrong) > 50


def test_filter_probs_on_a_known_distribution() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])

    def kept(top_k: int = 4, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
        out = filter_probs(
            probs, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
        )
        assert torch.equal(out[out > 0], probs[out > 0])  # kept tokens keep their mass
        return (out[0] > 0).nonzero().flatten().tolist()

    assert kept() == [0, 1, 2, 3]
    assert kept(top_k=1) == [1]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_p=0.4) == [1]
    assert kept(top_p=0.75) == [1, 3]
    assert kept(top_p=0.85) == [1, 2, 3]
    assert kept(min_p=0.2) == [1, 2, 3]  # 0.05 < 0.2 * 0.5
    assert kept(min_p=0.5) == [1, 3]
    assert kept(top_k=3, top_p=0.7, min_p=0.1) == [1, 3]


def allowed_set(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens each filter allows, computed the slow obvious way."""
    order = probs.argsort(descending=True).tolist()
    allowed, mass = set(), 0.0
    for rank, tok in enumerate(order):
        if rank < top_k and mass < top_p and probs[tok] >= min_p * probs[order[0]]:
            allowed.add(tok)
        mass += float(probs[tok])
    return allowed


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [
        (5, 1.0, 0.0),
        (1 << 30, 0.6, 0.0),
        (1 << 30, 1.0, 0.3),
        (8, 0.9, 0.05),
        (1, 0.3, 0.0),
    ],
)
def test_filtered_sampling_stays_in_the_allowed_set(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> None:
    probs = torch.softmax(logits[0], -1)
    allowed = allowed_set(probs, top_k, top_p, min_p)
    assert 1 <= len(allowed) < probs.shape[0]
    seen = set(draws(logits, top_k=top_k, top_p=top_p, min_p=min_p).tolist())
    assert seen == allowed  # never outside, and every allowed token does come up
    # Among the allowed tokens the draws follow the renormalised distribution.
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[list(allowed)] = True
    renormalised = torch.where(mask, probs, 0.0) / probs[mask].sum()
    samples = draws(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    assert chi_square_excess(samples, renormalised) < 5


def test_seeded_draws_do_not_depend_on_the_batch(logits: torch.Tensor) -> None:
    wide = torch.randn(8, 40, generator=torch.Generator().manual_seed(2))
    wide[5] = logits[0]
    seeds = torch.tensor([3, 1, 4, 1, 5, 42, 2, 6])
    alone = sample(logits, batch(1, seeds=torch.tensor([42])))
    together = sample(wide, batch(8, seeds=seeds))
    assert together[5] == alone[0]


def test_different_seeds_give_different_streams(logits: torch.Tensor) -> None:
    positions = torch.arange(64, dtype=torch.int64)

    def stream(seed: int) -> list[int]:
        return sample(
            logits.expand(64, -1), batch(64, seeds=torch.full((64,), seed), positions=positions)
        ).tolist()

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


def test_every_bit_of_the_seed_counts(logits: torch.Tensor) -> None:
    positions = torch.arange(64, dtype=torch.int64)

    def stream(seed: int) -> list[int]:
        return sample(
            logits.expand(64, -1), batch(64, seeds=torch.full((64,), seed), positions=positions)
        ).tolist()

    # Seeds that differ only in their high 32 bits (or only in the sign) draw differently.
    streams = [stream(s) for s in (0, 2**32, 2**62, -(2**63), 2**63 - 1, -1, 2**32 - 1)]
    assert len({tuple(s) for s in streams}) == len(streams)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    with Engine(model_path=str(tiny_llama), device="cpu", dtype="float32") as eng:
        yield eng


def test_engine_seeded_sampling_is_reproducible(engine: Engine) -> None:
    params = {"max_new_tokens": 16, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    first = engine.generate(prompt="The rain fell", sampling_params=params)["output_ids"]
    assert engine.generate(prompt="The rain fell", sampling_params=params)["output_ids"] == first
    # In a batch with other requests, at another index, the seeded request draws the same.
    batched = engine.generate(
        prompt=["A garden is", "The rain fell", "Computers do exactly"],
        sampling_params=[
            {"max_new_tokens": 9, "temperature": 0.8},
            params,
            {"max_new_tokens": 20, "temperature": 0.0},
        ],
    )
    assert batched[1]["output_ids"] == first
    other = engine.generate(prompt="The rain fell", sampling_params={**params, "seed": 43})
    assert other["output_ids"] != first
    greedy = engine.generate(prompt="The rain fell", sampling_params={**params, "temperature": 0.0})
    assert greedy["output_ids"] != first  # temperature 1 really samples
