"""Low-rank factors and the anchor-matching math, on real tensors."""

from __future__ import annotations

import math

import pytest
import torch

from agentcache.correction.lowrank import Factors, as_rows, factorize, from_rows
from agentcache.correction.matching import gate_distances, gate_weights, interpolated_correction, normalized_entropy


def _matrix(layers: int, tokens: int, features: int, rank: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    left = torch.randn(layers, tokens, rank, generator=gen)
    right = torch.randn(layers, rank, features, generator=gen)
    return torch.bmm(left, right) + 0.01 * torch.randn(layers, tokens, features, generator=gen)


@pytest.mark.parametrize("tokens,features", [(96, 32), (20, 48)])  # tall (Gram path) and wide (SVD path)
def test_truncated_factors_reach_the_optimal_error(tokens, features):
    rows = _matrix(3, tokens, features, rank=6)
    for rank in (2, 6, 10):
        factors = factorize(rows, rank)
        assert factors.a.shape == (3, tokens, rank) and factors.b.shape == (3, rank, features)
        residual = (factors.rows() - rows).pow(2).sum(dim=(1, 2))  # (L,)
        singular = torch.linalg.svdvals(rows.double())  # (L, K)
        optimal = singular[:, rank:].pow(2).sum(-1)  # Eckart–Young: the best rank-r error
        assert torch.allclose(residual.double(), optimal, rtol=1e-3, atol=1e-3)


def test_full_rank_reconstructs_and_dense_keeps_the_matrix():
    rows = _matrix(2, 40, 16, rank=16)
    assert torch.allclose(factorize(rows, 64).rows(), rows, atol=1e-3)  # rank clipped to 16
    dense = factorize(rows, None)
    assert dense.rank is None and torch.equal(dense.rows(), rows)
    assert dense.nbytes == 2 * 40 * 16 * 4


def test_factors_are_kept_dense_where_low_rank_is_not_smaller():
    short = _matrix(2, 12, 48, rank=6)  # rank 32 of a 12 x 48 matrix: 32·60 > 12·48 numbers
    factors = factorize(short, 32)
    assert factors.rank is None and torch.equal(factors.rows(), short)
    assert factors.nbytes == 2 * 12 * 48 * 4
    long = _matrix(2, 200, 48, rank=6)
    assert factorize(long, 8).rank == 8 and factorize(long, 8).nbytes < factorize(long, None).nbytes


def test_byte_accounting_is_exact():
    factors = factorize(_matrix(4, 50, 24, rank=5), 8)
    assert factors.nbytes == 4 * (50 * 8 + 8 * 24) * 4
    assert factors.layer_rows(2, 10).shape == (10, 24)
    assert torch.allclose(factors.layer_rows(2, 10), factors.rows(10)[2])


def test_rows_round_trip():
    kv = torch.randn(3, 2, 7, 5)  # (L, H, T, D)
    rows = as_rows(kv)
    assert rows.shape == (3, 7, 10)
    assert torch.equal(from_rows(rows, heads=2), kv)


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):
        factorize(torch.randn(1, 4, 4), 0)


def test_normalized_entropy_bounds():
    assert normalized_entropy(torch.tensor([0.25, 0.25, 0.25, 0.25])) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([1.0, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-9)
    weights = gate_weights(torch.tensor([1.0, 2.0]), temperature=1.0)
    p = math.exp(-1) / (math.exp(-1) + math.exp(-2))
    expected = -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    assert normalized_entropy(weights) == pytest.approx(expected)
    with pytest.raises(ValueError):
        normalized_entropy(torch.tensor([1.0]))


def test_gate_distances_follow_eq9():
    source = torch.randn(3, 10, 8)
    anchors = [factorize(torch.randn(3, 12, 8), None), factorize(torch.randn(3, 10, 8), 4)]
    got = gate_distances(source, anchors, k=6)
    for d, anchor in zip(got, anchors):
        assert d == pytest.approx(float((source[:, :6] - anchor.rows(6)).pow(2).sum().sqrt()), rel=1e-5)


def test_token_weights_pick_the_matching_anchor_and_never_extrapolate():
    source = torch.randn(2, 10, 6)
    near = factorize(source[:, :8].clone(), None)  # covers 8 of 10 tokens, identical to the source
    far = factorize(source[:, :6] + 50.0, None)  # covers 6 tokens, far away
    delta_near = factorize(torch.full((2, 8, 6), 1.0), None)
    delta_far = factorize(torch.full((2, 6, 6), -3.0), None)
    correction, covered = interpolated_correction(source, [near, far], [delta_near, delta_far], temperature=1.0)
    assert covered == 8
    assert torch.allclose(correction[:, :8], torch.ones(2, 8, 6), atol=1e-4)  # weight ~1 on the near anchor
    assert torch.equal(correction[:, 8:], torch.zeros(2, 2, 6))  # beyond every anchor: no correction


def test_token_weights_interpolate_between_equidistant_anchors():
    source = torch.zeros(1, 4, 2)
    a, b = factorize(torch.ones(1, 4, 2), None), factorize(-torch.ones(1, 4, 2), None)
    da, db = factorize(torch.full((1, 4, 2), 2.0), None), factorize(torch.zeros(1, 4, 2), None)
    correction, _ = interpolated_correction(source, [a, b], [da, db], temperature=1.0)
    assert torch.allclose(correction, torch.ones(1, 4, 2))  # equal weights: the mean


def test_factors_detect_non_finite_values():
    good = factorize(torch.randn(1, 6, 4), 2)
    assert good.is_finite()
    bad = Factors(good.a.clone(), good.b.clone())
    bad.b[0, 0, 0] = float("nan")
    assert not bad.is_finite()


def test_base_layers_pair_with_source_layers_through_the_offset():
    source = torch.randn(2, 5, 3)  # layers 1..2 of a 3-layer model
    exact = torch.cat([torch.full((1, 5, 3), 99.0), source])  # base layer 0 differs wildly, 1..2 match
    near = factorize(exact, None)
    far = factorize(exact + 10.0, None)
    d_near, d_far = factorize(torch.ones(2, 5, 3), None), factorize(-torch.ones(2, 5, 3), None)
    correction, _ = interpolated_correction(source, [near, far], [d_near, d_far], 1.0, base_layer_offset=1)
    assert torch.allclose(correction, torch.ones(2, 5, 3), atol=1e-4)


def test_the_nearest_scaled_gate_reads_relative_distances_on_any_scale():
    from agentcache.correction.matching import gate_weights, normalized_entropy

    close, apart = torch.tensor([10.0, 10.2, 10.4]), torch.tensor([10.0, 20.0, 30.0])
    for scale in (1.0, 100.0):  # the same relative spread, raw distances 100x apart
        assert normalized_entropy(gate_weights(close * scale, 0.1)) > 0.9  # no anchor clearly nearer
        assert normalized_entropy(gate_weights(apart * scale, 0.1)) < 0.01
    assert torch.allclose(gate_weights(close, 0.1), gate_weights(close * 100, 0.1))
    # the paper's absolute T = 1 on the large scale calls everything certain
    assert normalized_entropy(gate_weights(close * 100, 1.0, "absolute")) < 1e-6
    with pytest.raises(ValueError, match="gate scale"):
        gate_weights(close, 0.1, "median")
