"""The lookup tree: several prompt-lookup matches merged into one trie within k nodes, and greedy
decoding through it identical to plain decoding."""

from specdraft.drafters.lookup_tree import LookupTreeDrafter
from specdraft.drafters.ngram import NgramIndex
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine
from specdraft.policy import FixedK
from tests.drafters.test_prompt_lookup import ctx_of
from tests.helpers import decode, plain_greedy


def paths(tree) -> list[list[int]]:
    """Every root-to-leaf token path of a tree."""
    parents = tree.parents.tolist()
    leaves = [i for i in range(tree.num_nodes) if i not in parents]
    return [tree.tokens[tree.ancestors[i]].tolist() for i in leaves]


def test_candidates_longest_ngram_first_then_most_recent():
    seq = NgramIndex.of([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3])
    d = LookupTreeDrafter(per_ngram=2)
    # 3-gram [1, 2, 3]: latest at 4 (-> 7 5), then 0 (-> 9 1); 2-gram [2, 3] adds 9 (-> 8 1);
    # the 1-gram [3] adds nothing new
    assert d.candidates(seq, 2) == [[7, 5], [9, 1], [8, 1]]


def test_tree_within_the_budget_and_prompt_lookup_on_its_main_branch():
    seq = NgramIndex.of([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3])
    d = LookupTreeDrafter()
    for k in (1, 2, 3, 5, 8):
        tree = d.tree(seq, k)
        assert tree.num_nodes <= k
        assert set(tree.sources) == {"lookup"}
        best = PromptLookupDrafter().lookup(seq, k)[1]
        assert paths(tree)[0] == best[: k - (tree.num_nodes - len(paths(tree)[0]))]
    # the others take up to k // 2 nodes, the i-th at most k >> (i + 1) deep; the best the rest
    assert paths(d.tree(seq, 8)) == [[7, 5, 2, 3, 8], [9, 1], [8]]
    assert paths(d.tree(seq, 2)) == [[7], [9]]
    assert paths(d.tree(NgramIndex.of([1, 2, 3, 9, 5, 6, 1, 2, 3]), 4)) == [[9, 5, 6, 1]]  # one candidate
    assert d.tree(NgramIndex.of([1, 2, 3, 4]), 5) is None  # no match: nothing to propose


def test_propose_one_tree_per_row():
    d = LookupTreeDrafter()
    prop = d.propose(d.new_state(2, 32), ctx_of([[4, 5, 6, 4, 5], [1, 2, 3]]), 4)
    assert prop.tokens.shape == (2, 0)
    assert paths(prop.trees[0]) == [[6, 4, 5]] and prop.trees[1] is None


def test_greedy_output_identical_to_plain(tiny):
    # repetitive prompts give the lookup matches, several of them per n-gram
    prompts = [[5, 6, 7, 8, 5, 6, 9, 5, 6, 7], [3, 4, 3, 4, 3, 1, 2, 3, 4], [9, 8, 7, 6, 9, 8, 7, 5, 9]]
    for batch in (prompts[:1], prompts):
        engine = Engine(tiny.target, LookupTreeDrafter(), FixedK(5))
        assert decode(engine, batch, 20) == [plain_greedy(tiny.target, p, 20) for p in batch]
        assert engine.stats.drafted > 0
