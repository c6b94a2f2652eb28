"""The analytic throughput model: Leviathan et al.'s expected tokens and its inverse, best k."""

import pytest
import torch

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
    def t_target(n):
        return 0.03 + 0.002 * (n - 1)

    assert analytic.step_time(3, 0.005, t_target) == pytest.approx(3 * 0.005 + 0.036)
    assert analytic.speedup(0.8, 0, 0.005, t_target) == pytest.approx(1.0)
    tp = analytic.throughput(0.8, 4, 0.005, t_target)
    assert tp == pytest.approx(analytic.expected_tokens(0.8, 4) / (4 * 0.005 + 0.038))
    best = analytic.best_k(0.8, 0.005, t_target, 10)
    best_rate = analytic.throughput(0.8, best, 0.005, t_target)
    assert all(best_rate >= analytic.throughput(0.8, k, 0.005, t_target) for k in range(11))
    assert best >= 3
    assert analytic.best_k(0.1, 0.03, t_target, 10) == 0  # speculation does not pay
    assert analytic.best_k(1.0, 0.0, lambda n: 0.03, 6) == 6  # free, perfect draft: draft the most


def test_alpha_needed_is_the_least_acceptance_that_reaches_the_speedup():
    def t_target(n):  # relative to a 1-token step
        return 1.0 + 0.05 * (n - 1)

    alpha, k = analytic.alpha_needed(2.0, 0.13, t_target, k_max=8)
    assert analytic.speedup(alpha, k, 0.13, t_target) >= 2.0 - 1e-6
    below = alpha - 1e-3
    assert all(analytic.speedup(below, j, 0.13, t_target) < 2.0 for j in range(1, 9))
    assert 0 < analytic.alpha_needed(1.0, 0.13, t_target)[0] < alpha  # breaking even asks for less
    assert analytic.alpha_needed(10.0, 0.13, t_target, k_max=4) is None  # at most 5 tokens per step


def test_interp_between_and_beyond_the_measured_points():
    pts = {1: 1.0, 3: 3.0, 5: 4.0}
    assert analytic.interp(pts, 3) == 3.0
    assert analytic.interp(pts, 2) == pytest.approx(2.0) and analytic.interp(pts, 4) == pytest.approx(3.5)
    assert analytic.interp(pts, 7, "linear") == pytest.approx(5.0)  # the last segment's slope
    assert analytic.interp(pts, 0, "linear") == pytest.approx(0.0)  # the first segment's
    assert analytic.interp(pts, 7) == 4.0 and analytic.interp(pts, 0) == 1.0  # clamped
    assert analytic.interp({2: 0.5}, 9, "linear") == 0.5  # one point: flat
    with pytest.raises(ValueError):
        analytic.interp({}, 1)
    with pytest.raises(ValueError):
        analytic.interp(pts, 1, "cubic")


def test_latency_curve_reads_n_then_batch():
    curve = analytic.LatencyCurve({1: {1: 0.010, 3: 0.014}, 4: {1: 0.020, 3: 0.032}})
    assert curve.time(1) == 0.010 and curve.time(2) == pytest.approx(0.012)
    assert curve.time(5) == pytest.approx(0.018)  # linear beyond the measured n
    assert curve.time(2, batch=4) == pytest.approx(0.026)
    # batch 2 is a third of the way from 1 to 4: T = 2/3 T_1(n) + 1/3 T_4(n)
    assert curve.time(3, batch=2) == pytest.approx(2 / 3 * 0.014 + 1 / 3 * 0.032)
    assert curve.time(1, batch=8) == 0.020  # clamped to the largest measured batch
    flat = analytic.LatencyCurve(curve.points, beyond="flat")
    assert flat.time(5) == 0.014 and flat.time(2) == curve.time(2)
    falling = analytic.LatencyCurve({1: {1: 0.010, 2: 0.005}})
    assert falling.time(9) == analytic.MIN_SECONDS  # extrapolated below zero: floored
    with pytest.raises(ValueError):
        analytic.LatencyCurve({}).time(1)
    with pytest.raises(ValueError):
        analytic.LatencyCurve(curve.points, beyond="cubic")


def test_latency_curve_round_trips_through_json():
    import json

    curve = analytic.LatencyCurve({1: {1: 0.01, 2: 0.0125}, 2: {1: 0.02}})
    back = analytic.LatencyCurve.from_dict(json.loads(json.dumps(curve.to_dict())))
    assert back == curve and back.time(2, 2) == curve.time(2, 2)


def test_best_k_from_rates_is_the_argmax_of_the_two_formulas():
    """The one-pass choice equals max over k of expected_tokens_from_rates / step_time, ties to the
    smaller k, for chain and block drafters (random rates and step times)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        rates = torch.rand(8, generator=g).tolist()
        times = (0.01 + torch.rand(9, generator=g).sort().values * 0.02).tolist()
        t_draft = float(torch.rand(1, generator=g)) * 0.003
        for calls in (None, lambda k: min(k, 1)):

            def rate(k, rates=rates, times=times, t_draft=t_draft, calls=calls):
                c = None if calls is None else calls(k)
                tokens = analytic.expected_tokens_from_rates(rates, k)
                return tokens / analytic.step_time(k, t_draft, lambda n: times[n - 1], c)

            assert analytic.best_k_from_rates(rates, t_draft, times, calls) == max(range(9), key=rate)
    assert analytic.best_k_from_rates([1.0, 1.0], 0.0, [1.0, 2.0, 3.0]) == 0  # a tie: the smaller k
