"""The Ouroboros drafter without a model (``ouroboros:lookup``): lookup lengthened with pool phrases,
pool phrases as branches within the node budget, the pool fed by the target's corrected phrase,
per-request vs shared pools, warm start, the spec, and greedy output equal to plain decoding (its
sampling TV check is a case of tests/test_tv_all_drafters.py)."""

import pytest
import torch

from specdraft import api, pool
from specdraft.drafters.base import DraftContext, Verified
from specdraft.drafters.ouroboros import Chain, OuroborosDrafter, budget_tree
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.pool import PhrasePool
from specdraft.registry import DraftSpec
from specdraft.verify import SamplingParams
from tests.helpers import plain_greedy, random_prompts


def _ctx(rows: list[list[int]]) -> DraftContext:
    L = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (L - len(r)) for r in rows])
    B = len(rows)
    return DraftContext(tokens, torch.tensor([len(r) for r in rows]), [SamplingParams()] * B, [None] * B)


def test_budget_tree_merges_chains_in_order_and_keeps_at_most_k_nodes():
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0, 0], [0.1, 0.2, 0.7, 0, 0, 0, 0]])  # the model's two tokens
    chains = [
        Chain([1, 2, 3], ["model", "model", "pool"], q),
        Chain([1, 4], ["pool"] * 2),
        Chain([5, 6], ["pool"] * 2),
    ]
    tree = budget_tree(chains, k=5)
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tree.sources == ("model", "model", "pool", "pool", "pool") and tree.draft_probs is None
    assert budget_tree(chains, k=2).tokens.tolist() == [1, 2]
    assert budget_tree([], k=3).num_nodes == 0
    with_q = budget_tree(chains, k=5, vocab_size=7).draft_probs  # the model's rows, else point masses
    assert torch.equal(with_q[:2], q) and with_q[2:].argmax(-1).tolist() == [3, 4, 5]
    assert with_q[2:].sum(-1).tolist() == [1.0, 1.0, 1.0]


def test_lookup_is_lengthened_with_pool_phrases_and_other_phrases_branch():
    drafter = OuroborosDrafter(branches=2)
    state = drafter.new_state(1, 64)
    # lookup: "9 1" occurred, followed by "2 6 9 1" (the end of the text); the pool knows, after
    # 1, "2 6 9 1" (from the text) and a warm phrase "7 8"
    state.pools[0].add(1, [7, 8])
    text = [2, 3, 4, 5, 9, 1, 2, 6, 9, 1]
    prop = drafter.propose(state, _ctx([text]), k=6)
    tree = prop.trees[0]
    # lookup's 4 tokens lengthened by 1 -> 2 6 .., leaving one node of the 6 for the branch 7 (with
    # k = 4 the lookup draft is cut to 3 for it)
    assert tree.tokens.tolist() == [2, 6, 9, 1, 2, 7] and tree.parents.tolist() == [-1, 0, 1, 2, 3, -1]
    assert tree.sources == ("lookup",) * 4 + ("pool",) * 2
    assert prop.tokens[0, : int(prop.num_valid[0])].tolist() == [2, 6, 9, 1, 2]  # the first path
    assert drafter.propose(state, _ctx([text]), k=4).trees[0].tokens.tolist() == [2, 6, 9, 7]
    chain = OuroborosDrafter(tree=False)
    prop = chain.propose(chain.new_state(1, 64), _ctx([text]), k=6)
    assert prop.trees is None and prop.tokens[0].tolist() == [2, 6, 9, 1, 2, 6]  # all k on the chain
    # the last token 0 never occurred before: only pool phrases (warm ones here), as branches
    state.pools[0].add(0, [9, 1])
    state.pools[0].add(0, [8])
    prop = drafter.propose(state, _ctx([[*text, 0]]), k=4)
    assert prop.bucket.tolist() == [0] and prop.trees[0].tokens.tolist() == [8, 9, 1]
    assert prop.trees[0].parents.tolist() == [-1, -1, 1] and set(prop.trees[0].sources) == {"pool"}


