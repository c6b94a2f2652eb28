"""Every drafter, and every rule that cuts a proposal short, keeps speculative sampling lossless.

Rejection sampling reproduces p only if each proposed token is distributed as the q it is verified
against. A rule that decides whether to propose position i from the token drawn there (the gated
draft once used the sampled token's own q) breaks that: the proposed tokens are then a filtered
sample. So the rule deciding position i may only read what was known before token i was drawn
(earlier tokens, the draft's distribution at i, the request, the policy's history).

The statistical test is the one of ``tests/test_sampling.py`` (target: a tiny Llama, vocabulary 8,
its head scaled up; every output of NEW tokens enumerated exactly), run for every drafter class and
every path that cuts a proposal: a model draft, prompt lookup (no q), the README's example bigram
drafter (no q), the target drafting for itself, a layer-pruned draft (also with a head subset:
prune:...,head=N), the gated designed draft (best prefix and early stop), the feature draft (also
with a head subset, drafting over the head's own rows, its EAGLE-2 token tree, and both drafting
from the features of plain steps they never saw), the DREAM-style draft, the feature draft with a
local head fused in, FlexDraft (drafting in the verification forward, and sequentially), the
block-diffusion drafter (one pass per block, cut by its length head), the drafts on GGUF blocks
beside a quantized target (``--draft-dtype q``: prune views, their head subsets, Q8_0 designed
drafts, token-level and feature ones; token trees verified on the quantized target's tree
attention), the Ouroboros and suffix drafters' token trees (point masses from a phrase pool / a
history), the cost-aware policy's per-class trim, its per-row cut of rows whose drafts fail (issue
17; for a free drafter, with the unverified proposals of the rows it cut), its safe arm's plain
steps when speculation is measured slower (issue 17) and the server's per-row caps. Each case also
checks that its cut really happened, and the old gating rule is shown to fail the same test."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from specdraft import kernels
from specdraft.design.prune import with_head
from specdraft.drafters.base import DraftContext, DraftState, Proposal
from specdraft.drafters.bigram import BigramDrafter
from specdraft.drafters.capped import RowCappedDrafter
from specdraft.drafters.ctc import CTCDrafter
from specdraft.drafters.diffusion import BlockArch, BlockDiffusion, DiffusionDrafter, init_tensors
from specdraft.drafters.dream import DreamDrafter, cross_weights
from specdraft.drafters.feature import FeatureDrafter
from specdraft.drafters.flex import FlexDrafter, FlexWeights
from specdraft.drafters.gated import GatedDrafter
from specdraft.drafters.local import LocalHead
from specdraft.drafters.lookup_tree import LookupTreeDrafter
from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.ngram import SEP, NgramIndex
from specdraft.drafters.ouroboros import OuroborosDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.drafters.suffix import SuffixDrafter
from specdraft.drafters.topk_tree import FeatureTreeDrafter, TopKTreeDrafter, TreeShape
from specdraft.engine import Engine, Request
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.subset_head import SubsetHeadRuntime
from specdraft.models.tiny import tiny_llama
from specdraft.policy import CappedPolicy, CostAwareK, FixedK, RowWatch, SafeArm, VerifyCost, best_prefix
from specdraft.stats import SpecStats
from specdraft.tree import TokenTree
from specdraft.verify import SamplingParams, logits_to_probs, verify_sampling

V = 8
NEW = 2  # 64 outcomes: small enough that n = 1200 samples separate a biased sampler
PROMPT = [1, 2, 3, 1, 2]
N = 1200
DELTA = 1e-6
PARAMS = SamplingParams(temperature=1.0)


def peaked(seed: int, scale: float) -> LlamaRuntime:
    w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=seed), torch.float32)
    w.lm_head = w.lm_head * scale  # untied: only the head is scaled
    return LlamaRuntime(w)


@pytest.fixture(scope="module")
def target():
    return peaked(seed=10, scale=12.0)


@pytest.fixture(scope="module")
def exact(target):
    return exact_distribution(target)


def exact_distribution(target) -> torch.Tensor:
    """P(output = x) for every x in V^NEW (index sum x_j V^(NEW-1-j))."""
    outs = torch.cartesian_prod(*[torch.arange(V)] * NEW)  # (V^NEW, NEW)
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(outs), -1), outs], 1)
    T = seqs.shape[1]
    logits = target.forward(target.new_state(len(seqs), T), seqs, torch.arange(T).expand(len(seqs), T)).logits
    probs = logits_to_probs(logits[:, len(PROMPT) - 1 : -1], PARAMS)  # (V^NEW, NEW, V)
    return probs.gather(-1, outs.unsqueeze(-1)).squeeze(-1).prod(-1)


def tv(idx: torch.Tensor, exact: torch.Tensor) -> float:
    freq = torch.bincount(idx, minlength=len(exact)).double() / len(idx)
    return 0.5 * float((freq - exact.double()).abs().sum())


def bound(exact: torch.Tensor, n: int) -> float:
    """E[TV] <= 1/2 sum_x sqrt(p(x)(1 - p(x)) / n), plus McDiarmid's t at confidence 1 - DELTA."""
    p = exact.double()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / DELTA) / (2 * n))


