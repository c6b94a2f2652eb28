"""The attack's losses and methods on tiny random models (issue 17)."""

import itertools

import pytest
import torch

from specdraft.attack.continuous import ContinuousConfig, attack_continuous, window
from specdraft.attack.discrete import DiscreteConfig, attack_discrete
from specdraft.attack.lookup import (
    aimed_decoys,
    attack_lookup,
    least_accepted_length,
    lookup_steps,
    out_of_reach,
    simulated_lookup_length,
)
from specdraft.attack.losses import (
    Models,
    Prefix,
    continuation_slice,
    degradation,
    greedy_from_embeds,
    preservation,
    project_out,
    simulated_accepted_length,
    teacher_forced,
)
from specdraft.attack.run import layer_subset, rouge_l
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.tiny import tiny_llama

PROMPT = list(b"the cat sat on the mat")


@pytest.fixture(scope="module")
def models() -> Models:
    target = tiny_llama()
    return Models(target, layer_subset(target, [0]))


def greedy(models: Models, delta=None, n: int = 8) -> list[int]:
    x = models.target_embedding[torch.tensor(PROMPT)].detach()
    return greedy_from_embeds(models.target, (x if delta is None else x + delta).unsqueeze(0), n)


def test_project_out_removes_the_preservation_component():
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    h = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    assert abs(float((g * h).sum())) > 1e-2  # the test can fail: g starts with a component along h
    r = project_out(g, h)
    assert abs(float((r * h).sum())) < 1e-5 * float(g.norm() * h.norm())
    assert torch.allclose(g - r, (g * h).sum() / (h * h).sum() * h, atol=1e-6)
    assert torch.equal(project_out(g, torch.zeros_like(h)), g)


def test_losses_by_hand():
    logq = torch.log(torch.tensor([[[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]]]).clamp_min(1e-30))  # (1, 2, 3)
    logp = torch.log(torch.tensor([[[1.0, 0.0, 0.0], [0.2, 0.2, 0.6]]]).clamp_min(1e-30))
    y = torch.tensor([0, 2])
    assert degradation(logq, y).item() == pytest.approx((0.5 + 0.7) / 2)
    assert degradation(logq, y, logp).item() == pytest.approx((0.5 + 0.9) / 2)  # sum min(p, q)
    assert preservation(logp, logp).item() == pytest.approx(0.0, abs=1e-6)
    assert preservation(logp, logq).item() > 0


def test_simulated_accepted_length():
    assert simulated_accepted_length([False] * 6, 4) == 1.0
    assert simulated_accepted_length([True] * 9, 2) == 3.0  # steps accept 2 and emit 1
    assert simulated_accepted_length([True, True, False, True], 5) == pytest.approx(4 / 2)


def test_continuous_with_large_lambda_keeps_the_target_greedy_output(models):
    y = greedy(models)
    found = attack_continuous(
        models, PROMPT, y, ContinuousConfig(steps=6, eps=0.5, step_size=0.05, lam=1000.0, stop_matches=None)
    )
    assert all(h["keeps_argmax"] for h in found.history)
    # the target's own greedy decoding from the perturbed embeddings, not the teacher-forced check
    last = found.history[-1]
    assert greedy(models, found.delta) == y and last["preservation"] < 1e-3
    without = attack_continuous(
        models, PROMPT, y, ContinuousConfig(steps=6, eps=0.5, step_size=0.2, lam=0.0, stop_matches=None)
    )
    steps = [h for h in without.history if "shrunk" not in h]
    assert steps[-1]["preservation"] > 10 * last["preservation"]  # the term is what keeps it


def test_continuous_degradation_decreases_and_stays_bounded(models):
    y = greedy(models)
    cfg = ContinuousConfig(steps=8, eps=0.5, step_size=0.2, lam=0.0, stop_matches=None)
    found = attack_continuous(models, PROMPT, y, cfg)
    degs = [h["degradation"] for h in found.history if "shrunk" not in h]
    assert all(b < a for a, b in itertools.pairwise(degs)) and degs[-1] < 0.9 * degs[0]
    radius = cfg.eps * float(models.target_embedding.norm(dim=1).mean())
    delta = attack_continuous(models, PROMPT, y, ContinuousConfig(steps=3, eps=0.5, step_size=1.0, lam=0.0))
    assert float(delta.delta.norm(dim=1).max()) <= radius * (1 + 1e-4)


