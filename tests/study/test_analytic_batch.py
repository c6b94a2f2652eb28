"""The analytic model's batch extensions (specdraft.analytic)."""

from __future__ import annotations

import pytest

from specdraft import analytic


def t_target(b, n):
    return 0.010 + 0.002 * b * n


def t_draft(b, calls):
    return 0.001 * b * calls


def test_batch_step_time_and_throughput():
    assert analytic.batch_step_time(3, 2, t_draft, t_target) == pytest.approx(
        3 * 0.002 + 0.010 + 0.002 * 2 * 4
    )
    assert analytic.batch_step_time(3, 2, t_draft, t_target, draft_calls=1) == pytest.approx(
        0.002 + 0.010 + 0.016
    )
    assert analytic.batch_throughput(2.5, 3, 2, t_draft, t_target) == pytest.approx(
        2 * 2.5 / analytic.batch_step_time(3, 2, t_draft, t_target)
    )
    engine = analytic.batch_step_time(3, 2, t_draft, t_target, t_engine=lambda b: 0.0005 * b)
    assert engine == pytest.approx(analytic.batch_step_time(3, 2, t_draft, t_target) + 0.001)
    assert analytic.batch_step_time(0, 2, t_draft, t_target) == pytest.approx(0.010 + 0.004)  # no draft


def test_batch_one_with_expected_tokens_is_the_leviathan_model():
    alpha, k = 0.7, 4
    per_row = analytic.batch_throughput(analytic.expected_tokens(alpha, k), k, 1, t_draft, t_target)
    assert per_row == pytest.approx(analytic.throughput(alpha, k, t_draft(1, 1), lambda n: t_target(1, n)))


def test_relative_errors():
    assert analytic.relative_error(110, 100) == pytest.approx(0.1)
    assert analytic.relative_error(90, 100) == pytest.approx(0.1)
    assert analytic.median_relative_error([(110, 100), (100, 100), (150, 100)]) == pytest.approx(0.1)
    assert analytic.median_relative_error([(110, 100), (100, 100)]) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        analytic.relative_error(1, 0)
    with pytest.raises(ValueError):
        analytic.median_relative_error([])
