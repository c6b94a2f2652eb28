"""The suffix (history) drafter: its n-gram index, the frequency tree, proposals, the opt-in
history of earlier requests, the spec, and greedy output equal to plain decoding (tree and chain;
its sampling TV check is a case of tests/test_tv_all_drafters.py)."""

import pytest
import torch

from specdraft import api
from specdraft.drafters import suffix
from specdraft.drafters.base import DraftContext
from specdraft.drafters.ngram import SEP, NgramIndex
from specdraft.drafters.suffix import SuffixDrafter, first_path, frequency_tree
from specdraft.errors import SpecdraftError
from specdraft.registry import DraftSpec
from specdraft.verify import SamplingParams
from tests.helpers import random_prompts


def test_index_matches_the_longest_earlier_suffix():
    index = NgramIndex(max_n=4)
    index.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    # "1 2 3" ended at 2 (followed by 9); its end at 9 is the context's own end, not a match
    assert index.match(index.tokens, max_occurrences=8) == (3, [2])
    assert index.match([5, 2, 3], max_occurrences=8) == (2, [5, 2])  # latest first
    assert index.match([5, 2, 3], max_occurrences=1) == (2, [5])
    assert index.match([8], max_occurrences=8) == (0, [])
    assert index.continuations([2, 5], depth=3) == [[9, 2, 3], [7, 1, 2]]


def test_index_never_spans_a_request_separator_and_stays_bounded():
    index = NgramIndex(max_n=3, max_tokens=8)
    index.extend([1, 2, SEP, 2, 5])
    assert (SEP, 2) not in index.ends and (2, SEP) not in index.ends
    assert index.match([1, 2], 8) == (1, [3])  # "1 2" and the first "2" are followed by the separator
    assert index.continuations([1, 3], depth=4) == [[], [5]]
    index.extend(range(10, 20))
    assert len(index.tokens) <= 8 and index.match([18], 8) == (1, [len(index.tokens) - 2])


def test_frequency_tree_takes_the_likeliest_nodes_best_first():
    conts = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]  # P: 1 .75, 1-2 .5, 6 / 1-5 / 1-2-3 / 1-2-4 .25
    tree = frequency_tree(conts, k=10, min_prob=0.1)
    assert tree.tokens.tolist() == [1, 2, 6, 5, 3, 4]  # ties: shallower, then earlier in conts
    assert tree.parents.tolist() == [-1, 0, -1, 0, 1, 1]
    assert tree.tokens[first_path(tree)].tolist() == [1, 2, 3]
    assert frequency_tree(conts, k=3, min_prob=0.1).tokens.tolist() == [1, 2, 6]
    assert frequency_tree(conts, k=10, min_prob=0.3).tokens.tolist() == [1, 2]
    assert frequency_tree([], k=4, min_prob=0.1).num_nodes == 0
    assert frequency_tree(conts, k=10, min_prob=0.1, branch=False).tokens.tolist() == [1, 2, 3]


def _propose(drafter, rows: list[list[int]], k: int, state=None):
    L = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (L - len(r)) for r in rows])
    B = len(rows)
    ctx = DraftContext(tokens, torch.tensor([len(r) for r in rows]), [SamplingParams()] * B, [None] * B)
    state = state if state is not None else drafter.new_state(B, L + k)
    return drafter.propose(state, ctx, k), state


def test_proposes_the_frequent_continuations_as_a_tree_and_their_path_as_tokens():
    # after "1 2": "3 4 0 1" (latest), "5 1 2 3", "3 4 1 2": 3 and 3 4 twice, the rest once (ties:
    # shallower first, then the latest). Row 2 has no repeated suffix
    prop, _ = _propose(SuffixDrafter(), [[1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 0, 1, 2], [7, 8, 9]], k=5)
    tree = prop.trees[0]
    assert tree.tokens.tolist() == [3, 4, 5, 1, 0] and tree.parents.tolist() == [-1, 0, -1, 2, 1]
    assert prop.tokens[0, :3].tolist() == [3, 4, 0] and prop.bucket.tolist() == [2, 0]
    assert prop.trees[1] is None and prop.num_valid[1] == 0
    chain, _ = _propose(SuffixDrafter(tree=False), [[1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 0, 1, 2]], k=4)
    assert chain.trees is None and chain.tokens[0].tolist() == [3, 4, 0, 1]  # k tokens, no branch


def test_shared_history_lets_a_later_request_match_an_earlier_output():
    suffix._HISTORY.pop(3, None)  # a fresh process-wide history
    drafter = SuffixDrafter(max_n=3, shared=True)
    _, state = _propose(drafter, [[1, 2], [3, 4]], k=2)
    # row 0 goes on to output 6 7 8, then leaves: its output reaches the history
    _propose(drafter, [[1, 2, 6, 7, 8], [3, 4, 9]], k=2, state=state)
    state.select_rows(torch.tensor([1]))
    fresh, _ = _propose(drafter, [[5, 6, 7]], k=2)
    assert fresh.tokens[0, : int(fresh.num_valid[0])].tolist() == [8]  # "6 7" was followed by 8
    assert drafter.history.tokens == [SEP, 6, 7, 8]  # the output as the drafter first saw it
    alone, _ = _propose(SuffixDrafter(max_n=3), [[5, 6, 7]], k=2)
    assert alone.trees[0] is None


def test_spec_and_greedy_output_equals_plain_decoding():
    assert DraftSpec.parse("suffix:4,shared").kind == "suffix"
    for bad in ("suffix:0", "suffix:x", "suffix:4,global"):
        with pytest.raises(SpecdraftError, match="bad draft spec"):
            DraftSpec.parse(bad)
    prompts = [p * 3 for p in random_prompts([4, 7, 5], seed=2)]  # repeated text to match
    for spec in ("suffix", "suffix:4,chain"):
        pipe = api.load("tiny", draft=spec, dtype="fp32")
        assert isinstance(pipe.drafter, SuffixDrafter)
        spec_tokens, stats = api.run_batch(pipe, prompts, max_new_tokens=24, k=4)
        plain_tokens, _ = api.run_batch(pipe, prompts, max_new_tokens=24, k=0)
        assert spec_tokens == plain_tokens
        assert stats.accepted > 0