def test_continuous_shrinks_the_perturbation_when_no_iterate_keeps_the_argmax(models):
    y = greedy(models)
    cfg = ContinuousConfig(steps=6, eps=0.5, step_size=0.2, lam=0.0, stop_matches=None)
    found = attack_continuous(models, PROMPT, y, cfg)
    steps, shrunk = found.history[: cfg.steps], found.history[cfg.steps :]
    assert not any(h["keeps_argmax"] for h in steps)  # every step changed the target's argmax
    assert [h["shrunk"] for h in shrunk] == list(range(1, len(shrunk) + 1)) and shrunk[-1]["keeps_argmax"]
    assert found.delta.any() and found.degradation == pytest.approx(shrunk[-1]["degradation"])
    assert greedy(models, found.delta) == y  # the kept half: the target's output is unchanged
    unshrunk = attack_continuous(models, PROMPT, y, ContinuousConfig(**{**vars(cfg), "shrink": 0}))
    assert len(unshrunk.history) == cfg.steps and not unshrunk.delta.any()


def test_continuous_stops_early_once_the_bound_on_matches_is_met(models):
    y = greedy(models)
    kw = {"steps": 5, "eps": 0.5, "step_size": 0.05, "lam": 1000.0}  # every iterate keeps the argmax
    every = attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, stop_matches=None)).history
    assert len(every) == 5 and all(h["keeps_argmax"] for h in every)
    lowest = min(h["matches"] for h in every)
    first = next(i for i, h in enumerate(every) if h["matches"] <= lowest)
    early = attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, stop_matches=lowest)).history
    assert early == every[: first + 1]  # stops at the first kept iterate within the bound
    assert len(attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, stop_matches=1.0)).history) == 1


def test_continuous_stops_before_a_step_that_would_end_past_its_time_budget(models, monkeypatch):
    clock = iter(range(1000))  # every reading of the clock a second later than the one before
    monkeypatch.setattr("specdraft.attack.continuous.time.perf_counter", lambda: float(next(clock)))
    y = greedy(models)
    kw = {"steps": 5, "eps": 0.5, "step_size": 0.05, "lam": 1000.0, "stop_matches": None}
    every = attack_continuous(models, PROMPT, y, ContinuousConfig(**kw)).history
    # at its second step the search has read the clock twice since it started: 2 s, a step's pace so
    # far, so one more would end at 4 s, past a 1.5 s budget
    short = attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, seconds=1.5)).history
    assert short == every[:1]
    assert attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, seconds=60)).history == every


def test_scoring_only_the_continuation_matches_the_full_forward(models):
    y = greedy(models)
    x = models.target_embedding[torch.tensor(PROMPT + y)].detach().unsqueeze(0)
    full = models.draft_logprobs(x)[:, continuation_slice(len(PROMPT), len(y))]
    xp, xy = x[:, : len(PROMPT)], x[:, len(PROMPT) :]
    kept = models.draft_logprobs(teacher_forced(xp, xy), keep=len(y))
    assert kept.shape == full.shape and torch.allclose(kept, full, atol=1e-5)


def test_a_prefix_computed_once_scores_as_the_whole_input_and_stays_as_it_was(models):
    y = greedy(models)
    x = models.target_embedding[torch.tensor(PROMPT)].detach().unsqueeze(0)
    xy = models.target_embedding[torch.tensor(y)].detach().unsqueeze(0)
    prefix = Prefix(models, x[:, :15], x[:, :15])
    for logprobs in (models.target_logprobs, models.draft_logprobs):
        full = logprobs(teacher_forced(x, xy), keep=len(y))
        for _ in range(2):  # the second call starts from the same 15 positions as the first
            cut = logprobs(teacher_forced(x[:, 15:], xy), keep=len(y), prefix=prefix)
            assert torch.allclose(cut, full, atol=1e-5)
    assert prefix.target.get_seq_length() == prefix.draft.get_seq_length() == 15