# ------------------------------------------------------------------ recording wrappers
class Recorder:
    """Wraps a drafter; keeps each proposal's per-row ``num_valid`` and ``steps``."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.vocab_size = inner.name, inner.vocab_size
        self.hidden_layers = getattr(inner, "hidden_layers", ())
        self.num_valid: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        self.trees: list[TokenTree] = []  # the token trees proposed (Proposal.trees)

    def new_state(self, batch_size, capacity):
        return self.inner.new_state(batch_size, capacity)

    def propose(self, state, ctx, k) -> Proposal:
        prop = self.inner.propose(state, ctx, k)
        B = prop.tokens.shape[0]
        self.num_valid.append(prop.num_valid if prop.num_valid is not None else torch.full((B,), k))
        if prop.steps is not None:
            self.steps.append(prop.steps)
        self.trees += [t for t in prop.trees or [] if t is not None]
        return prop

    def observe(self, state, num_accepted, verified=None):
        self.inner.observe(state, num_accepted, verified)

    def __getattr__(self, name):  # a capability's methods and settings (FlexDraft's forward_with_masks)
        return getattr(self.inner, name)


class SteadyClock:
    """A policy fed fixed latencies (a draft token 0.1, verifying n tokens 1 + 0.2 (n - 1)), so that
    its choices depend on acceptance only; records what :meth:`trim` cut."""

    def __init__(self, inner):
        self.inner = inner
        self.k_max = inner.k_max
        self.cut = 0  # rows trim() shortened
        self.kept = 0  # rows it left with at least one token
        self.off = 0  # rows the per-row watch had switched off when a step began
        self.shadowed = 0  # unverified proposals of off rows told to the watch (a free drafter's)

    @property
    def collapsed(self):
        return self.inner.collapsed

    def choose(self, rows=None, lag=None):
        k = self.inner.choose(rows)
        self.off += sum(self.inner.row_state[r].off for r in rows if r in self.inner.row_state)
        return k

    def trim(self, num_valid, bucket, rows=None):
        out = self.inner.trim(num_valid, bucket, rows)
        self.cut += int((out < num_valid).sum())
        self.kept += int((out > 0).sum())
        return out

    def update(self, k, num_drafted, num_accepted, draft_time, target_time, bucket=None, rows=None):
        n = int(num_drafted.max()) if num_drafted.numel() else 0
        self.inner.update(k, num_drafted, num_accepted, 0.1 * k, 1.0 + 0.2 * n, bucket, rows)

    def unverified(self, rows):
        return self.inner.unverified(rows)

    def shadow(self, rows, hits):
        self.shadowed += len(rows)
        self.inner.shadow(rows, hits)


class SampledTokenGate(GatedDrafter):
    """The old gating rule, kept here to show the test catches it: proposes the best prefix of
    confidences taken from the *sampled* tokens' own q (so whether token i is proposed depends on
    token i). Early stop never changed that prefix, so drafting all k gives the same proposal."""

    def propose(self, state, ctx, k):
        prop = ModelDrafter.propose(self, state, ctx, k)
        conf = prop.probs.gather(-1, prop.tokens.unsqueeze(-1)).squeeze(-1)  # (B, k): q(x_i)
        return replace(prop, num_valid=best_prefix(conf, self.cost))


# ------------------------------------------------------------------ the cases
@dataclass
class Case:
    """A drafter, a policy, and what to run before each engine step (the server sets caps)."""

    drafter: object
    policy: object
    batch: int = N  # rows per engine (the cost-aware policy learns across several engines)
    before_step: Callable | None = None
    check: Callable | None = None  # (recorder, policy) -> None: asserts that the cut path ran


def _distilled():
    """A draft with the target's ranking but flatter (its head at 8/12 of the target's scale): its
    top token often sits near a gate's threshold, where the old rule was most biased."""
    return peaked(seed=10, scale=8.0)


def _lengths(*want: int) -> Callable:
    """A check that proposals of each length in ``want`` (after any cut) occurred."""

    def check(rec, policy):
        seen = set(torch.cat(rec.num_valid).tolist())
        assert set(want) <= seen, (want, seen)

    return check


def _exactly(*want: int) -> Callable:
    """A check that every proposal's length (after any cut) is in ``want``, each occurring."""

    def check(rec, policy):
        seen = set(torch.cat(rec.num_valid).tolist())
        assert seen == set(want), (want, seen)

    return check


