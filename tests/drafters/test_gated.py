"""The gated drafter and the subset-head runtime. A smaller draft head keeps speculative decoding
lossless: greedy output equals plain decoding, and sampled output is distributed exactly as the
target's, though q is zero outside the subset; the gate proposes only the prefix that pays."""

import pytest
import torch

from specdraft import api
from specdraft.design.artifact import DraftMeta, save_draft
from specdraft.design.prune import depth_prune
from specdraft.design.vocab import VocabSubset
from specdraft.drafters.base import DraftContext
from specdraft.drafters.gated import GatedDrafter
from specdraft.engine import Engine
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights
from specdraft.policy import FixedK, VerifyCost, best_prefix, worth_continuing
from specdraft.verify import SamplingParams, verify_sampling
from tests.helpers import decode, head_subset, random_prompts


def _subset_runtime(tiny_pipe, ids):
    draft = depth_prune(tiny_pipe.target.model, [0])
    w = draft_weights(draft, tiny_pipe.runtime.w, ids, torch.float32)
    return SubsetHeadRuntime(LlamaRuntime(w), ids, 256)


def test_subset_logits_are_the_head_rows_and_minus_inf_elsewhere(tiny_pipe):
    ids = head_subset(40)
    rt = _subset_runtime(tiny_pipe, ids)
    full = LlamaRuntime(draft_weights(depth_prune(tiny_pipe.target.model, [0]), None, None, torch.float32))
    tokens = torch.tensor([[1, 2, 3, 4]])
    pos = torch.arange(4).unsqueeze(0)
    got = rt.forward(rt.new_state(1, 8), tokens, pos).logits
    ref = full.forward(full.new_state(1, 8), tokens, pos).logits
    assert got.shape == ref.shape == (1, 4, 256)
    torch.testing.assert_close(got[..., ids], ref[..., ids])
    outside = torch.ones(256, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[..., outside]).all()


def test_greedy_output_equals_plain_decoding_through_the_api(tiny_pipe, tmp_path):
    target = tiny_pipe.target.model
    ids = head_subset(32, must=(255,))  # a head that misses most of what the target says
    meta = DraftMeta.for_target(target, "tiny", head=VocabSubset(ids, 0.0), init_layers=[0])
    save_draft(tmp_path / "d", depth_prune(target, [0]), meta)
    pipe = api.load("tiny", draft=f"designed:{tmp_path / 'd'}", dtype="fp32", draft_dtype="fp32")
    assert pipe.drafter.name == "designed:d"
    pipe.drafter.cost = VerifyCost([1.0] * 9, 0.0)  # free verification: always propose all k
    prompts = random_prompts([5, 17, 9], seed=3)
    plain = decode(Engine(pipe.runtime), prompts, 24)
    spec = pipe.engine(4)
    got = decode(spec, prompts, 24)
    assert got == plain
    # it did speculate, imperfectly
    assert spec.stats.drafted > 0 and spec.stats.accepted < spec.stats.drafted


def test_sampled_draft_tokens_and_q_stay_inside_the_subset(tiny_pipe):
    ids = head_subset(16)
    from specdraft.drafters.model import ModelDrafter

    drafter = ModelDrafter(_subset_runtime(tiny_pipe, ids), "subset")
    state = drafter.new_state(2, 32)
    tokens = torch.tensor(random_prompts([6, 6], seed=1))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    ctx = DraftContext(
        torch.cat([tokens, torch.zeros(2, 26, dtype=torch.int64)], 1), torch.tensor([6, 6]), params, gens
    )
    prop = drafter.propose(state, ctx, 5)
    inside = torch.zeros(256, dtype=torch.bool)
    inside[ids] = True
    assert inside[prop.tokens].all()
    assert prop.probs.shape == (2, 5, 256)
    assert (prop.probs[..., ~inside] == 0).all()
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(2, 5))


class _Expanded:
    """A subset-head runtime seen from outside: full-vocabulary logits, -inf off the head (not a
    :class:`SubsetHeadRuntime`, so a drafter cannot take the head's own columns)."""

    def __init__(self, rt: SubsetHeadRuntime):
        self.rt, self.vocab_size, self.max_context, self.dtype = rt, rt.vocab_size, rt.max_context, rt.dtype

    def new_state(self, batch_size, capacity):
        return self.rt.new_state(batch_size, capacity)

    def forward(self, *args, **kw):
        return self.rt.forward(*args, **kw)


