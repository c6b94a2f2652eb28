"""Speculative sampling is lossless: with a deliberately different draft, the generated sequences
follow the target's exact distribution (computed by enumeration over a tiny vocabulary).

The target and the draft are tiny random Llamas with a vocabulary of 8 whose LM heads are scaled up
so that their next-token distributions are peaked and different (a sampler that followed the draft
instead of the target would be far off). Three tokens are generated, so there are 8^3 = 512
possible outputs, and each sequence's exact probability is the product of the target's processed
next-token probabilities (temperature, top-k, top-p applied as the engine applies them).

The bound on the total-variation distance between the empirical and the exact distribution after
n samples: E[TV] <= 1/2 sum_x sqrt(p(x)(1 - p(x)) / n) (Jensen, per outcome), and TV moves by at
most 1/n when one sample changes, so by McDiarmid P(TV >= E[TV] + t) <= exp(-2 n t^2). With
t = sqrt(ln(1/delta) / (2n)) and delta = 1e-6, a correct sampler exceeds the bound once in a
million runs (and the seeds are fixed, so the test is deterministic).
"""

import math

import pytest
import torch

from specdraft.drafters.model import ModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, Request, generate
from specdraft.models.llama import LlamaRuntime, LlamaWeights
from specdraft.models.tiny import tiny_llama
from specdraft.policy import FixedK
from specdraft.verify import SamplingParams, logits_to_probs

V = 8
NEW = 3
PROMPT = [1, 2, 3, 1, 2]
DELTA = 1e-6


def peaked(seed: int, scale: float) -> LlamaRuntime:
    w = LlamaWeights.from_hf(tiny_llama(vocab_size=V, seed=seed), torch.float32)
    w.lm_head = w.lm_head * scale  # untied: only the head is scaled
    return LlamaRuntime(w)


@pytest.fixture(scope="module")
def models():
    return peaked(seed=10, scale=12.0), peaked(seed=11, scale=12.0)


def exact_distribution(runtime: LlamaRuntime, params: SamplingParams) -> torch.Tensor:
    """P(output = x) for every x in V^NEW, in lexicographic order (index sum x_j V^(NEW-1-j))."""
    outs = torch.cartesian_prod(*[torch.arange(V)] * NEW)  # (V^NEW, NEW)
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(outs), -1), outs], 1)
    T = seqs.shape[1]
    logits = runtime.forward(
        runtime.new_state(len(seqs), T), seqs, torch.arange(T).expand(len(seqs), T)
    ).logits
    probs = logits_to_probs(logits[:, len(PROMPT) - 1 : -1], params)  # (V^NEW, NEW, V)
    return probs.gather(-1, outs.unsqueeze(-1)).squeeze(-1).prod(-1)


def sample_outputs(target, drafter, k, params: SamplingParams, n: int, seed0: int = 0, batch: int = 1000):
    """n speculative samples (each its own seeded request), as outcome indices; and the last engine."""
    idx = []
    for start in range(0, n, batch):
        engine = Engine(target, drafter, FixedK(k))
        reqs = [
            Request(
                PROMPT,
                NEW,
                SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed0 + start + i),
            )
            for i in range(min(batch, n - start))
        ]
        out: dict[int, list[int]] = {}
        for ev in generate(engine, reqs):
            out.setdefault(ev.request_id, []).extend(ev.tokens)
        for r in reqs:
            toks = out[r.id]
            assert len(toks) == NEW
            idx.append(sum(t * V ** (NEW - 1 - j) for j, t in enumerate(toks)))
    return torch.tensor(idx), engine


def tv(idx: torch.Tensor, exact: torch.Tensor) -> float:
    freq = torch.bincount(idx, minlength=len(exact)).double() / len(idx)
    return 0.5 * float((freq - exact.double()).abs().sum())


def bound(exact: torch.Tensor, n: int) -> float:
    p = exact.double()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def test_model_draft_reproduces_the_target_distribution(models):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, params)
    assert float(exact.sum()) == pytest.approx(1.0, abs=1e-5)
    n = 2000
    idx, engine = sample_outputs(target, ModelDrafter(draft, "other"), 2, params, n)
    assert 0.05 < engine.stats.acceptance_rate < 0.95  # drafts are both accepted and rejected
    small, large = tv(idx[:500], exact), tv(idx, exact)
    assert small < bound(exact, 500), (small, bound(exact, 500))
    assert large < bound(exact, n), (large, bound(exact, n))
    assert large < small  # shrinks with the sample count
    # the draft's own distribution is far outside the bound: following q would be caught
    draft_exact = exact_distribution(draft, params)
    assert 0.5 * float((draft_exact - exact).abs().sum()) > 3 * bound(exact, n)


def test_temperature_top_k_top_p_are_applied_to_p_and_q_alike(models):
    target, draft = models
    params = SamplingParams(temperature=1.3, top_k=6, top_p=0.95)
    exact = exact_distribution(target, params)
    assert 30 < int((exact > 0).sum()) < V**NEW  # top-k / top-p really cut the support
    n = 1500
    idx, engine = sample_outputs(target, ModelDrafter(draft, "other"), 2, params, n)
    assert engine.stats.accepted > 0
    assert bool((exact[idx] > 0).all())  # never a token outside top-k / top-p
    assert tv(idx, exact) < bound(exact, n), (tv(idx, exact), bound(exact, n))


def test_draft_without_distribution_reproduces_the_target_distribution(models):
    """Prompt lookup (no q): drafts checked by exact match against samples from p."""
    target, _ = models
    params = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, params)
    n = 1500
    idx, engine = sample_outputs(target, PromptLookupDrafter(), 3, params, n)
    assert engine.stats.drafted > 0 and engine.stats.accepted > 0
    assert tv(idx, exact) < bound(exact, n), (tv(idx, exact), bound(exact, n))


def test_a_biased_verifier_fails_this_test(models, monkeypatch):
    """A classic bug, the recovered token drawn from p instead of norm(max(p - q, 0)), is caught."""
    from specdraft import verify

    real = verify.verify_sampling

    def recover_from_p(draft_tokens, draft_probs, target_probs, generators, num_valid=None):
        v = real(draft_tokens, draft_probs, target_probs, generators, num_valid)
        B = draft_tokens.shape[0]
        for b in range(B):
            n = int(v.num_accepted[b])
            if n < draft_tokens.shape[1]:
                v.tokens[b, n] = verify.sample(target_probs[b, n], generators[b])
        return v

    monkeypatch.setattr(verify, "verify_sampling", recover_from_p)
    target, draft = models
    params = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, params)
    n = 2000
    idx, _ = sample_outputs(target, ModelDrafter(draft, "other"), 2, params, n)
    assert tv(idx, exact) > bound(exact, n)
