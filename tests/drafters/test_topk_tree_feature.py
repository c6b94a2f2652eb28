"""EAGLE-2 token trees from a feature draft (``tree:dyn|static,designed:FEATURE``): every candidate's
score from the draft's tree forward is its path's log-probability along the feature draft's own
chain; in the engine, each step's tree is the one a fresh drafter grows from the target's features
of the whole context (so the next real pairs follow the accepted path and no stale tree entry is
read); greedy output equals plain decoding; specs build it; the cost-aware policy sizes it."""

import dataclasses

import pytest
import torch

from specdraft import api
from specdraft.design.artifact import DraftMeta, save_draft
from specdraft.design.feature import FeatureDraftLM
from specdraft.design.prune import depth_prune
from specdraft.design.vocab import VocabSubset
from specdraft.drafters.base import DraftContext
from specdraft.drafters.dream import DreamDrafter, cross_weights
from specdraft.drafters.feature import FeatureDrafter
from specdraft.drafters.local import LocalHead
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.topk_tree import FeatureTreeDrafter, TopKTreeDrafter, TreeShape
from specdraft.engine import Engine, Request
from specdraft.errors import SpecdraftError
from specdraft.models.llama import LlamaRuntime
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights
from specdraft.policy import CostAwareK, FixedK
from specdraft.registry import DraftSpec
from specdraft.tree import TokenTree, most_probable
from specdraft.verify import SamplingParams
from tests.helpers import accepted_columns, decode, head_subset, kept_features, random_prompts

DYN, STATIC = TreeShape(True, 2, 2), TreeShape(False, 3, 1, 2)


def _model(tiny_pipe, head=None, seed=0) -> FeatureDraftLM:
    g = torch.Generator().manual_seed(seed)
    return FeatureDraftLM(
        depth_prune(tiny_pipe.target.model, [0]), head, fc=torch.randn(64, 128, generator=g) * 0.1
    )


def _feature(tiny_pipe, head=None, cls=FeatureDrafter, sharp=1.0, **kw) -> FeatureDrafter:
    """An untrained feature draft (``sharp``: its head scaled, a more confident draft)."""
    model = _model(tiny_pipe, head)
    w = draft_weights(model.draft, tiny_pipe.runtime.w, head, torch.float32)
    w.lm_head = w.lm_head * sharp
    rt = SubsetHeadRuntime(LlamaRuntime(w), head, 256) if head is not None else LlamaRuntime(w)
    return cls(rt, model.fc.weight.detach(), tiny_pipe.runtime.w.embed, "feature", **kw)


def _full_hidden(runtime, tokens: list[int]) -> torch.Tensor:
    """``(1, T, C)`` the target's final hidden states over ``tokens`` in one causal forward."""
    T = len(tokens)
    out = runtime.forward(
        runtime.new_state(1, T + 1), torch.tensor([tokens]), torch.arange(T).unsqueeze(0), hidden_layers=(-1,)
    )
    return out.hidden[-1]


def _fresh(drafter, runtime, tokens: list[int], start: int, capacity: int = 96):
    """A fresh one-row state and context whose real pairs are positions ``start .. L - 2`` with the
    target's features from a full forward (as after a prefill)."""
    L = len(tokens)
    state = drafter.new_state(1, capacity)
    kept = kept_features({-1: _full_hidden(runtime, tokens)[:, start : L - 1]}, [start], capacity)
    buf = torch.zeros(1, capacity, dtype=torch.int64)
    buf[0, :L] = torch.tensor(tokens)
    return state, DraftContext(buf, torch.tensor([L]), [SamplingParams()], [None], features=kept)


def _chain_logprob(feature, runtime, tokens: list[int], path: list[int]) -> float:
    """The feature draft's log-probability of ``path`` after ``tokens``, pair by pair along its
    chain (its own causal forwards: the code the training model is checked against)."""
    state, ctx = _fresh(feature, runtime, tokens, 0)
    begun = feature.start(state, ctx)
    logits, f, total = begun.logits[0], begun.feature, 0.0
    for j, t in enumerate(path):
        total += float(logits.float().log_softmax(-1)[t])
        x = feature.inputs(f.unsqueeze(1), torch.tensor([[t]]), None)
        logits, f = feature._forward(state, x, torch.tensor([[len(tokens) - 1 + j]]))
        logits = logits[0]
    return total