def _early_stop(rec, policy):
    assert bool((torch.cat(rec.steps) < 3).any())  # the draft stopped before its k = 3 forwards
    _lengths(0, 1, 2)(rec, policy)  # plain steps and proposals of several lengths


def _rows_off(rec, policy):
    # some rows off (their step verified nothing: k = 0 for an all-off batch, else trim), some drafted
    assert policy.off > 0 and policy.kept > 0, (policy.off, policy.kept)


def _shadowed(rec, policy):
    _rows_off(rec, policy)
    assert policy.shadowed > 0, policy.shadowed  # off rows' proposals were made and told, not verified


def _trimmed(rec, policy):
    assert policy.cut > 0 and policy.kept > 0, (policy.cut, policy.kept)  # trim cut some rows, not all


def _fell_back(rec, policy):
    rate = policy.inner.rate  # the safe arm judged speculation slower and imposed plain steps
    assert rate.fallbacks > 0 and rate.forced > 0, (rate.fallbacks, rate.forced)


def _branching(rec, policy):
    """Token trees were verified, some of them with several children under one node."""
    assert rec.trees and any(len(kids) > 1 for t in rec.trees for kids in t.children.values())


class PlainEveryOther(FixedK):
    """k = 0 at every other step, starting with the first (a feature drafter never sees those steps,
    yet their features must reach it: issue 18)."""

    def __init__(self, k: int):
        super().__init__(k)
        self.steps = 0

    def choose(self, rows=None, lag=None) -> int:
        self.steps += 1
        return 0 if self.steps % 2 else self.k


class FixedTrees:
    """Proposes the same point-mass tree for every row: 0 -> {1, 6}, 2 -> 3 -> 4, 5 (7 nodes)."""

    name, vocab_size = "fixed-trees", None

    def new_state(self, batch_size, capacity):
        return DraftState(batch_size)

    def propose(self, state, ctx, k):
        B = ctx.lengths.shape[0]
        tree = TokenTree.from_chains([[0, 1], [2, 3, 4], [5], [0, 6]][: max(1, k - 3)])
        return Proposal(torch.zeros(B, 0, dtype=torch.int64), trees=[tree] * B)

    def observe(self, state, num_accepted, verified=None):
        pass


def _warm_ouroboros(base) -> OuroborosDrafter:
    """An Ouroboros drafter whose pool starts with two phrases after every token, so trees branch."""
    drafter = OuroborosDrafter(base, branches=3)
    for t in range(V):
        drafter.start.add(t, [(t + 1) % V, (t + 2) % V])
        drafter.start.add(t, [(t + 3) % V])
    return drafter


