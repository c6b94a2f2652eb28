"""Token trees from a model draft's top-k (static and EAGLE-2 dynamic shapes): the shapes, the
rerank, the draft's tree forward, its cache across steps, and greedy output identical to plain."""

import pytest
import torch

from specdraft.drafters.base import DraftContext
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.topk_tree import TopKTreeDrafter, TreeShape
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime
from specdraft.models.subset_head import SubsetHeadRuntime
from specdraft.models.tiny import tiny_llama
from specdraft.policy import FixedK
from specdraft.registry import DraftSpec, Target, build_drafter
from specdraft.tree import TokenTree, most_probable
from specdraft.verify import SamplingParams
from tests.helpers import compact, decode, head_subset, plain_greedy, random_prompts

DYN, STATIC = TreeShape(True, 2, 2), TreeShape(False, 2, 1, 2)


def context(prompts: list[list[int]], params=None) -> DraftContext:
    buf = torch.zeros(len(prompts), 64, dtype=torch.int64)
    for b, p in enumerate(prompts):
        buf[b, : len(p)] = torch.tensor(p)
    params = params or [SamplingParams()] * len(prompts)
    return DraftContext(buf, torch.tensor([len(p) for p in prompts]), params, [None] * len(prompts))


def path_logprob(runtime, prompt: list[int], path: list[int]) -> float:
    """The draft's cumulative log-probability of ``path`` after ``prompt``, one causal forward."""
    seq = torch.tensor([prompt + path])
    T = seq.shape[1]
    logp = (
        runtime.forward(runtime.new_state(1, T), seq, torch.arange(T).unsqueeze(0)).logits[0].log_softmax(-1)
    )
    return float(sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(path)))


def test_most_probable_keeps_the_budget_with_ancestors_and_never_minus_inf():
    scores = torch.tensor([[-0.1, -0.5, -0.3, -0.3, float("-inf")], [-1.0, -1.0, -1.0, -2.0, -0.5]])
    assert most_probable(scores, 3).tolist() == [
        [True, False, True, True, False],
        [True, True, False, False, True],  # ties: the earlier candidate (an ancestor comes first)
    ]
    assert most_probable(scores[:1], 9).tolist() == [[True, True, True, True, False]]


def test_from_candidates_renumbers_and_refuses_an_orphan():
    tokens, parents = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 1, 2])
    tree = TokenTree.from_candidates(tokens, parents, torch.tensor([True, False, True, False, True]), "model")
    assert tree.tokens.tolist() == [5, 7, 9] and tree.parents.tolist() == [-1, 0, 1]
    assert tree.sources == ("model",) * 3 and tree.draft_probs is None
    with pytest.raises(SpecdraftError, match="parent is not kept"):
        TokenTree.from_candidates(tokens, parents, torch.tensor([False, False, True, False, False]))


