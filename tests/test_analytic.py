"""The analytic throughput model: Leviathan et al.'s expected tokens and its inverse, best k."""

import pytest

from specdraft import analytic


def test_expected_tokens():
    assert analytic.expected_tokens(0.0, 5) == 1.0  # only the recovered token
    assert analytic.expected_tokens(1.0, 5) == 6.0  # k accepted + bonus
    assert analytic.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert analytic.expected_tokens(0.7, 0) == 1.0


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.9])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_alpha_from_mean_accepted_inverts(alpha, k):
    m = analytic.expected_tokens(alpha, k)
    assert analytic.alpha_from_mean_accepted(m, k) == pytest.approx(alpha, abs=1e-4)


def test_alpha_edges():
    assert analytic.alpha_from_mean_accepted(1.0, 4) == 0.0
    assert analytic.alpha_from_mean_accepted(5.0, 4) == 1.0
    assert analytic.alpha_from_mean_accepted(3.0, 0) == 0.0


def test_throughput_speedup_best_k():
    t_target = lambda n: 0.03 + 0.002 * (n - 1)
    assert analytic.step_time(3, 0.005, t_target) == pytest.approx(3 * 0.005 + 0.036)
    assert analytic.speedup(0.8, 0, 0.005, t_target) == pytest.approx(1.0)
    tp = analytic.throughput(0.8, 4, 0.005, t_target)
    assert tp == pytest.approx(analytic.expected_tokens(0.8, 4) / (4 * 0.005 + 0.038))
    best = analytic.best_k(0.8, 0.005, t_target, 10)
    assert all(analytic.throughput(0.8, best, 0.005, t_target) >= analytic.throughput(0.8, k, 0.005, t_target) for k in range(11))
    assert best >= 3
    assert analytic.best_k(0.1, 0.03, t_target, 10) == 0  # speculation does not pay
    assert analytic.best_k(1.0, 0.0, lambda n: 0.03, 6) == 6  # free, perfect draft: draft the most


def test_alpha_needed_is_the_least_acceptance_that_reaches_the_speedup():
    t_target = lambda n: 1.0 + 0.05 * (n - 1)  # relative to a 1-token step
    alpha, k = analytic.alpha_needed(2.0, 0.13, t_target, k_max=8)
    assert analytic.speedup(alpha, k, 0.13, t_target) >= 2.0 - 1e-6
    below = alpha - 1e-3
    assert all(analytic.speedup(below, j, 0.13, t_target) < 2.0 for j in range(1, 9))
    assert 0 < analytic.alpha_needed(1.0, 0.13, t_target)[0] < alpha  # breaking even asks for less
    assert analytic.alpha_needed(10.0, 0.13, t_target, k_max=4) is None  # at most 5 tokens per step
