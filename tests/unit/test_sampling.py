"""Sampling: greedy, top-k/top-p edge cases, and randomness that depends only on (seed, position, column)."""

from __future__ import annotations

import pytest
import torch

from tandem.backend.generation.sampling import SamplingParams, sample, uniforms

V = 50


def logits(b: int, w: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, w, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax() -> None:
    x = logits(5)
    out = sample(x, [SamplingParams()] * 5, list(range(5)))
    assert out.dtype == torch.long and out.device.type == "cpu" and out.shape == (5, 3)
    assert torch.equal(out, x.argmax(-1))


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    x = logits(8, seed=1)
    pos = list(range(100, 108))
    k1 = sample(x, [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(8)], pos)
    p0 = sample(x, [SamplingParams(temperature=1.5, top_p=1e-6, seed=s) for s in range(8)], pos)
    assert torch.equal(k1, x.argmax(-1))
    assert torch.equal(p0, x.argmax(-1))


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    x = logits(6, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=100 + i) for i in range(6)]
    pos = [3, 7, 7, 0, 12, 5]
    batched = sample(x, params, pos)
    for i in range(6):
        alone = sample(x[i : i + 1], params[i : i + 1], pos[i : i + 1])
        assert torch.equal(alone[0], batched[i])
    order = [5, 3, 1, 0, 4, 2]
    shuffled = sample(x[order], [params[i] for i in order], [pos[i] for i in order])
    assert torch.equal(shuffled, batched[order])
    # Mixed with greedy rows and other requests, the seeded rows are unchanged.
    mixed = sample(
        torch.cat([logits(2, seed=9), x]),
        [SamplingParams(), SamplingParams(0.7, seed=1), *params],
        [0, 1, *pos],
    )
    assert torch.equal(mixed[2:], batched)


def test_stream_split_across_calls_matches_one_call() -> None:
    # A stream's steps sampled one call at a time (as prefill then decode would) equal sampling all
    # positions in one batch with the same seed.
    x = logits(10, seed=3)
    p = SamplingParams(temperature=0.8, seed=42)
    together = sample(x, [p] * 10, list(range(10)))
    one_by_one = torch.cat([sample(x[i : i + 1], [p], [i]) for i in range(10)])
    assert torch.equal(together, one_by_one)


def test_different_seeds_differ() -> None:
    x = torch.zeros(64, 4, V)  # uniform distribution: tokens are pure randomness
    a = sample(x, [SamplingParams(temperature=1.0, seed=1)] * 64, list(range(64)))
    b = sample(x, [SamplingParams(temperature=1.0, seed=2)] * 64, list(range(64)))
    assert (a != b).float().mean() > 0.8
    # Columns of one row and consecutive positions are not copies of each other either.
    assert (a[:, 0] != a[:, 1]).float().mean() > 0.8
    assert (a[1:, 0] != a[:-1, 0]).float().mean() > 0.8


def test_distribution_sanity() -> None:
    n = 20000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().expand(n, 1, 4).contiguous()
    pos = list(range(n))
    freq = torch.bincount(sample(x, [SamplingParams(temperature=1.0, seed=7)] * n, pos)[:, 0], minlength=4)
    torch.testing.assert_close(freq / n, probs, atol=0.015, rtol=0)
    # top_k=2 renormalises over the two most likely tokens.
    freq = torch.bincount(sample(x, [SamplingParams(1.0, top_k=2, seed=7)] * n, pos)[:, 0], minlength=4)
    torch.testing.assert_close(freq / n, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    # top_p=0.7 keeps the smallest set with mass >= 0.7: {0, 1}.
    freq = torch.bincount(sample(x, [SamplingParams(1.0, top_p=0.7, seed=7)] * n, pos)[:, 0], minlength=4)
    assert freq[2:].sum() == 0 and abs(freq[0] / n - 0.625) < 0.015
    # temperature 0.5 squares the probabilities (then renormalises).
    freq = torch.bincount(sample(x, [SamplingParams(0.5, seed=7)] * n, pos)[:, 0], minlength=4)
    sq = probs**2 / (probs**2).sum()
    torch.testing.assert_close(freq / n, sq, atol=0.015, rtol=0)


def test_uniforms_and_param_validation() -> None:
    u = uniforms([1, 1, 2], [5, 5, 5], 4)
    assert u.shape == (3, 4) and (u >= 0).all() and (u < 1).all()
    assert (u[0] == u[1]).all() and (u[0] != u[2]).all()
    assert (uniforms([-1, 2**70], [0, 0], 1) >= 0).all()  # any Python int seed is accepted
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