def test_static_shape_is_the_greedy_chain_with_siblings_at_the_first_depths(tiny):
    prompts = random_prompts([4, 9], seed=3)
    drafter = TopKTreeDrafter(ModelDrafter(tiny.other, "other"), TreeShape(False, 3, 1, 2), "t")
    for k, depth, siblings in ((1, 1, 0), (3, 3, 0), (4, 2, 2), (7, 3, 4), (12, 8, 4)):
        shape = drafter.shape
        assert (shape.depth(k), (shape.branch - 1) * shape.sibling_depths(k)) == (depth, siblings)
        prop = drafter.propose(drafter.new_state(2, 64), context(prompts), k)
        for b, tree in enumerate(prop.trees):
            chain = plain_greedy(tiny.other, prompts[b], depth)  # the draft's own greedy chain
            assert tree.num_nodes == depth + siblings <= k
            assert tree.tokens[tree.children[-1][0]] == chain[0]
            main = [i for i in range(tree.num_nodes) if tree.children.get(i) or tree.depth[i] == depth]
            assert tree.tokens[main].tolist() == chain  # the chain, each node's first child
            kids = [len(tree.children.get(i, [])) for i in [-1, *main[:-1]]]
            assert kids == [3] * (siblings // 2) + [1] * (depth - siblings // 2)


def test_dynamic_tree_keeps_the_k_most_probable_paths_scored_by_the_tree_forward(tiny):
    """Every candidate's score (from the draft's tree forward: masks, slots, positions) equals the
    path's log-probability from a plain causal forward, and the kept nodes are the top k."""
    prompts = random_prompts([5, 11], seed=4)
    drafter = TopKTreeDrafter(ModelDrafter(tiny.other, "other"), TreeShape(True, 3, 3), "t")
    state, ctx = drafter.new_state(2, 64), context(prompts)
    grown = drafter.grow(state, drafter.root(state, ctx), 4)
    assert grown.tokens.shape == (2, 3 + 3 * 9)  # depth 1: 3, then 3 expanded x 3 children
    for b in range(2):
        tree = TokenTree(grown.tokens[b], grown.parents[b])
        for i in range(tree.num_nodes):
            path = tree.tokens[tree.ancestors[i]].tolist()
            want = path_logprob(tiny.other, prompts[b], path)
            assert grown.scores[b, i].item() == pytest.approx(want, abs=1e-4)
    keep = most_probable(grown.scores, 6)
    prop = drafter.propose(drafter.new_state(2, 64), ctx, 6)
    for b, tree in enumerate(prop.trees):
        assert tree.num_nodes == 6 and tree.tokens.tolist() == grown.tokens[b][keep[b]].tolist()
        assert int(tree.depth.max()) >= 2  # the rerank went below depth 1


class Forgetful(TopKTreeDrafter):
    """Never keeps its cache past the committed prefix: re-feeds everything each step."""

    def observe(self, state, num_accepted, verified=None):
        pass


class Recording:
    def __init__(self, inner):
        self.inner, self.trees, self.kept = inner, [], 0
        self.name, self.vocab_size, self.proposes_trees = inner.name, inner.vocab_size, True

    def new_state(self, batch_size, capacity):
        return self.inner.new_state(batch_size, capacity)

    def propose(self, state, ctx, k):
        self.kept += int((state.fed > state.base).sum())  # the last step's observe kept a path
        prop = self.inner.propose(state, ctx, k)
        self.trees.append([(t.tokens.tolist(), t.parents.tolist()) for t in prop.trees])
        return prop

    def observe(self, state, num_accepted, verified=None):
        self.inner.observe(state, num_accepted, verified)


@pytest.mark.parametrize("shape", [DYN, STATIC], ids=["dyn", "static"])
def test_kept_draft_cache_proposes_what_a_fresh_one_does(tiny, shape):
    prompts = random_prompts([6, 3, 10], seed=5)
    runs = []
    for cls in (TopKTreeDrafter, Forgetful):
        rec = Recording(cls(ModelDrafter(LlamaRuntime(tiny.target.w, [0]), "prune:0"), shape, "t"))
        decode(Engine(tiny.target, rec, FixedK(5)), prompts, 20)
        runs.append(rec)
    assert runs[0].trees == runs[1].trees
    assert runs[0].kept > 0 and runs[1].kept == 0


@pytest.mark.parametrize("shape", [DYN, TreeShape(True, 3, 3), STATIC, TreeShape(False, 3, 1, 3)])
def test_greedy_output_identical_to_plain(tiny, shape):
    prompts = random_prompts([5, 9, 3], seed=6)
    refs = [plain_greedy(tiny.target, p, 24) for p in prompts]
    for draft in (LlamaRuntime(tiny.target.w, [0]), tiny.other):
        engine = Engine(tiny.target, TopKTreeDrafter(ModelDrafter(draft, "d"), shape, "t"), FixedK(6))
        assert decode(engine, prompts, 24) == refs
        assert engine.stats.drafted > 0
    assert engine.stats.accepted == 0  # the unrelated draft: nothing accepted, still identical


@pytest.mark.parametrize("shape", [DYN, STATIC], ids=["dyn", "static"])
def test_a_subset_head_never_proposes_tokens_outside_it(tiny, shape):
    """A designed draft's head may cover a few tokens: the draft's other top tokens are -inf, never nodes."""
    head = head_subset(1, seed=2)  # top-2 always reaches outside a one-token head
    w = compact(tiny_llama(seed=1)).w
    w.lm_head = w.lm_head[head].contiguous()  # (1, C)
    draft = SubsetHeadRuntime(LlamaRuntime(w), head, 256)
    drafter = TopKTreeDrafter(ModelDrafter(draft, "subset"), shape, "t")
    prompts = random_prompts([4, 7], seed=7)
    prop = drafter.propose(drafter.new_state(2, 64), context(prompts), 4)
    for tree in prop.trees:
        assert tree.num_nodes >= 1 and set(tree.tokens.tolist()) == set(head.tolist())
        assert all(len(kids) == 1 for kids in tree.children.values())  # one token per depth: a chain
    engine = Engine(tiny.target, drafter, FixedK(4))
    assert decode(engine, prompts, 12) == [plain_greedy(tiny.target, p, 12) for p in prompts]


def test_specs_build_trees_over_model_drafts_and_refuse_others(tiny):
    target = Target(loaded=None, runtime=tiny.target, dtype=torch.float32)
    drafter = build_drafter("tree:static=3x1,prune:0", target)
    assert isinstance(drafter, TopKTreeDrafter) and drafter.shape == TreeShape(False, 3, 1, 1)
    assert drafter.name == "tree:static=3x1,prune:0"
    assert build_drafter("tree:self", target).shape == DYN
    assert str(DraftSpec.parse("tree:designed:smollm2-135m-l2")) == "tree:dyn=2,designed:smollm2-135m-l2"
    for bad in ("tree:lookup", "tree:dyn=1,self", "tree:static=2,self", "tree:", "tree:tree:self"):
        with pytest.raises(SpecdraftError):
            DraftSpec.parse(bad)
