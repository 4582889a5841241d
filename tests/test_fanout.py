"""Optimal fan-out against brute force, the section 7 closed form, and the online estimators."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from trtssd.spec_decode.fanout import (AcceptanceEstimator, PowerLaw, PowerLawEstimator, continuous_fanout,
                                expected_hit_rate, optimal_fanout, optimal_miss_rate, outcome_probs)


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        bounds = (-1,) + cuts + (total + parts - 1,)
        yield [bounds[i + 1] - bounds[i] - 1 for i in range(parts)]


@pytest.mark.parametrize("budget, k, a, r, c", [
    (6, 2, 0.8, 1.0, 0.5), (8, 3, 0.6, 0.5, 0.3), (7, 3, 0.9, 2.0, 0.5), (5, 3, 0.4, 1.0, 0.9),
    (3, 3, 0.7, 1.0, 0.5), (8, 1, 0.5, 0.7, 1.0), (0, 2, 0.5, 1.0, 0.5), (8, 3, 0.95, 0.3, 0.8),
])
def test_integer_fanout_equals_the_brute_force_optimum(budget, k, a, r, c):
    fanout = optimal_fanout(budget, k, a, r, c)
    assert len(fanout) == k + 1 and sum(fanout) == budget and min(fanout) >= 0
    best = max(expected_hit_rate(f, a, r, c) for f in _compositions(budget, k + 1))
    assert expected_hit_rate(fanout, a, r, c) == pytest.approx(best, abs=1e-12)


def test_outcome_probabilities_sum_to_one():
    assert sum(outcome_probs(7, 0.8)) == pytest.approx(1.0)
    assert outcome_probs(2, 0.5) == [0.5, 0.25, 0.25]


def test_continuous_fanout_matches_the_section_7_example():
    f = continuous_fanout(24, 7, 0.8, 1.0)
    assert [round(x, 1) for x in f] == [3.9, 3.5, 3.1, 2.8, 2.5, 2.2, 2.0, 4.0]
    assert sum(f) == pytest.approx(24)
    rho = 0.8**0.5
    assert f[3] / f[2] == pytest.approx(rho) and f[7] / f[6] == pytest.approx(rho / 0.2**0.5)
    assert optimal_miss_rate(24, 7, 0.8, 1.0, c=1.0) == pytest.approx(0.316, abs=5e-4)
    # The formula is the model's miss rate at the continuous optimum, below uniform's (8/24)^r.
    direct = sum(pi * x**-1.0 for pi, x in zip(outcome_probs(7, 0.8), f))
    assert direct == pytest.approx(optimal_miss_rate(24, 7, 0.8, 1.0, c=1.0))
    assert direct < 8 / 24


def test_integer_fanout_is_close_to_the_continuous_one_for_a_large_budget():
    f = optimal_fanout(240, 7, 0.8, 1.0)
    assert np.abs(np.array(f) - np.array(continuous_fanout(240, 7, 0.8, 1.0))).max() <= 1.0


@pytest.mark.parametrize("args, field", [
    ((-1, 3, 0.5, 1.0), "budget"), ((4, -1, 0.5, 1.0), "k"), ((4, 3, 1.5, 1.0), "a"),
    ((4, 3, 0.5, 0.0), "r"), ((4, 3, 0.5, 1.0, 0.0), "c"), ((4.0, 3, 0.5, 1.0), "budget"),
])
def test_bad_model_parameters(args, field):
    with pytest.raises(ValueError, match=field):
        optimal_fanout(*args)


def _geometric_rounds(a: float, k: int, rounds: int, seed: int):
    rng = np.random.default_rng(seed)
    passes = rng.random((rounds, k)) < a
    accepted = np.cumprod(passes, axis=1).sum(axis=1)
    return accepted, np.full(rounds, k)


def test_acceptance_estimator_finds_a_where_accepted_over_proposed_does_not():
    est = AcceptanceEstimator(prior=0.3)
    assert est.value == pytest.approx(0.3)
    for chunk in range(20):
        accepted, proposed = _geometric_rounds(0.8, 5, 500, seed=chunk)
        est.update(torch.from_numpy(accepted), torch.from_numpy(proposed))
    assert est.value == pytest.approx(0.8, abs=0.01)
    naive = accepted.sum() / proposed.sum()
    assert naive < 0.7  # the naive ratio is biased low
    with pytest.raises(ValueError):
        est.update([3], [2])


def test_acceptance_estimator_tracks_a_change():
    est = AcceptanceEstimator(window=2000)
    for chunk in range(10):
        est.update(*_geometric_rounds(0.9, 4, 200, seed=chunk))
    for chunk in range(10, 40):
        est.update(*_geometric_rounds(0.5, 4, 200, seed=chunk))
    assert est.value == pytest.approx(0.5, abs=0.03)


def test_power_law_estimator_recovers_c_and_r():
    rng = np.random.default_rng(0)
    truth = PowerLaw(c=0.4, r=0.8)
    est = PowerLawEstimator()
    assert est.estimate() == est.prior
    for _ in range(20):
        fanout = rng.integers(0, 7, size=1000)
        miss_p = np.array([truth.miss(int(f)) for f in fanout])
        est.update(fanout, rng.random(1000) >= miss_p)
    fit = est.estimate()
    assert fit.c == pytest.approx(0.4, abs=0.03) and fit.r == pytest.approx(0.8, abs=0.08)


def test_power_law_estimator_with_a_single_fanout_keeps_the_prior_exponent():
    est = PowerLawEstimator(prior=PowerLaw(c=0.5, r=1.2))
    est.update(np.full(400, 3), np.arange(400) % 5 != 0)  # miss rate 0.2 at F = 3
    fit = est.estimate()
    assert fit.r == 1.2 and fit.c == pytest.approx(0.2 * 3**1.2, rel=0.05)