@pytest.mark.parametrize("kind", ["model", "gated"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafting_over_the_head_columns_equals_drafting_over_the_vocabulary(tiny_pipe, kind, temperature):
    """A model or gated drafter works on a subset head's own columns and maps its choice back:
    greedy, the proposal (tokens, how many) is the one it makes from full-vocabulary logits;
    sampling, the first q is (the sampled tokens differ: the same random number picks along the
    head's order, not the vocabulary's; ``tests/test_tv_all_drafters.py`` checks the distribution)."""
    from specdraft.drafters.model import ModelDrafter

    ids = head_subset(40, seed=4)
    props = []
    for rt in (_subset_runtime(tiny_pipe, ids), _Expanded(_subset_runtime(tiny_pipe, ids))):
        if kind == "gated":
            drafter = GatedDrafter(rt, "d", cost=VerifyCost([1.0, 1.05, 1.1, 1.15, 1.2, 1.25], 0.05))
        else:
            drafter = ModelDrafter(rt, "d")
        assert (drafter.head is not None) == isinstance(rt, SubsetHeadRuntime)
        tokens = torch.tensor(random_prompts([7, 7], seed=2))
        params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2)]
        gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        ctx = DraftContext(
            torch.cat([tokens, torch.zeros(2, 25, dtype=torch.int64)], 1), torch.tensor([7, 7]), params, gens
        )
        props.append(drafter.propose(drafter.new_state(2, 32), ctx, 5))
    head, full = props
    made = 5 if head.steps is None else int(head.steps.max())  # a gated draft may stop early
    inside = torch.zeros(256, dtype=torch.bool)
    inside[ids] = True
    assert made >= 1 and inside[head.tokens[:, :made]].all()
    if temperature:
        assert head.probs.shape == full.probs.shape == (2, 5, 256)
        torch.testing.assert_close(head.probs[:, 0], full.probs[:, 0])
        return
    assert head.probs is None and full.probs is None
    assert torch.equal(head.tokens[:, :made], full.tokens[:, :made])
    if kind == "gated":
        assert torch.equal(head.num_valid, full.num_valid) and torch.equal(head.steps, full.steps)


def test_rejection_sampling_with_a_subset_q_reproduces_p():
    """Monte Carlo over 100k rows: the first output token's frequencies match p, including the
    tokens the draft can never propose (only the residual max(p - q, 0) can emit them)."""
    V, N = 8, 100_000
    p = torch.tensor([0.30, 0.05, 0.20, 0.02, 0.13, 0.10, 0.15, 0.05])
    subset = torch.tensor([0, 1, 3])  # the draft's head: misses 63% of p's mass
    q = torch.zeros(V)
    q[subset] = torch.tensor([0.2, 0.5, 0.3])  # deliberately unlike p
    g = torch.Generator().manual_seed(0)
    draft = subset[torch.multinomial(q[subset], N, replacement=True, generator=g)].view(N, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(N)]
    target_probs = p.expand(N, 2, V)
    verdict = verify_sampling(draft, q.expand(N, 1, V), target_probs, gens)
    first = verdict.tokens[:, 0]
    freq = torch.bincount(first, minlength=V).float() / N
    assert (freq - p).abs().max() < 0.01, (freq, p)
    outside = torch.ones(V, dtype=torch.bool)
    outside[subset] = False
    assert freq[outside].sum() > 0.6  # emitted only through the residual


