"""SpecStats: counters, per-position acceptance, mean accepted length with the bonus token."""

import pytest
import torch

from specdraft.stats import SpecStats


def test_observe_counts_per_position_and_bonus():
    s = SpecStats()
    s.observe(torch.tensor([3, 3]), torch.tensor([3, 1]), torch.tensor([4, 2]))
    s.observe(torch.tensor([2, 0]), torch.tensor([0, 0]), torch.tensor([1, 1]))  # row 1 proposed nothing
    assert (s.steps, s.target_forwards, s.drafted, s.accepted, s.generated) == (4, 2, 8, 4, 8)
    assert s.drafted_per_position == [3, 3, 2] and s.accepted_per_position == [2, 1, 1]
    assert s.per_position_acceptance() == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert s.mean_accepted_length == (4 + 4) / 4  # accepted plus one recovered/bonus per row-step
    assert s.acceptance_rate == 0.5
    assert s.k_history == [3, 2]


def test_plain_decoding_is_one():
    s = SpecStats()
    for _ in range(5):
        s.observe(
            torch.zeros(3, dtype=torch.int64),
            torch.zeros(3, dtype=torch.int64),
            torch.ones(3, dtype=torch.int64),
        )
    assert s.mean_accepted_length == 1.0 and s.acceptance_rate == 0.0 and s.per_position_acceptance() == []


def test_empty_stats_do_not_divide_by_zero():
    s = SpecStats()
    assert s.mean_accepted_length == 0.0 and s.acceptance_rate == 0.0 and s.tokens_per_s == 0.0
    assert s.decode_tokens_per_s == 0.0
    assert "generated 0 tokens" in s.summary()


def test_merge_and_rates():
    a, b = SpecStats(), SpecStats()
    a.observe(torch.tensor([2]), torch.tensor([2]), torch.tensor([3]))
    b.observe(torch.tensor([4]), torch.tensor([1]), torch.tensor([2]))
    a.total_time, a.prefill_time, b.total_time = 1.0, 0.5, 1.5
    a.merge(b)
    assert (a.steps, a.drafted, a.accepted, a.generated) == (2, 6, 3, 5)
    assert a.drafted_per_position == [2, 2, 1, 1] and a.accepted_per_position == [2, 1, 0, 0]
    assert a.tokens_per_s == pytest.approx(5 / 2.5) and a.decode_tokens_per_s == pytest.approx(5 / 2.0)
    d = a.as_dict()
    assert d["mean_accepted_length"] == 2.5 and d["acceptance_rate"] == 0.5
    assert d["per_position_acceptance"] == [1.0, 0.5, 0.0, 0.0]
    text = a.summary()
    assert (
        "mean accepted length 2.50 (bonus token included)" in text and "acceptance per draft position" in text
    )