def make_case(name: str, target: LlamaRuntime, draft=None) -> Case:
    """The case ``name`` (``draft``: the server-row-caps case's draft model instead of its own)."""
    if name == "model":
        return Case(ModelDrafter(peaked(seed=11, scale=12.0), "other"), FixedK(2))
    if name == "lookup":
        return Case(PromptLookupDrafter(), FixedK(3))
    if name == "lookup-tree":  # several matches merged into a token tree
        return Case(LookupTreeDrafter(max_ngram=2), FixedK(4), check=lambda rec, policy: rec.trees)
    if name == "tree-branches":  # point-mass siblings: the sample picks the child, if any carries it
        return Case(FixedTrees(), FixedK(7), check=_branching)
    if name in ("ouroboros", "ouroboros-model"):  # a base draft lengthened with pool phrases, pool
        # phrases as branches; the model's nodes carry its q, the pool's are point masses
        base = ModelDrafter(peaked(seed=11, scale=12.0), "other") if name == "ouroboros-model" else None
        return Case(_warm_ouroboros(base), FixedK(4), check=_branching)
    if name in ("tree-dyn", "tree-static"):  # a model draft's top-k as a tree (EAGLE-2's rerank,
        # or the chain with siblings): every node a point mass, the tree a function of q only
        shape = TreeShape(True, 2, 2) if name == "tree-dyn" else TreeShape(False, 3, 1, 1)
        inner = ModelDrafter(peaked(seed=11, scale=12.0), "other")
        return Case(TopKTreeDrafter(inner, shape, name), FixedK(4), check=_branching)
    if name == "suffix":  # frequency trees over the context and a history of earlier outputs
        drafter = SuffixDrafter(max_n=3, shared=True)
        drafter.history = NgramIndex(3, 1000)
        drafter.history.extend([SEP, 1, 2, 5, SEP, 1, 2, 6, 7, SEP, 3, 1, 2, 4])
        return Case(drafter, FixedK(4), check=_branching)
    if name == "bigram":  # the README's example drafter
        return Case(BigramDrafter(), FixedK(3))
    if name == "self":
        return Case(ModelDrafter(target, "self"), FixedK(2))
    if name == "pruned":
        return Case(ModelDrafter(LlamaRuntime(target.w, [0]), "prune:0"), FixedK(2))
    if name == "pruned-head":  # prune:0,head=N: q is zero outside the head's ids
        pruned = ModelDrafter(LlamaRuntime(target.w, [0]), "prune:0,head=5")
        return Case(with_head(pruned, torch.tensor([0, 1, 2, 4, 6])), FixedK(2))
    if name == "gated-best-prefix":
        # a second token costs less than the first: whether the first pays can hang on the second
        gated = GatedDrafter(_distilled(), "gated", cost=VerifyCost([1.0, 1.4, 1.6], 0.0))
        return Case(gated, FixedK(2), check=_lengths(1, 2))
    if name == "gated-early-stop":
        gated = GatedDrafter(_distilled(), "gated", cost=VerifyCost([1.0, 1.6, 1.8, 2.4], 0.05))
        return Case(gated, FixedK(3), check=_early_stop)
    if name == "gated-head":  # a designed draft: the gate over a subset head's own columns
        head = with_head(ModelDrafter(_distilled(), "d"), torch.tensor([0, 1, 2, 4, 6])).runtime
        gated = GatedDrafter(head, "gated", cost=VerifyCost([1.0, 1.6, 1.8, 2.4], 0.05))
        return Case(gated, FixedK(3), check=_early_stop)
    if name in ("feature", "tree-feature", "feature-head"):
        w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=12), torch.float32)
        w.lm_head = w.lm_head * 12.0
        fc = (
            torch.randn(w.embed.shape[1], 2 * w.embed.shape[1], generator=torch.Generator().manual_seed(0))
            * 0.1
        )
        runtime = LlamaRuntime(w)
        if name == "feature-head":  # a designed draft's head subset: drafting over its own rows
            head = torch.tensor([0, 1, 2, 4, 6])
            w.lm_head = w.lm_head[head]
            runtime = SubsetHeadRuntime(LlamaRuntime(w), head, V)
        feature = FeatureDrafter(runtime, fc, target.w.embed, name)
        if name == "tree-feature":  # EAGLE-2's tree of the feature draft's top tokens, point masses
            return Case(FeatureTreeDrafter(feature, TreeShape(True, 2, 2), name), FixedK(4), check=_branching)
        # rows without the target's features yet (the first step) propose nothing
        return Case(feature, FixedK(2), check=_lengths(0, 2))
    if name == "feature-prompt":  # reads 4 prompt pairs (the prefill's features): it proposes at every
        # step, the first after the prefill included
        feature = make_case("feature", target).drafter
        feature.prompt_pairs = 4
        return Case(feature, FixedK(2), check=_exactly(2))
    if name in ("feature-after-plain", "tree-feature-after-plain"):  # its first step plain: it proposes
        # from the features of a step it never saw (it proposed nothing there before issue 18's fix)
        inner = make_case(name.removesuffix("-after-plain"), target)
        check = _branching if name.startswith("tree") else _lengths(2)
        return Case(inner.drafter, PlainEveryOther(inner.policy.k_max), check=check)
    if name == "dream":  # cross-attends to the target's layer 0 (a live block: random output projection)
        w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=13), torch.float32)
        w.lm_head = w.lm_head * 12.0
        g = torch.Generator().manual_seed(1)
        C = w.embed.shape[1]
        cross = {**cross_weights(C, 1), "o": torch.randn(C, C, generator=g) * 0.2}
        fc = torch.randn(C, 2 * C, generator=g) * 0.1
        drafter = DreamDrafter(LlamaRuntime(w), fc, cross, target.w.embed, "dream", (0,), 4)
        return Case(drafter, FixedK(2), check=_lengths(0, 2))
    if name == "local-fused":  # the feature draft with a bigram local head fused in (product of experts)
        w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=12), torch.float32)
        w.lm_head = w.lm_head * 12.0
        fc = (
            torch.randn(w.embed.shape[1], 2 * w.embed.shape[1], generator=torch.Generator().manual_seed(2))
            * 0.1
        )
        seqs = [torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(3))]
        local = LocalHead.count(seqs, V, M=3)
        local.a, local.b = 1.5, 0.5
        drafter = FeatureDrafter(LlamaRuntime(w), fc, target.w.embed, "local:feature", local=local)
        return Case(drafter, FixedK(2), check=_lengths(0, 2))
    if name == "ctc":  # slots in one pass, CTC-collapsed candidates as a tree of point masses
        w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=15), torch.float32)
        w.lm_head = w.lm_head * 12.0
        g = torch.Generator().manual_seed(5)
        C = w.embed.shape[1]
        ctc = {
            "slots": torch.randn(3, C, generator=g),
            "blank_w": torch.randn(C, generator=g),
            "blank_b": torch.zeros(1),
        }
        fc = torch.randn(C, 2 * C, generator=g) * 0.1
        drafter = CTCDrafter(LlamaRuntime(w), fc, ctc, target.w.embed, "ctc", width=2, beams=4)
        return Case(drafter, FixedK(4), check=_branching)
    if name in ("flex", "flex-sequential"):  # drafts inside the verification forward (mask tokens
        # from layer 1, every group a row's possible accepted count), or in propose above the switch
        w = FlexWeights.init(target, 1, rank=8)
        g = torch.Generator().manual_seed(5)
        w.mask, w.up = torch.randn(w.mask.shape, generator=g), torch.randn(w.up.shape, generator=g)
        head = torch.tensor([0, 2, 3, 5, 6, 7]) if name == "flex-sequential" else None  # q = 0 elsewhere
        switch = N if name == "flex" else 0
        drafter = FlexDrafter(target, w, name, block=2, switch_batch=switch, head_tokens=head)
        return Case(drafter, FixedK(2), check=_lengths(2))
    if name == "diffusion":  # one pass proposes the block; q per position; the length head's n varies
        draft = tiny_llama(vocab_size=V, seed=14)
        g = torch.Generator().manual_seed(4)
        C = draft.config.hidden_size
        t = {**init_tensors(C), "fc": torch.randn(C, C, generator=g) * C**-0.5}
        t["len2.weight"] = torch.randn(1, 64, generator=g) * 4.0
        block = BlockDiffusion(draft, None, t, BlockArch(block=4, window=2))
        return Case(DiffusionDrafter(block, "diffusion"), FixedK(3), check=_lengths(0, 1, 3))
    if name == "cost-aware-trim":
        policy = SteadyClock(CostAwareK(k_max=3, k_start=3, probe_every=2))
        return Case(PromptLookupDrafter(), policy, batch=100, check=_trimmed)
    if name == "cost-aware-rows":
        # per-row watching strict enough to act within NEW = 2 steps: a row whose first proposal
        # was rejected verifies nothing at its second step (the cut reads the earlier step only;
        # the rows left at step 2 are all such rows, so the batch's k is 0 there)
        watch = RowWatch(evidence=0.5, floor=0.5, off_max=1)  # off_max 1: a run of one rejection will do
        policy = SteadyClock(CostAwareK(k_max=2, k_start=2, probe_every=8, watch=watch))
        return Case(ModelDrafter(peaked(seed=11, scale=12.0), "other"), policy, batch=100, check=_rows_off)
    if name == "cost-aware-rows-shadow":  # the same cut for a free drafter (prompt lookup): the engine
        # also proposes for the rows that are off, verifies none of it, and tells the watch
        watch = RowWatch(evidence=0.5, floor=0.5, off_max=1)
        policy = SteadyClock(CostAwareK(k_max=2, k_start=2, probe_every=8, watch=watch))
        return Case(PromptLookupDrafter(), policy, batch=100, check=_shadowed)
    if name == "cost-aware-safe-arm":  # steps cut to plain decoding by the realised-rate check (issue 17):
        # at these latencies a step drafting 2 pays only when rows accept ~0.6 tokens, so the check
        # falls back and tries again between the engines' steps
        arm = SafeArm(evidence=1, max_loss=0.5, backoff=1, backoff_max=2)
        policy = SteadyClock(CostAwareK(k_max=2, k_start=2, watch=None, guard=arm))
        return Case(ModelDrafter(peaked(seed=11, scale=12.0), "other"), policy, batch=50, check=_fell_back)
    if name in ("server-row-caps", "server-row-caps-tree"):  # the tree variant: trees cut to cap nodes
        inner = ModelDrafter(draft or peaked(seed=11, scale=12.0), "other")
        if name == "server-row-caps-tree":
            inner = _warm_ouroboros(inner)
        drafter, policy = RowCappedDrafter(inner), CappedPolicy(FixedK(3))

        def before_step(engine):  # as Scheduler._step: per-request caps (off, 1, none), the batch's k
            caps = [(0, 1, policy.k_max)[r.params.seed % 3] for r in engine.requests]
            policy.cap = max(caps)
            drafter.caps = torch.tensor(caps)

        def check(rec, policy):  # rows with each cap (a tree's first path is shorter than its
            # nodes); the tree variant's trees still branch
            if name == "server-row-caps":
                _lengths(0, 1, 3)(rec, policy)
            else:
                _lengths(0, 1, 2)(rec, policy)
                _branching(rec, policy)

        return Case(drafter, policy, before_step=before_step, check=check)
    if name == "old-gate":
        return Case(SampledTokenGate(_distilled(), "old", cost=VerifyCost([1.0, 1.4, 1.6], 0.0)), FixedK(2))
    raise ValueError(name)