def test_sampling_through_the_engine_reproduces_the_target_distribution():
    """3000 rows of one prompt through the engine with a subset-head draft: the first two output
    tokens follow the target's exact marginals (computed by enumerating the first token). The tiny
    target's head is scaled up so that its distributions are sharp enough to test."""
    from specdraft.drafters.model import ModelDrafter
    from specdraft.models.tiny import tiny_llama

    target = tiny_llama(seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    runtime = LlamaRuntime(LlamaWeights.from_hf(target, torch.float32))
    prompt = random_prompts([6], seed=5)[0]
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # (V,)
        both = torch.tensor([prompt + [x] for x in range(256)])
        p2 = (p1.unsqueeze(1) * target(both).logits[:, -1].softmax(-1)).sum(0)  # (V,) marginal of token 2
    head = p1.argsort(descending=True)[1:86]  # a third of the vocabulary, without the target's mode
    draft = depth_prune(target, [0])
    drafter = ModelDrafter(
        SubsetHeadRuntime(LlamaRuntime(draft_weights(draft, runtime.w, head, torch.float32)), head, 256),
        "subset",
    )

    B = 3000
    engine = Engine(runtime, drafter, FixedK(3))
    out = decode(engine, [prompt] * B, 2, [SamplingParams(temperature=1.0, seed=i) for i in range(B)])
    assert engine.stats.accepted > 0 and engine.stats.accepted < engine.stats.drafted
    for pos, exact in ((0, p1), (1, p2)):
        freq = torch.bincount(torch.tensor([o[pos] for o in out]), minlength=256).float() / B
        tv = 0.5 * (freq - exact).abs().sum()
        assert tv < 0.06, (pos, float(tv))
        assert freq[~torch.isin(torch.arange(256), head)].sum() > 0.15  # tokens the draft cannot propose


def test_best_prefix_weighs_expected_tokens_against_verification_cost():
    cost = VerifyCost(target=[1.0, 2.0, 2.2, 2.4, 2.6], draft=0.05)
    conf = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.3, 0.9, 0.9, 0.9], [0.9, 0.9, 0.1, 0.9]])
    # row 0: 5 expected tokens for 2.75 beats a plain step; row 1: a 30% first token never pays
    # row 2: two likely tokens (1 + 0.9 + 0.81 = 2.71 for 2.25) pay, the third does not
    assert best_prefix(conf, cost).tolist() == [4, 0, 2]
    assert best_prefix(torch.full((1, 3), 0.01), VerifyCost([1.0] * 4, 0.0)).tolist() == [3]  # free: all


def test_gated_drafter_stays_lossless_and_proposes_only_what_pays(tiny_pipe):
    ids = head_subset(64, must=(255,))
    rt = _subset_runtime(tiny_pipe, ids)
    prompts = random_prompts([6, 13], seed=8)
    plain = decode(Engine(tiny_pipe.runtime), prompts, 16)
    costly = GatedDrafter(rt, "gated", cost=VerifyCost([1.0, 50.0], 0.0))  # verifying 2+ tokens never pays
    e = Engine(tiny_pipe.runtime, costly, FixedK(4))
    assert decode(e, prompts, 16) == plain and e.stats.drafted == 0
    free = GatedDrafter(_subset_runtime(tiny_pipe, ids), "gated", cost=VerifyCost([1.0] * 9, 0.0))
    e = Engine(tiny_pipe.runtime, free, FixedK(4))
    assert decode(e, prompts, 16) == plain and e.stats.drafted == e.stats.steps * 4
    measured = GatedDrafter(_subset_runtime(tiny_pipe, ids), "gated", target_runtime=tiny_pipe.runtime)
    e = Engine(tiny_pipe.runtime, measured, FixedK(3))
    sampled = decode(e, prompts, 8, SamplingParams(temperature=1.0, seed=3))
    assert (
        [len(x) for x in sampled] == [8, 8]
        and measured.cost.target[0] == 1.0
        and len(measured.cost.target) == 9
    )


def test_drafting_stops_once_no_longer_prefix_can_pay(tiny_pipe):
    cost = VerifyCost(target=[1.0, 2.0, 2.4, 2.5, 2.6], draft=0.05)
    # even 4 tokens at P = 0.2 cannot beat a plain step
    assert not worth_continuing(torch.tensor([[0.2]]), 4, cost)
    assert worth_continuing(torch.tensor([[0.9]]), 4, cost)
    ids = head_subset(64)
    d = GatedDrafter(_subset_runtime(tiny_pipe, ids), "gated", cost=VerifyCost([1.0, 50.0], 0.0))
    state = d.new_state(1, 32)
    ctx = DraftContext(
        torch.tensor([random_prompts([8], seed=1)[0] + [0] * 24]),
        torch.tensor([8]),
        [SamplingParams()],
        [None],
    )
    prop = d.propose(state, ctx, 4)
    assert prop.num_valid.tolist() == [0] and state.k == 1  # one draft forward, then it stopped


def test_gated_proposals_report_the_draft_forwards_each_row_needed(tiny_pipe):
    from specdraft.drafters.base import DraftContext
    from specdraft.verify import SamplingParams

    ids = torch.arange(40)
    ctx = DraftContext(
        torch.randint(0, 40, (2, 12)), torch.tensor([9, 12]), [SamplingParams()] * 2, [None] * 2
    )
    for cost, want in ((VerifyCost([1.0, 50.0], 0.0), [1, 1]), (VerifyCost([1.0] * 9, 0.0), [4, 4])):
        d = GatedDrafter(_subset_runtime(tiny_pipe, ids), "gated", cost=cost)
        prop = d.propose(d.new_state(2, 32), ctx, 4)
        assert prop.steps.tolist() == want
        assert d.stops_early