def test_observe_adds_the_targets_corrected_phrase_to_the_rows_pool():
    drafter = OuroborosDrafter()
    state = drafter.new_state(2, 64)
    # row 0 fed [5, 7, 8, 9]: 7 accepted, 3 recovered, then the target said 4 after 8 and 6 after 9
    verified = Verified([[5, 7, 8, 9], [1]], [[-1, 0, 1, 2], [-1]], [[7, 3, 4, 6], [2]], [[7, 3], [2]])
    drafter.observe(state, torch.tensor([1, 0]), verified)
    assert state.pools[0].get(3) == [(4, 6)] and state.pools[1].get(3) == []
    prop = drafter.propose(state, _ctx([[5, 7, 3], [1, 2]]), k=3)
    assert prop.tokens[0, :2].tolist() == [4, 6] and prop.trees[0].sources == ("pool", "pool")
    drafter.observe(state, torch.tensor([0, 0]))  # the engine's chain path may send no Verified


def test_pools_are_per_request_unless_shared_and_start_warm(tmp_path):
    alone = OuroborosDrafter()
    a, b = alone.new_state(1, 8), alone.new_state(1, 8)
    assert a.pools[0] is not b.pools[0]
    pool._SHARED.pop("ouroboros", None)
    warm = PhrasePool()
    warm.add(4, [5, 6])
    warm.save(tmp_path / "pool.json")
    shared = OuroborosDrafter(shared=True, warm=str(tmp_path / "pool.json"))
    s1 = shared.new_state(2, 8)
    s1.select_rows(torch.tensor([1]))
    s1.append(shared.new_state(1, 8))
    assert s1.pools[0] is s1.pools[1] is OuroborosDrafter(shared=True).new_state(1, 8).pools[0]
    assert s1.pools[0].get(4) == [(5, 6)]
    assert OuroborosDrafter(warm=str(tmp_path / "pool.json")).new_state(1, 8).pools[0].get(4) == [(5, 6)]
    pool._SHARED.pop("ouroboros", None)


def test_spec_and_greedy_output_equals_plain_decoding(tmp_path):
    assert DraftSpec.parse("ouroboros").kind == "ouroboros"
    for bad in ("ouroboros:model", "ouroboros:lookup,global", "ouroboros:lookup,warm="):
        with pytest.raises(SpecdraftError, match="bad draft spec"):
            DraftSpec.parse(bad)
    with pytest.raises(SpecdraftError, match="cannot read phrase pool"):
        api.load("tiny", draft=f"ouroboros:lookup,warm={tmp_path / 'missing.json'}", dtype="fp32")
    prompts = [p * 3 for p in random_prompts([4, 7, 5], seed=2)]
    for spec in ("ouroboros:lookup", "ouroboros:lookup,chain"):
        pipe = api.load("tiny", draft=spec, dtype="fp32")
        assert isinstance(pipe.drafter, OuroborosDrafter)
        spec_tokens, stats = api.run_batch(pipe, prompts, max_new_tokens=24, k=4)
        plain_tokens, _ = api.run_batch(pipe, prompts, max_new_tokens=24, k=0)
        assert spec_tokens == plain_tokens
        assert stats.accepted > 0


def test_the_engine_feeds_each_pool_the_targets_phrases_past_a_rejection(monkeypatch):
    refined = []
    add_verified = PhrasePool.add_verified

    def spy(self, *row):
        refined.append(add_verified(self, *row))
        return refined[-1]

    monkeypatch.setattr(PhrasePool, "add_verified", spy)
    pipe = api.load("tiny", draft="ouroboros:lookup", dtype="fp32")
    prompts = [p * 3 for p in random_prompts([4, 7], seed=3)]
    api.run_batch(pipe, prompts, max_new_tokens=16, k=4)
    assert refined  # observe got a Verified for each row of each step
    assert any(len(r) >= 2 for r in refined)  # a rejection with the target's predictions past it