def test_continuous_window_perturbs_the_last_positions_and_runs_from_them(models):
    y = greedy(models)
    kw = {"steps": 4, "eps": 0.5, "step_size": 0.2, "lam": 0.0, "stop_matches": None}
    positions = torch.zeros(len(PROMPT), dtype=torch.bool)
    positions[2:-2] = True
    windowed = window(positions, ContinuousConfig(window=5))
    assert windowed.nonzero()[:, 0].tolist() == list(range(len(PROMPT) - 7, len(PROMPT) - 2))
    assert torch.equal(window(positions, ContinuousConfig(window=None)), positions)
    cut = attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, window=5), positions)
    # the same search over the whole input each step (no window, the same 5 positions allowed)
    whole = attack_continuous(models, PROMPT, y, ContinuousConfig(**kw, window=None), windowed)
    assert cut.delta[~windowed].abs().max() == 0 and cut.delta[windowed].abs().max() > 0
    assert torch.allclose(cut.delta, whole.delta, atol=1e-4)
    assert [h["keeps_argmax"] for h in cut.history] == [h["keeps_argmax"] for h in whole.history]
    degs = [(a["degradation"], b["degradation"]) for a, b in zip(cut.history, whole.history)]
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in degs)


def test_cached_greedy_matches_full_forwards(models):
    emb = models.target.get_input_embeddings()
    x = emb(torch.tensor([PROMPT])).detach()
    ids = []
    with torch.no_grad():
        for _ in range(10):  # the reference: every token from a whole-sequence forward
            seq = torch.cat([x, emb(torch.tensor([ids], dtype=torch.int64))], 1)
            ids.append(int(models.target(inputs_embeds=seq, use_cache=False).logits[0, -1].argmax()))
    assert greedy_from_embeds(models.target, x, 10) == ids and greedy_from_embeds(models.target, x, 0) == []


def test_discrete_lowers_the_loss(models):
    y = greedy(models)
    head, suffix = PROMPT, list(b" ! ! ! !")
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[32:127] = True
    found = attack_discrete(
        models, head, [], y, suffix, DiscreteConfig(steps=6, candidates=16, lam=0.0), allowed, clean=PROMPT
    )
    losses = [h["loss"] for h in found.history]
    assert losses[-1] < losses[0] and all(b <= a for a, b in itertools.pairwise(losses))
    assert len(found.suffix) == len(suffix) and all(32 <= t < 127 for t in found.suffix)


def test_discrete_from_the_head_computed_once_searches_as_over_the_whole_prompt(models, monkeypatch):
    y = greedy(models)
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[32:127] = True
    cfg = DiscreteConfig(steps=4, candidates=12, batch=5, lam=1.0)  # batches of 5 and 2: two sizes
    args = (models, PROMPT[:-6], PROMPT[-2:], y, list(b" !!!"), cfg, allowed)
    cut = attack_discrete(*args, clean=PROMPT)
    monkeypatch.setattr("specdraft.attack.discrete.Prefix", lambda *a: None)  # every forward whole
    whole = attack_discrete(*args, clean=PROMPT)
    assert cut.suffix == whole.suffix and cut.keeps_argmax == whole.keeps_argmax
    assert [h["loss"] for h in cut.history] == pytest.approx([h["loss"] for h in whole.history], abs=1e-5)
    assert cut.suffix != cut.start  # the test can fail: a swap was kept


