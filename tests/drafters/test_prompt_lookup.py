"""Prompt lookup: the latest earlier match of the longest trailing n-gram, and what follows it."""

import pytest
import torch

from specdraft.drafters.base import DraftContext
from specdraft.drafters.ngram import NgramIndex
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.verify import SamplingParams


def ctx_of(rows: list[list[int]], width: int = 20) -> DraftContext:
    """A committed-token buffer with junk (99) past each row's length."""
    tokens = torch.full((len(rows), width), 99, dtype=torch.int64)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r)
    n = len(rows)
    return DraftContext(tokens, torch.tensor([len(r) for r in rows]), [SamplingParams()] * n, [None] * n)


def propose(rows, k, **kw):
    d = PromptLookupDrafter(**kw)
    return propose_with(d, d.new_state(len(rows), 32), rows, k)


def propose_with(d, state, rows, k):
    prop = d.propose(state, ctx_of(rows, width=max(map(len, rows)) + 1), k)
    assert prop.probs is None  # no distribution: verified by exact match
    return [prop.tokens[b, : int(prop.num_valid[b])].tolist() for b in range(len(rows))]


def test_longest_ngram_latest_match():
    # trailing 3-gram [1, 2, 3] occurs at 0 (followed by 9) and at 4 (followed by 7): the latest wins
    assert propose([[1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]], 2) == [[7, 1]]
    # [6, 1, 2] never occurred before, but [1, 2] did: fall back to the bigram
    assert propose([[1, 2, 8, 6, 1, 2]], 3) == [[8, 6, 1]]


def test_shorter_than_k_near_the_end_and_no_match():
    assert propose([[4, 5, 4]], 5) == [[5, 4]]  # only two tokens follow the match
    assert propose([[1, 2, 3, 4]], 3) == [[]]  # nothing to look up: propose nothing
    assert propose([[7]], 3) == [[]]


def test_rows_are_independent_and_ignore_the_buffer_past_their_length():
    rows = [[1, 2, 1], [3, 4, 5, 3, 4], [8, 9]]
    assert propose(rows, 2) == [[2, 1], [5, 3], []]


def test_min_ngram():
    assert propose([[5, 1, 2, 8, 2]], 2) == [[8, 2]]
    assert propose([[5, 1, 2, 8, 2]], 2, min_ngram=2) == [[]]


def test_bad_ngram_range():
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    assert PromptLookupDrafter().vocab_size is None


def test_proposals_are_classed_by_the_matched_length():
    d = PromptLookupDrafter()
    rows = [[1, 2, 3, 9, 1, 2, 3], [1, 2, 8, 6, 1, 2], [5, 1, 2, 8, 2], [1, 2, 3, 4]]
    prop = d.propose(d.new_state(4, 32), ctx_of(rows), 2)
    assert prop.bucket.tolist() == [3, 2, 1, 0]  # the trigram, the bigram, one token, no match
    assert prop.num_valid.tolist() == [2, 2, 2, 0]


def _reference(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """The definition, spelled out: longest n first, the latest earlier start with a successor."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if seq[i : i + n] == seq[L - n :]:
                return n, seq[i + n : i + n + k]
    return 0, []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_lookup_matches_the_definition_on_random_contexts(max_ngram, min_ngram):
    g = torch.Generator().manual_seed(max_ngram * 10 + min_ngram)
    d = PromptLookupDrafter(max_ngram, min_ngram)
    for _ in range(300):
        seq = torch.randint(
            0,
            int(torch.randint(2, 6, (1,), generator=g)),
            (int(torch.randint(1, 50, (1,), generator=g)),),
            generator=g,
        )
        assert d.lookup(NgramIndex.of(seq.tolist(), max_ngram), 4) == _reference(
            seq.tolist(), 4, max_ngram, min_ngram
        )


def test_the_state_follows_growing_dropped_and_joining_rows():
    """The per-row indexes are brought up to the committed tokens at each proposal: the proposals
    equal the definition's at every step while rows grow by 1-4 tokens, leave and join."""
    g = torch.Generator().manual_seed(7)
    d = PromptLookupDrafter()

    def grow(row: list[int], n: int) -> list[int]:
        return row + torch.randint(0, 4, (n,), generator=g).tolist()

    rows = [grow([], 5) for _ in range(3)]
    state = d.new_state(3, 64)
    for step in range(30):
        assert propose_with(d, state, rows, 3) == [_reference(r, 3, 3, 1)[1] for r in rows]
        rows = [grow(r, int(torch.randint(1, 5, (1,), generator=g))) for r in rows]
        if step == 10:  # the middle row leaves
            state.select_rows(torch.tensor([0, 2]))
            rows = [rows[0], rows[2]]
        if step == 20:  # two rows join
            state.append(d.new_state(2, 64))
            rows += [grow([], 9), grow([], 2)]