def test_a_model_base_keeps_greedy_output_and_accepts_tokens_from_model_and_pool(tiny):
    """A layer-pruned draft of the target as the base (its cache follows only its own accepted
    tokens, also when the accepted path is a pool branch); prompts that repeat give the pool text."""
    from specdraft.drafters.model import ModelDrafter
    from specdraft.engine import Engine, Request, generate
    from specdraft.models.llama import LlamaRuntime
    from specdraft.policy import FixedK

    drafter = OuroborosDrafter(ModelDrafter(LlamaRuntime(tiny.weights, [0]), "prune:0"))
    assert drafter.vocab_size == tiny.target.vocab_size and drafter.source == "model"
    prompts = [p * 3 for p in random_prompts([5, 6, 9], seed=4)]
    requests = [Request(p, 24) for p in prompts]
    out, sources = {}, []
    for ev in generate(Engine(tiny.target, drafter, FixedK(4)), requests):
        out.setdefault(ev.request_id, []).extend(ev.tokens)
        sources += [s for s, d in zip(ev.source, ev.from_draft) if d]
    assert [out[r.id] for r in requests] == [plain_greedy(tiny.target, p, 24) for p in prompts]
    assert {"model", "pool"} <= set(sources), set(sources)


def test_the_servers_row_caps_cut_trees_to_their_first_nodes():
    from specdraft.drafters.capped import RowCappedDrafter

    capped = RowCappedDrafter(OuroborosDrafter())
    assert capped.proposes_trees
    text = [2, 3, 4, 5, 9, 1, 2, 6, 9, 1]
    state = capped.new_state(3, 64)
    for row_pool in state.pools:
        row_pool.add(1, [7, 8])
    capped.caps = torch.tensor([0, 2, 9])
    prop = capped.propose(state, _ctx([text] * 3), k=6)
    full = prop.trees[2]
    assert prop.trees[0] is None and prop.num_valid.tolist() == [0, 2, 5]
    assert (
        prop.trees[1].tokens.tolist() == full.tokens[:2].tolist()
        and prop.trees[1].sources == full.sources[:2]
    )


def test_a_model_base_over_a_tokenizer_only_target_loads_the_transformers_model(tiny_pipe):
    """A quantized target loads only its tokenizer; the designed:auto base needs the model (as
    ``api.load`` gives a ``designed`` spec)."""
    from dataclasses import replace

    from specdraft.drafters.ouroboros import _with_model
    from specdraft.registry import Target

    bare = Target(replace(tiny_pipe.target, model=None), tiny_pipe.runtime, torch.float32)
    assert _with_model(bare).loaded.model is not None and _with_model(bare).runtime is tiny_pipe.runtime
    full = Target(tiny_pipe.target, tiny_pipe.runtime, torch.float32)
    assert _with_model(full) is full


def test_draft_names_the_model_base(monkeypatch, tiny_pipe):
    """``ouroboros:draft=NAME`` builds the designed draft NAME as the base (a feature draft too),
    plain ``ouroboros`` the target's ``designed:auto``; ``draft=`` with ``lookup`` or no name is one
    line."""
    from specdraft import registry
    from specdraft.drafters.ouroboros import from_spec

    for bad in ("ouroboros:draft=", "ouroboros:lookup,draft=x"):
        with pytest.raises(SpecdraftError, match="bad draft spec"):
            DraftSpec.parse(bad)
    built = []

    def fake_build(spec, target):
        built.append(str(spec))
        return PromptLookupDrafter()

    monkeypatch.setattr(registry, "build_drafter", fake_build)
    target = registry.Target(tiny_pipe.target, tiny_pipe.runtime, torch.float32)
    cases = (("ouroboros:draft=my-feature,shared", "designed:my-feature"), ("ouroboros", "designed:auto"))
    for spec, base in cases:
        drafter = from_spec(DraftSpec.parse(spec), target)
        assert built[-1] == base and isinstance(drafter.base, PromptLookupDrafter)
    pool._SHARED.pop("ouroboros", None)