def sample_outputs(target: LlamaRuntime, case: Case, n: int) -> tuple[torch.Tensor, Recorder, SpecStats]:
    """n speculative samples of NEW tokens (request i seeded with i), as outcome indices; the
    proposals and the engines' statistics."""
    rec = Recorder(case.drafter)
    stats = SpecStats()
    idx = []
    for start in range(0, n, case.batch):
        engine = Engine(target, rec, case.policy, hidden_layers=rec.hidden_layers)
        reqs = [
            Request(PROMPT, NEW, replace(PARAMS, seed=start + i)) for i in range(min(case.batch, n - start))
        ]
        engine.add(reqs)
        out: dict[int, list[int]] = {}
        while engine.active:
            if case.before_step is not None:
                case.before_step(engine)
            for ev in engine.step():
                out.setdefault(ev.request_id, []).extend(ev.tokens)
        stats.merge(engine.stats)
        for r in reqs:
            idx.append(sum(t * V ** (NEW - 1 - j) for j, t in enumerate(out[r.id])))
    return torch.tensor(idx), rec, stats


CASES = [
    "model",
    "lookup",
    "lookup-tree",
    "tree-branches",
    "ouroboros",
    "ouroboros-model",
    "tree-dyn",
    "tree-static",
    "suffix",
    "bigram",
    "self",
    "pruned",
    "pruned-head",
    "gated-best-prefix",
    "gated-early-stop",
    "gated-head",
    "feature",
    "feature-head",
    "feature-prompt",
    "tree-feature",
    "feature-after-plain",
    "tree-feature-after-plain",
    "dream",
    "local-fused",
    "flex",
    "flex-sequential",
    "ctc",
    "diffusion",
    "cost-aware-trim",
    "cost-aware-rows",
    "cost-aware-rows-shadow",
    "cost-aware-safe-arm",
    "server-row-caps",
    "server-row-caps-tree",
]