def test_discrete_starts_from_a_suffix_that_keeps_the_answer_and_stays_there(models):
    y = greedy(models)
    head, own = PROMPT[:-4], PROMPT[-4:]  # the prompt's own last tokens: the clean prompt itself
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[32:127] = True
    cfg = DiscreteConfig(steps=6, candidates=16, lam=0.0)  # pure degradation: nothing else keeps y
    bang = list(b"!!!!")
    alone = attack_discrete(models, head, [], y, bang, cfg, allowed, clean=PROMPT)
    found = attack_discrete(models, head, [], y, bang, cfg, allowed, clean=PROMPT, starts=[own])
    assert not alone.keeps_argmax  # the test can fail: from "!!!!" the search loses the answer
    assert found.keeps_argmax and found.history[-1]["degradation"] <= found.history[0]["degradation"]
    assert found.start == own and alone.start == bang
    with pytest.raises(SpecdraftError, match="same length"):
        attack_discrete(models, head, [], y, bang, cfg, allowed, starts=[own[:2]])


TEXT, Y, WRONG = "one two three four", list(b" five six seven eight five six seven eight"), list(b" zzz qqq")


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode()


def test_lookup_decoys_lower_the_simulated_acceptance():
    drafter = PromptLookupDrafter(3)
    clean = simulated_lookup_length(drafter, encode(TEXT), Y, 4)
    found = attack_lookup(drafter, TEXT, encode, decode, lambda ids: Y, lambda a: True, Y, 4, WRONG)
    assert found.decoys and found.simulated[0] == clean
    assert simulated_lookup_length(drafter, encode(found.text), Y, 4) == found.simulated[-1] < clean
    # aimed: the first decoy is the 3-gram before the step that accepted most, then wrong tokens
    i, m, _, _ = max(lookup_steps(drafter, encode(TEXT), Y, 4), key=lambda s: s[1])
    assert m == 4 and aimed_decoys(drafter, encode(TEXT), Y, 4, WRONG)[0] == [*Y[i - 3 : i], *WRONG[:4]]


def test_lookup_keeps_a_decoy_only_on_the_answer_the_target_writes_then():
    drafter = PromptLookupDrafter(3)
    # a target that answers with the decoys, repeated: lookup accepts more there, so nothing is kept
    copies = lambda ids: (ids[len(encode(TEXT)) :] * len(Y))[: len(Y)]  # noqa: E731
    found = attack_lookup(drafter, TEXT, encode, decode, copies, lambda a: True, Y, 4, WRONG)
    assert found.text == TEXT and not found.decoys
    # an answer the stealth rule refuses is not kept either
    refused = attack_lookup(drafter, TEXT, encode, decode, lambda ids: Y, lambda a: False, Y, 4, WRONG)
    assert refused.text == TEXT and not refused.decoys


def test_rouge_l():
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 2, 3, 4], [5, 6]) == 0.0
    assert rouge_l([1, 2, 3, 4], [1, 3, 9, 4]) == pytest.approx(0.75)


def test_lookup_steps_copied_from_the_answer_at_the_longest_n_are_out_of_a_decoys_reach():
    """An answer that copies the prompt has nothing out of reach; one that repeats a phrase of its
    own has its repeats at the longest n out of reach, and a decoy appended to the prompt (the
    phrase with a wrong continuation) leaves them as they are; the least accepted length counts
    every accepted token within reach as a step of its own."""
    drafter = PromptLookupDrafter(3)
    prompt = encode("the quick brown fox jumps over the lazy dog. ")
    copied = encode("quick brown fox jumps over the lazy dog")
    steps, accepted, fixed = out_of_reach(drafter, prompt, copied, 4)
    assert fixed == 0 < accepted and least_accepted_length(steps, accepted, fixed) == 1.0
    own = encode("ab12 cd ab12 cd ab12 cd ab12 cd")
    steps, accepted, fixed = out_of_reach(drafter, prompt, own, 4)
    assert 0 < fixed <= accepted
    assert out_of_reach(drafter, prompt + encode("ab12 xx"), own, 4)[2] == fixed
    mean = (steps + accepted) / steps
    assert 1.0 < least_accepted_length(steps, accepted, fixed) <= mean
    assert all(m == 0 or 0 <= end < len(prompt) + i for i, m, _, end in lookup_steps(drafter, prompt, own, 4))