@pytest.mark.parametrize("subset", [False, True], ids=["full-head", "subset-head"])
def test_tree_scores_are_the_chain_path_log_probs_and_the_top_k_are_kept(tiny_pipe, subset):
    head = head_subset(96) if subset else None
    feature = _feature(tiny_pipe, head)
    drafter = FeatureTreeDrafter(feature, TreeShape(True, 3, 3), "t")
    tokens = random_prompts([13], seed=3)[0]
    state, ctx = _fresh(drafter, tiny_pipe.runtime, tokens, 0)
    grown = drafter.grow(state, drafter.root(state, ctx), 4)
    assert grown.tokens.shape == (1, 3 + 3 * 9)  # depth 1: 3, then 3 expanded x 3 children
    tree = TokenTree(grown.tokens[0], grown.parents[0])
    for i in range(tree.num_nodes):
        path = tree.tokens[tree.ancestors[i]].tolist()
        want = _chain_logprob(feature, tiny_pipe.runtime, tokens, path)
        assert grown.scores[0, i].item() == pytest.approx(want, abs=1e-4)
    if subset:
        assert set(grown.tokens[0].tolist()) <= set(head.tolist())
    state, ctx = _fresh(drafter, tiny_pipe.runtime, tokens, 0)
    prop = drafter.propose(state, ctx, 6)
    keep = most_probable(grown.scores, 6)[0]
    assert prop.trees[0].tokens.tolist() == grown.tokens[0][keep].tolist()
    assert int(prop.trees[0].depth.max()) >= 2  # the rerank went below depth 1


@pytest.mark.parametrize("kind", ["feature", "model"])
def test_growth_stops_once_no_deeper_candidate_can_be_kept(tiny_pipe, kind):
    """With a budget, the dynamic tree stops growing when every row already has k candidates at
    least as probable as any it could expand: the same tree, fewer draft forwards."""
    if kind == "feature":  # its head scaled: some steps sure, some unsure
        drafter = FeatureTreeDrafter(_feature(tiny_pipe, sharp=12.0), DYN, "t")
    else:
        w = dataclasses.replace(tiny_pipe.runtime.w, lm_head=tiny_pipe.runtime.w.lm_head * 12.0)
        drafter = TopKTreeDrafter(ModelDrafter(LlamaRuntime(w, [0]), "prune:0"), DYN, "t")
    feeds, feed = [], drafter._feed
    drafter._feed = lambda *a: feeds.append(1) or feed(*a)
    saved = 0
    for tokens in random_prompts([9, 14, 6], seed=11):
        for k in range(2, 9):
            runs = []
            for budget in (None, k):
                feeds.clear()
                state, ctx = _fresh(drafter, tiny_pipe.runtime, tokens, 0)
                grown = drafter.grow(state, drafter.root(state, ctx), k, budget)
                keep = most_probable(grown.scores, k)[0]
                runs.append((grown.tokens[0][keep].tolist(), grown.parents[0][keep].tolist(), len(feeds)))
            (tok, par, full), (tok_b, par_b, fewer) = runs
            assert (tok, par) == (tok_b, par_b)  # candidates are numbered alike: the early list is a prefix
            assert full == k - 1 and fewer <= full
            saved += full - fewer
    assert saved > 10  # where the draft is unsure, the kept tree stays shallow


class Oracle(FeatureDrafter):
    """A feature draft whose logits rank the target's own next token (read from a plain decode)
    first, but second at every third position, so that accepted paths go deep and leave the
    tree's first branch."""

    def __init__(self, *a, references=(), **kw):
        super().__init__(*a, **kw)
        R = max(len(r) for r in references)
        self.references = [torch.tensor(r + [0] * (R - len(r))) for r in references]  # (R,) each
        self.ref = None

    def start(self, state, ctx):
        L = ctx.lengths
        rows = [
            next(r for r in self.references if torch.equal(r[:n], ctx.tokens[b, :n]))
            for b, n in enumerate(L.tolist())
        ]
        self.ref = torch.stack(rows)  # (B, R) each row's reference sequence
        return super().start(state, ctx)

    def _run(self, state, x, positions, mask=None, slots=None, index=None, rows=False):
        assert self.subset is None  # the logits below are over the vocabulary whatever ``rows``
        logits, f = super()._run(state, x, positions, mask, slots, index, rows)
        pos = positions if index is None else positions.gather(1, index)  # (B, I)
        true = self.ref.gather(
            1, (pos + 2).clamp(max=self.ref.shape[1] - 1)
        )  # the token each column predicts
        top2 = logits.topk(2, dim=-1).values  # (B, I, 2)
        # the draft's sure best, but just below its best (its second) at every third position
        value = torch.where((pos % 3 != 0).unsqueeze(-1), top2[..., :1] + 10.0, top2.mean(-1, keepdim=True))
        return logits.scatter(-1, true.unsqueeze(-1), value), f


