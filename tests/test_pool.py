"""The Ouroboros phrase pool: LRU bounds, phrases grown token by token, the target's corrected
phrase past a rejection (from a hand-made Verified), save / load and the opt-in shared pool."""

import pytest

from specdraft.drafters.base import Verified
from specdraft.errors import SpecdraftError
from specdraft.pool import PhrasePool, shared_pool


def test_phrases_most_recent_first_and_prefixes_merge():
    pool = PhrasePool(phrase_len=3)
    pool.add(1, [2, 3])
    pool.add(1, [4, 5, 6, 7])  # cut to phrase_len
    assert pool.get(1) == [(4, 5, 6), (2, 3)]
    pool.add(1, [2])  # a prefix of a stored phrase: refreshes it
    assert pool.get(1) == [(2, 3), (4, 5, 6)]
    pool.add(1, [2, 3, 9])  # extends a stored phrase: replaces it
    assert pool.get(1) == [(2, 3, 9), (4, 5, 6)]
    assert pool.get(8) == [] and len(pool) == 1 and pool.num_phrases == 2


def test_memory_is_bounded_least_recently_used_first():
    pool = PhrasePool(phrase_len=2, max_phrases=2, max_keys=2)
    for phrase in ([1], [2], [3]):
        pool.add(0, phrase)
    assert pool.get(0) == [(3,), (2,)]  # the oldest phrase went
    pool.add(5, [1])
    pool.get(0)  # key 0 used: key 5 is now the least recent
    pool.add(6, [1])
    assert pool.get(5) == [] and pool.get(0) and pool.get(6) and len(pool) == 2
    with pytest.raises(SpecdraftError, match=">= 1"):
        PhrasePool(max_phrases=0)


def test_text_added_token_by_token_equals_text_added_at_once():
    text = [1, 2, 3, 1, 2, 4, 5, 1, 2, 3, 6]
    whole, grown = PhrasePool(phrase_len=3), PhrasePool(phrase_len=3)
    whole.add_text(text)
    for L in range(1, len(text) + 1):
        grown.add_text(text[:L], start=L - 1)
    # the same phrases (their recency may differ: a growing phrase refreshes what it prefixes)
    assert {k: sorted(whole.get(k)) for k in range(7)} == {k: sorted(grown.get(k)) for k in range(7)}
    assert whole.get(2) == [(3, 6), (4, 5, 1), (3, 1, 2)]


def _verified(inputs, parents, target_next, committed) -> Verified:
    return Verified([inputs], [parents], [target_next], [committed])


def _add(pool: PhrasePool, v: Verified) -> list[int]:
    return pool.add_verified(v.inputs[0], v.parents[0], v.target_next[0], v.committed[0])


def test_verified_chain_keeps_the_targets_phrase_past_the_rejection():
    # fed [last=5, d1=7, d2=8, d3=9]; the target predicts 7 after 5 (accepted), 3 after 7 (8 rejected,
    # 3 recovered), 4 after the rejected 8 and 6 after 9: the refined phrase is 3 4 6
    v = _verified([5, 7, 8, 9], [-1, 0, 1, 2], [7, 3, 4, 6], [7, 3])
    pool = PhrasePool()
    assert _add(pool, v) == [3, 4, 6]
    assert pool.get(3) == [(4, 6)] and pool.get(4) == [(6,)] and pool.get(7) == []
    # every draft accepted: only the bonus token, nothing past a rejection
    assert _add(PhrasePool(), _verified([5, 7, 8], [-1, 0, 1], [7, 8, 2], [7, 8, 2])) == [2]


def test_verified_tree_follows_the_accepted_path_then_the_first_tried_branch():
    # root 5; nodes 7 (child of root), 2 (child of root), 8 and 1 (children of 7), 9 (child of 8)
    inputs, parents = [5, 7, 2, 8, 1, 9], [-1, 0, 0, 1, 1, 3]
    target_next = [7, 3, 0, 4, 0, 6]  # after 5: 7 accepted; after 7: 3, so 8 and 1 are rejected
    pool = PhrasePool()
    assert _add(pool, _verified(inputs, parents, target_next, [7, 3])) == [3, 4, 6]
    assert pool.get(3) == [(4, 6)]
    # committed text that is no path of the tree (a caller's mistake) teaches nothing
    assert _add(pool, _verified(inputs, parents, target_next, [2, 8, 3])) == []


def test_save_load_and_the_shared_pool(tmp_path):
    pool = PhrasePool(phrase_len=4)
    pool.add_text([1, 2, 3, 1, 4, 5])
    path = tmp_path / "pool.json"
    pool.save(path)
    loaded = PhrasePool(phrase_len=4).load(path)
    assert {k: loaded.get(k) for k in range(6)} == {k: pool.get(k) for k in range(6)}
    copy = loaded.copy()
    copy.add(1, [9])
    assert copy.get(1) == [(9,), *pool.get(1)] and loaded.get(1) == pool.get(1)  # independent
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecdraftError, match="cannot read phrase pool"):
        PhrasePool().load(tmp_path / "bad.json")
    warm = shared_pool("test-pool-warm", warm=path, phrase_len=4)
    assert warm is shared_pool("test-pool-warm") and warm.get(1) == pool.get(1)
    assert shared_pool("test-pool-other") is not warm