@pytest.mark.parametrize("name", CASES)
def test_sampled_output_follows_the_target_distribution(target, exact, name):
    case = make_case(name, target)
    idx, rec, stats = sample_outputs(target, case, N)
    assert_within_bound(idx, exact)
    assert stats.accepted > 0  # drafts were verified and accepted
    # and rejected (the target's own drafts never are)
    assert stats.accepted < stats.drafted or name == "self"
    if case.check is not None:
        case.check(rec, case.policy)


def assert_within_bound(idx: torch.Tensor, exact: torch.Tensor) -> None:
    """The TV distance of the first quarter and of all samples under the bound, and shrinking."""
    small, large = tv(idx[: N // 4], exact), tv(idx, exact)
    assert small < bound(exact, N // 4), (small, bound(exact, N // 4))
    assert large < bound(exact, N), (large, bound(exact, N))
    assert large < small  # shrinks with the sample count


@pytest.mark.skipif(not kernels.available(), reason=f"native kernels unavailable ({kernels.status()})")
def test_ragged_quantized_steps_follow_the_target_distribution(tmp_path, monkeypatch):
    """The quantized runtime verifies each row's own 1 + k_b tokens only (ragged steps, issue 17):
    with the server's per-row caps (0, 1, 3 drafts: ragged rows) its sampled output is still its
    own distribution. Target and draft: GGUFs of this file's vocabulary, the same weights with heads
    scaled 2 and 1.5 (a close draft: most rows accept all drafts and take the bonus token, where a
    step that dropped each row's last token would sample from zero logits, TV ~0.2: caught)."""
    from specdraft.models.quant import QuantRuntime
    from tests.models.test_quant import TYPES, write_tiny_gguf
    from tests.models.test_quant_ragged import RaggedSpy

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))  # the GGUF index cache
    write_tiny_gguf(tmp_path / "v8.gguf", TYPES["Q8_0"], head_scale=2.0, vocab_size=V)
    write_tiny_gguf(tmp_path / "d8.gguf", TYPES["Q4_1"], head_scale=1.5, vocab_size=V)
    target = RaggedSpy(tmp_path / "v8.gguf")
    exact = exact_distribution(target)
    case = make_case("server-row-caps", target, draft=QuantRuntime(tmp_path / "d8.gguf"))
    idx, rec, stats = sample_outputs(target, case, N)
    assert_within_bound(idx, exact)
    assert 0 < stats.accepted < stats.drafted and target.ragged_steps
    case.check(rec, case.policy)


@pytest.fixture(scope="module")
def quant_target(tmp_path_factory):
    """A GGUF of this file's vocabulary (Q8_0, head scaled 2) on the quantized runtime, its exact
    output distribution and its transformers reference (the de-quantized weights)."""
    from specdraft.models.quant import QuantRuntime
    from tests.models.test_quant import TYPES, write_tiny_gguf

    path = tmp_path_factory.mktemp("tv-gguf") / "v8.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDRAFT_CACHE", str(path.parent / "cache"))  # the GGUF index cache
        model = write_tiny_gguf(path, TYPES["Q8_0"], head_scale=2.0, vocab_size=V)
        rt = QuantRuntime(path)
    return rt, exact_distribution(rt), model


