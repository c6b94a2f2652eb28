"""The smaller head's token subset: most frequent first, required ids kept, coverage measured."""

import pytest
import torch

from specdraft.design.vocab import token_counts, top_tokens
from specdraft.errors import SpecdraftError


def test_most_frequent_first_ties_by_id():
    counts = token_counts(torch.tensor([5, 5, 5, 2, 2, 7, 7, 1]), vocab_size=10)
    sub = top_tokens(counts, 3)
    assert sub.token_ids.tolist() == [5, 2, 7]  # 2 and 7 tie: lower id first
    assert sub.coverage == pytest.approx(7 / 8)


def test_required_ids_are_added():
    counts = token_counts(torch.tensor([3, 3, 4]), vocab_size=10)
    sub = top_tokens(counts, 1, always=(9, 3))
    assert sub.token_ids.tolist() == [3, 9]
    assert len(sub) == 2


def test_bad_size_is_a_clear_error():
    with pytest.raises(SpecdraftError, match="head size"):
        top_tokens(torch.zeros(10), 0)
    with pytest.raises(SpecdraftError, match="head size"):
        top_tokens(torch.zeros(10), 11)


def test_secondary_counts_break_ties_among_unseen_ids():
    counts = token_counts(torch.tensor([4, 4, 6]), vocab_size=8)
    secondary = torch.tensor([0, 0, 5, 1, 0, 0, 0, 9])
    sub = top_tokens(counts, 4, secondary=secondary)
    assert sub.token_ids.tolist() == [4, 6, 7, 2]  # answers first, then the prompts' most frequent