class Recording(FeatureTreeDrafter):
    """Keeps, per step and row, the committed tokens, the draft's context start and the tree."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps, self.paths = [], []

    def propose(self, state, ctx, k):
        prop = super().propose(state, ctx, k)
        for b, tree in enumerate(prop.trees):
            if tree is not None:
                L = int(ctx.lengths[b])
                self.steps.append((ctx.tokens[b, :L].tolist(), int(state.start[b]), k, tree))
        return prop

    def observe(self, state, num_accepted, verified=None):
        super().observe(state, num_accepted, verified)
        self.paths += accepted_columns(verified, num_accepted)


class EveryOther(FixedK):
    """Drafts at every other step only: the steps between run a one-token forward the drafter never
    observes."""

    def __init__(self, k: int):
        super().__init__(k)
        self.steps = 0

    def choose(self, rows=None, lag=None) -> int:
        self.steps += 1
        return self.k if self.steps % 2 else 0


@pytest.mark.parametrize("policy", [FixedK, EveryOther], ids=["every-step", "every-other-step"])
@pytest.mark.parametrize("shape", [DYN, STATIC], ids=["dyn", "static"])
def test_each_step_grows_the_tree_a_fresh_drafter_grows_from_the_whole_context(tiny_pipe, shape, policy):
    """The next step's real pairs read the target's columns along the accepted path (or, after a step
    without drafts, that step's), and the draft's cache holds nothing stale: each tree equals a fresh
    drafter's on the same committed context."""
    prompts = random_prompts([6, 10, 4], seed=4)
    plain = decode(Engine(tiny_pipe.runtime), prompts, 20)
    refs = [p + o for p, o in zip(prompts, plain)]
    oracle = _feature(tiny_pipe, cls=Oracle, references=refs)
    drafter = Recording(oracle, shape, "t")
    engine = Engine(tiny_pipe.runtime, drafter, policy(8), hidden_layers=drafter.hidden_layers)
    assert decode(engine, prompts, 20) == plain
    assert engine.stats.accepted > engine.stats.steps / 2  # most drafting steps accept several tokens
    assert any(p != list(range(len(p))) for p in drafter.paths)  # accepted nodes off the first branch
    fresh = FeatureTreeDrafter(oracle, shape, "fresh")
    for tokens, start, k, tree in drafter.steps:
        state, ctx = _fresh(fresh, tiny_pipe.runtime, tokens, start)
        want = fresh.propose(state, ctx, k).trees[0]
        assert (tree.tokens.tolist(), tree.parents.tolist()) == (want.tokens.tolist(), want.parents.tolist())
    assert len(drafter.steps) >= 6


@pytest.mark.parametrize("shape", [DYN, TreeShape(True, 3, 3), STATIC])
def test_greedy_output_identical_to_plain(tiny_pipe, shape):
    prompts = random_prompts([5, 9, 3], seed=6)
    plain = decode(Engine(tiny_pipe.runtime), prompts, 24)
    for head in (None, head_subset(64)):
        drafter = FeatureTreeDrafter(_feature(tiny_pipe, head), shape, "t")
        engine = Engine(tiny_pipe.runtime, drafter, FixedK(6), hidden_layers=drafter.hidden_layers)
        assert decode(engine, prompts, 24) == plain
        assert engine.stats.drafted > 0


def test_a_dream_draft_grows_trees_reading_the_target_layers(tiny_pipe):
    """A DREAM-style draft (cross-attention to the target's layer 0) in a tree: each fed candidate
    reads the last real pair's target layers; the output stays the target's."""
    model = _model(tiny_pipe)
    w = draft_weights(model.draft, tiny_pipe.runtime.w, None, torch.float32)
    cross = {
        **cross_weights(64, 1),
        "o": torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.2,
    }
    embed = tiny_pipe.runtime.w.embed
    dream = DreamDrafter(LlamaRuntime(w), model.fc.weight.detach(), cross, embed, "dream", (0,), 4)
    drafter = FeatureTreeDrafter(dream, DYN, "t")
    assert drafter.hidden_layers == (-1, 0)
    prompts = random_prompts([5, 8], seed=10)
    engine = Engine(tiny_pipe.runtime, drafter, FixedK(5), hidden_layers=drafter.hidden_layers)
    assert decode(engine, prompts, 16) == decode(Engine(tiny_pipe.runtime), prompts, 16)
    assert engine.stats.drafted > 0


def test_a_fused_local_head_reads_each_candidates_own_path(tiny_pipe):
    """A bigram local head that always predicts the token after its last one: each node's children
    carry the local head's choice after that node's own token, and the output stays the target's."""
    V = 256
    seqs = [torch.tensor([t, (t + 1) % V]) for t in range(V)]  # bigram counts: t -> t + 1
    local = LocalHead.count(seqs, V, M=2)
    local.a, local.b = 50.0, 0.0  # the local expert dominates
    drafter = FeatureTreeDrafter(_feature(tiny_pipe, local=local), DYN, "t")
    tokens = random_prompts([9], seed=8)[0]
    state, ctx = _fresh(drafter, tiny_pipe.runtime, tokens, 0)
    tree = drafter.propose(state, ctx, 6).trees[0]
    firsts = [int(tree.tokens[c]) for c in tree.children[-1]]
    assert firsts[0] == (tokens[-1] + 1) % V
    for node, kids in tree.children.items():
        if node >= 0:
            assert int(tree.tokens[kids[0]]) == (int(tree.tokens[node]) + 1) % V
    prompts = random_prompts([5, 8], seed=9)
    engine = Engine(tiny_pipe.runtime, drafter, FixedK(4), hidden_layers=drafter.hidden_layers)
    assert decode(engine, prompts, 16) == decode(Engine(tiny_pipe.runtime), prompts, 16)


def test_specs_build_feature_trees_and_the_cost_aware_policy_sizes_them(tiny_pipe, tmp_path):
    head = head_subset(128)
    model = _model(tiny_pipe, head)
    meta = DraftMeta.for_target(
        tiny_pipe.target.model, "tiny", kind="feature", head=VocabSubset(head, 0.0), init_layers=[0]
    )
    save_draft(tmp_path / "f", model.draft, meta, extra={"fc.weight": model.fc.weight})
    pipe = api.load("tiny", draft=f"tree:static=3x1,designed:{tmp_path / 'f'}", dtype="fp32")
    assert isinstance(pipe.drafter, FeatureTreeDrafter) and pipe.drafter.shape == TreeShape(False, 3, 1, 1)
    assert pipe.engine(3).hidden_layers == (-1,)
    pipe = api.load("tiny", draft=f"tree:designed:{tmp_path / 'f'}", dtype="fp32")
    assert isinstance(pipe.drafter, FeatureTreeDrafter) and pipe.drafter.shape == DYN
    prompts = random_prompts([5, 11, 8], seed=9)
    plain = decode(Engine(pipe.runtime), prompts, 20)
    engine = pipe.engine("auto")
    assert isinstance(engine.policy, CostAwareK)
    assert decode(engine, prompts, 20) == plain
    assert engine.stats.drafted > 0  # the policy grew trees (and may choose n = 0 after measuring)
    sampled = decode(pipe.engine(4), prompts, 12, SamplingParams(temperature=0.8, seed=1))
    assert [len(s) for s in sampled] == [12, 12, 12]
    with pytest.raises(SpecdraftError, match="not a model or feature draft"):
        api.load("tiny", draft="tree:designed:auto", dtype="fp32")
    assert str(DraftSpec.parse("tree:static=2x1,local:designed:x")) == "tree:static=2x1,local:designed:x"
    with pytest.raises(SpecdraftError, match="model or feature draft"):
        DraftSpec.parse("tree:dyn=2,lookup")


def test_rows_that_join_and_leave_mid_run_keep_their_own_features(tiny_pipe):
    """A server's batch: rows of different lengths leave, a new row joins between steps (it has no
    features until the target has run it once); every row's output is the target's."""
    prompts = random_prompts([6, 9, 4], seed=12)
    budgets = [10, 22, 16]
    plain = [decode(Engine(tiny_pipe.runtime), [p], n)[0] for p, n in zip(prompts, budgets)]
    oracle = _feature(tiny_pipe, cls=Oracle, references=[p + o for p, o in zip(prompts, plain)])
    drafter = FeatureTreeDrafter(oracle, DYN, "t")
    engine = Engine(tiny_pipe.runtime, drafter, FixedK(6), hidden_layers=drafter.hidden_layers)
    ids = engine.add([Request(p, n) for p, n in zip(prompts[:2], budgets[:2])])
    out: dict[int, list[int]] = {}
    for step in range(60):
        if step == 3:
            ids += engine.add([Request(prompts[2], budgets[2])])
        if not engine.active:
            break
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
    assert [out[i] for i in ids] == plain
    assert engine.stats.accepted > 10