QUANT_DRAFTS = ["q-prune", "q-prune-head", "q-designed", "q-feature"]


def quant_draft(name: str, rt, model):
    """The drafts of ``--draft-dtype q`` (issue 15): ``prune:0`` as a view of the target's blocks,
    with a head subset (``head=N``: its rows of the quantized head), and a designed draft's matrices
    as Q8_0 blocks made at load (a changed copy of the target's layer 1; head ids 0 1 2 4 6), and a
    feature draft's the same way (its layer and input projection; the GGUF's embedding)."""
    from specdraft.design.prune import depth_prune
    from specdraft.models.quant import QuantRuntime, QuantWeights, quantize_matrix

    head = torch.tensor([0, 1, 2, 4, 6])
    pruned = ModelDrafter(QuantRuntime(rt.w.with_layers([0])), "prune:0")
    if name == "q-prune":
        return pruned
    if name == "q-prune-head":
        return with_head(pruned, head)
    draft = depth_prune(model, [1])
    draft.model.layers[0].mlp.up_proj.weight.data.mul_(1.5)
    w = QuantWeights.from_llama(draft.state_dict(), draft.config.to_dict(), rt.w, head)
    runtime = SubsetHeadRuntime(QuantRuntime(w), head, V)
    if name == "q-designed":
        return ModelDrafter(runtime, "designed")
    C = w.hidden
    fc = torch.cat([0.1 * torch.randn(C, C, generator=torch.Generator().manual_seed(0)), torch.eye(C)], 1)
    return FeatureDrafter(runtime, quantize_matrix(fc).repacked(), rt.w.embed, "q-feature")


@pytest.mark.skipif(not kernels.available(), reason=f"native kernels unavailable ({kernels.status()})")
@pytest.mark.parametrize("name", QUANT_DRAFTS)
def test_quantized_drafts_follow_the_target_distribution(quant_target, name):
    rt, exact, model = quant_target
    drafter = quant_draft(name, rt, model)
    idx, _, stats = sample_outputs(rt, Case(drafter, FixedK(2)), N)
    assert_within_bound(idx, exact)
    assert 0 < stats.accepted < stats.drafted
    if name in ("q-prune-head", "q-designed"):  # the head subset is in place: q = 0 outside 0 1 2 4 6
        x = torch.tensor([PROMPT])
        logits = drafter.runtime.forward(drafter.runtime.new_state(1, 8), x, torch.arange(5)[None]).logits
        assert torch.isinf(logits[..., [3, 5, 7]]).all()
        assert torch.isfinite(logits[..., [0, 1, 2, 4, 6]]).all()


@pytest.mark.skipif(not kernels.available(), reason=f"native kernels unavailable ({kernels.status()})")
@pytest.mark.parametrize("name", ["tree-branches", "tree-dyn"])
def test_token_trees_on_the_quantized_target_follow_its_distribution(quant_target, name):
    """Token-tree verification on the quantized runtime (its native tree attention: each node's
    row a chain step's over its path): the sampled output is the target's own distribution."""
    rt, exact, _ = quant_target
    case = make_case(name, rt)
    idx, rec, _ = sample_outputs(rt, case, N)
    assert_within_bound(idx, exact)
    case.check(rec, case.policy)


def test_the_old_gating_rule_fails_this_test(target, exact):
    """Gating on the sampled token's own q (the bug) is far outside the bound with the same draft."""
    case = make_case("old-gate", target)
    idx, rec, _ = sample_outputs(target, case, N)
    nv = torch.cat(rec.num_valid)
    assert bool((nv == 0).any()) and bool((nv > 0).any())
    assert tv(idx, exact) > bound(exact, N), (tv(idx, exact), bound(exact, N))


# ------------------------------------------------------------------ the worked example
class FixedQ:
    """A draft runtime whose every next-token distribution is ``q`` (a 2-token vocabulary)."""

    def __init__(self, q: torch.Tensor):
        self.logits = q.log()
        self.vocab_size, self.max_context, self.dtype = q.numel(), 64, torch.float32

    def new_state(self, batch_size, capacity):
        return None

    def forward(self, state, tokens, positions, logits_index=None, **kw):
        T = tokens.shape[1] if logits_index is None else logits_index.shape[1]
        return SimpleNamespace(logits=self.logits.expand(tokens.shape[0], T, -1).clone())


def gated_output(q: torch.Tensor, p: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """The exact output distribution of one k = 1 step when the drawn token x is proposed iff
    ``proposed[x]``: proposed, x is accepted with ``min(1, p(x)/q(x))``, else the residual
    ``norm(max(p - q, 0))`` is sampled; not proposed, the step samples p."""
    accept = (p / q).clamp(max=1)  # (V,)
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum()
    out = torch.zeros_like(p)
    for x in range(len(q)):
        if proposed[x]:
            out += q[x] * (
                (1 - accept[x]) * residual + accept[x] * torch.nn.functional.one_hot(torch.tensor(x), len(q))
            )
        else:
            out += q[x] * p
    return out


def first_token_frequency(drafter, p: torch.Tensor, rows: int) -> float:
    """Propose k = 1 for ``rows`` independent rows and verify against p; P(output token 0)."""
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    ctx = DraftContext(torch.zeros(rows, 4, dtype=torch.int64), torch.full((rows,), 2), [PARAMS] * rows, gens)
    prop = drafter.propose(drafter.new_state(rows, 8), ctx, 1)
    verdict = verify_sampling(prop.tokens, prop.probs, p.expand(rows, 2, -1), gens, prop.num_valid)
    return float((verdict.tokens[:, 0] == 0).double().mean())


def test_worked_example_gate_on_the_sampled_token_gives_042_and_the_fix_gives_03():
    """k = 1, q = (0.6, 0.4), p = (0.3, 0.7); proposing pays when the confidence exceeds 0.5
    (verifying 2 tokens costs 1.5 plain steps). Gating on q of the sampled token proposes A only:
    P(A) = 0.6 * 0.3 / 0.6 + 0.4 * 0.3 = 0.42. Gating on the distribution (max q = 0.6) always
    proposes, and rejection sampling gives p(A) = 0.3."""
    q, p = torch.tensor([0.6, 0.4]), torch.tensor([0.3, 0.7])
    cost = VerifyCost([1.0, 1.5], 0.0)
    exact_old = gated_output(q, p, proposed=q > 0.5)  # (True, False): only A is proposed
    exact_new = gated_output(q, p, proposed=torch.full((2,), bool(q.max() > 0.5)))  # always proposed
    assert float(exact_old[0]) == pytest.approx(0.42) and float(exact_new[0]) == pytest.approx(0.3)
    rows = 4000  # standard error ~0.007
    old = first_token_frequency(SampledTokenGate(FixedQ(q), "old", cost=cost), p, rows)
    new = first_token_frequency(GatedDrafter(FixedQ(q), "gated", cost=cost), p, rows)
    assert old == pytest.approx(0.42, abs=0.035)
    assert new == pytest.approx(0.3, abs=0.035)


def test_whether_a_position_is_proposed_never_depends_on_its_own_token(target):
    """The property behind the fix, checked row by row: sampling rows that drew the same tokens
    before position i agree on whether position i is proposed, whatever they drew at i. Greedy rows
    in the same batch propose what an all-greedy batch proposes (their rule is unchanged)."""
    gated = GatedDrafter(_distilled(), "gated", cost=VerifyCost([1.0, 1.6, 1.8, 2.4], 0.05))
    B, k, greedy_rows = 400, 3, 4
    params = [SamplingParams()] * greedy_rows + [replace(PARAMS, seed=i) for i in range(B - greedy_rows)]
    gens = [torch.Generator().manual_seed(i) for i in range(B)]
    tokens = torch.tensor(PROMPT + [0] * 8).expand(B, -1).clone()
    ctx = DraftContext(tokens, torch.full((B,), len(PROMPT)), params, gens)
    prop = gated.propose(gated.new_state(B, 16), ctx, k)
    sampled_nv, drafts = prop.num_valid[greedy_rows:], prop.tokens[greedy_rows:]
    assert len(set(sampled_nv.tolist())) >= 2  # the decision varies across rows
    for i in range(k):
        reached = sampled_nv >= i  # rows whose proposal got to position i
        groups: dict[tuple, set] = {}
        for before, at, proposed in zip(
            drafts[reached, :i].tolist(), drafts[reached, i].tolist(), (sampled_nv[reached] > i).tolist()
        ):
            groups.setdefault(tuple(before), set()).add((at, proposed))
        for before, seen in groups.items():
            assert len({proposed for _, proposed in seen}) == 1, (i, before, sorted(seen))
    greedy_ctx = DraftContext(tokens[:1], ctx.lengths[:1], [SamplingParams()], [None])
    alone = gated.propose(gated.new_state(1, 16), greedy_ctx, k)
    assert prop.num_valid[:greedy_rows].tolist() == alone.num_valid.tolist() * greedy_rows
    m = int(alone.num_valid[0])
    assert prop.tokens[:greedy_rows, :m].tolist() == alone.tokens[:, :m].tolist() * greedy_rows
